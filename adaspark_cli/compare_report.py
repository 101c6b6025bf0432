"""Plain-text tables and a PNG of ``adaspark compare``'s summary (``adaspark_core.stats.summarize``).
Formatting only: every number comes from the summary dict.

``tables(summary)`` renders, in order (each part skipped when its data is absent):
decode tok/s per source (Tables 4, 6 first row); each arm over the baseline per source and over all
replies (Tables 4, 6, 8); each arm over the baseline by context band (Table 3's rows); the pinned
widths (Table 3: each pinned arm over AdaSpark, the best pinned arm over the baseline, AdaSpark
over the best pinned arm); AdaSpark over the best pld arm per source; the share of rounds at each
width (Figure 8); and the replies each ratio left out and those whose text differs (Table 10).

``figure(summary, path)`` draws each arm's ratio over the baseline per source (and over all
replies) with its 95% interval, with ``adaspark_cli.plot.line_plot``.
"""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from adaspark_core.stats import ALL

ALL_LABEL = "all replies"
BAND_LABEL = {ALL: "all replies", "<2048": "under 2,048", ">=2048": "2,048 and over"}
OTHER_SHARE = 0.01  # widths under this share in every column fold into one row, as in Figure 8


def cell(res, digits: int = 2, interval: bool = True) -> str:
    """``"1.23x [1.10, 1.38]"``; ``"-"`` when there is no ratio."""
    if not res or res.get("ratio") is None:
        return "-"
    s = f"{res['ratio']:.{digits}f}x"
    if interval and res.get("lo") is not None:
        s += f" [{res['lo']:.{digits}f}, {res['hi']:.{digits}f}]"
    return s


def _speed(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def _table(rows, headers) -> str:
    return tabulate(rows, headers, disable_numparse=True)


def tables(summary: dict, digits: int = 2) -> str:
    s = summary
    base, sources = s["baseline"], s["sources"]
    others = [a for a in s["arms"] if a in s["vs_baseline"]]
    out: list[str] = []

    # Decode speed.
    if s["arms"]:
        rows = [[src] + [_speed(s["speed"][a]["by_source"].get(src)) for a in s["arms"]] for src in sources]
        rows.append([ALL_LABEL] + [_speed(s["speed"][a]["overall"]) for a in s["arms"]])
        out.append("Decode tok/s (tokens over decode time summed over replies; each arm's capped and "
                   "single-delta replies left out)")
        out.append(_table(rows, ["source"] + s["arms"]))

    # Ratios over the baseline per source.
    if others:
        rows = [[src] + [cell(s["vs_baseline"][a]["by_source"].get(src), digits) for a in others] for src in sources]
        rows.append([ALL_LABEL] + [cell(s["vs_baseline"][a]["overall"], digits) for a in others])
        rows.append(["replies (convs)"] + [f'{s["vs_baseline"][a]["overall"]["replies"]} '
                                            f'({s["vs_baseline"][a]["overall"]["conversations"]})' for a in others])
        out.append(f"\nOver {base}: geometric mean of per-reply decode ratios, 95% bootstrap interval over "
                   f"conversations (replies capped in either arm or single-delta left out)")
        out.append(_table(rows, ["source"] + others))

        # By context band.
        rows = [[BAND_LABEL[ALL]] + [cell(s["vs_baseline"][a]["overall"], digits) for a in others]]
        for b in s["bands"]:
            rows.append([BAND_LABEL.get(b, b)] + [cell(s["vs_baseline"][a]["by_band"].get(b), digits) for a in others])
        how = "prompt tokens" if s.get("band_by", "prompt") == "prompt" else "prompt plus half the reply"
        out.append(f"\nOver {base} by context band (the arm's reply context: {how})")
        out.append(_table(rows, ["replies"] + others))

    # Pinned widths (Table 3).
    p = s.get("pinned")
    if p:
        pa = p["arms"]
        rows = []
        for b in [ALL] + list(s["bands"]):
            e = p["by_band"][b]
            n = e["adaspark_over_best"]["replies"] if e["adaspark_over_best"] else "-"
            cols = []
            for a in pa:
                c = cell(e["over_adaspark"].get(a), 3, interval=False)
                cols.append(c + (" *" if a == e["best"] and c != "-" else ""))
            rows.append([BAND_LABEL.get(b, b), n] + cols +
                        [e["best"] or "-", cell(e["best_over_baseline"], digits), cell(e["adaspark_over_best"], 3)])
        out.append(f"\nPinned widths (Table 3): each pinned arm over adaspark (* = best pinned arm, the one with "
                   f"the highest ratio over {base} in that band); adaspark over the best pinned arm")
        out.append(_table(rows, ["replies", "n"] + [f"{a} / adaspark" for a in pa] +
                          ["best pinned", f"best / {base}", "adaspark / best"]))

    # Best pld.
    q = s.get("pld")
    if q:
        out.append(f"\nBest prompt-lookup arm: {q['best'] or '-'} ({cell(q['best_over_baseline'], digits)} over {base} "
                   f"over all replies; of {', '.join(q['arms'])})")
        if q["adaspark_over_best"]:
            ada = q["adaspark_over_best"]
            rows = [[src, cell(ada["by_source"].get(src), digits)] for src in sources]
            rows.append([ALL_LABEL, cell(ada["overall"], digits)])
            out.append(_table(rows, ["source", f"adaspark / {q['best']}"]))

    # Widths (Figure 8).
    if s["widths"]:
        wa = list(s["widths"])
        out.append("\nShare of rounds at each verified width (Figure 8; capped replies left out)")
        out.append(_widths_table({a: s["widths"][a]["overall"] for a in wa}, "width"))
        if "adaspark" in s["widths"]:
            per = s["widths"]["adaspark"]["by_source"]
            out.append("\nadaspark's widths by source")
            out.append(_widths_table({src: per[src] for src in sources if src in per}, "width"))

    # Left out and text agreement (Tables 4, 10).
    if others:
        rows = []
        for a in others:
            r = s["vs_baseline"][a]["overall"]
            rows.append([a, r["paired"], r["capped"], r["null"], r["unpaired"], r["replies"], s["looped"].get(a, 0),
                         _frac(r["text_compared"] - r["text_differs"], r["text_compared"]),
                         _frac(r["first_turn_text_compared"] - r["first_turn_text_differs"],
                               r["first_turn_text_compared"]), r["text_differs"]])
        out.append(f"\nReplies paired with {base}, left out of the ratio, and whose text is identical to the "
                   f"baseline's (Table 10; {s['looped_any']} replies reached the cap in some arm)")
        out.append(_table(rows, ["arm", "paired", "capped (either)", "single-delta", "unpaired", "used",
                                 "own capped", "same text", "same text, first turns", "text differs"]))
    return "\n".join(out) + "\n"


def _frac(a: int, b: int) -> str:
    return f"{a}/{b}" if b else "-"


def _widths_table(hists: dict, label: str) -> str:
    widths = sorted({int(w) for h in hists.values() for w in h["share"]})
    keep = [w for w in widths if any(h["share"].get(str(w), 0.0) >= OTHER_SHARE for h in hists.values())]
    fold = [w for w in widths if w not in keep]
    rows = [[w] + [_pct(h["share"].get(str(w))) for h in hists.values()] for w in keep]
    if fold:
        rows.append(["other (<1% each)"] + [_pct(sum(h["share"].get(str(w), 0.0) for w in fold) or None)
                                            for h in hists.values()])
    rows.append(["rounds"] + [h["rounds"] for h in hists.values()])
    return _table(rows, [label] + list(hists))


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def figure(summary: dict, path, title: str = "") -> Path:
    """A PNG of each arm's ratio over the baseline per source and over all replies, with 95%
    intervals (points with whiskers, one colour per arm, a dashed line at 1). Returns the path."""
    from adaspark_cli.plot import line_plot

    s = summary
    others = [a for a in s["arms"] if a in s["vs_baseline"]]
    if not others:
        raise ValueError("no arm besides the baseline to plot")
    cats = list(s["sources"]) + [ALL]
    k = len(others)
    step = 0.7 / k if k > 1 else 0.0
    series = {}
    for i, a in enumerate(others):
        off = (i - (k - 1) / 2) * step
        xs, ys, lo, hi = [], [], [], []
        for j, c in enumerate(cats):
            r = s["vs_baseline"][a]["overall"] if c == ALL else s["vs_baseline"][a]["by_source"].get(c)
            if r and r["ratio"] is not None:
                xs.append(j + off)
                ys.append(r["ratio"])
                lo.append(r["lo"] if r["lo"] is not None else r["ratio"])
                hi.append(r["hi"] if r["hi"] is not None else r["ratio"])
        if xs:
            series[a] = (xs, ys, lo, hi)
    if not series:
        raise ValueError("no ratio to plot")
    # An empty category on the left keeps the legend (drawn top left) off the points.
    room = 1.0
    width = max(800, int(110 * (len(cats) + room)) + 120)
    ticks = [(-room, "")] + [(j, "all" if c == ALL else str(c)) for j, c in enumerate(cats)]
    return line_plot(path, series, x_label="source", y_label=f"decode speed over {s['baseline']}",
                     title=title or f"over {s['baseline']}, 95% interval over conversations",
                     size=(width, 500), connect=False, x_ticks=ticks, hlines=[1.0], legend="left")
