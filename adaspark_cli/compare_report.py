"""Plain-text tables and a PNG of ``adaspark compare``'s summary (``adaspark_core.evaluate.stats.summarize``).
Formatting only: every number comes from the summary dict.

The ratio tables show the summary's headline ratio (``summary["headline"]``: the one that uses more
replies, normally "all paired replies, first N tokens"; else "uncapped replies only (paper)"), and
each says which. ``tables(summary)`` renders, in order (each part skipped when its data is absent):
decode tok/s per source (Tables 4, 6 first row); each arm over the baseline per source and over all
replies (Tables 4, 6, 8); each arm over the baseline by context band (Table 3's rows); both ratios
side by side; the pinned widths (Table 3: each pinned arm over AdaSpark, the best pinned arm over
the baseline, AdaSpark over the best pinned arm); AdaSpark over the best pld arm per source;
AdaSpark over the best fixed arm per source and band; the share of rounds at each width (Figure 8);
the replies each ratio left out and those whose text differs (Table 10); and, for replies under
JSON schemas, how many of each arm's follow their schema. A missing number is a dash, never an
error.

``figure(summary, path)`` draws each arm's headline ratio over the baseline per source (and over all
replies) with its 95% interval, with ``adaspark_cli.plot.line_plot``; with nothing to draw it
writes nothing and returns None.
"""

from __future__ import annotations

from pathlib import Path

from tabulate import tabulate

from adaspark_cli.plot import line_plot
from adaspark_core.evaluate.stats import ALL

ALL_LABEL = "all replies"
BAND_LABEL = {ALL: "all replies", "<2048": "under 2,048", ">=2048": "2,048 and over"}
OTHER_SHARE = 0.01  # widths under this share in every column fold into one row, as in Figure 8
RATIO_LABEL = {"first_n": "all paired replies, first N tokens", "uncapped": "uncapped replies only (paper)"}


def headline(summary: dict) -> tuple[str, dict]:
    """(the headline ratio's name, its parts: vs_baseline, pinned, pld, best_fixed). A summary
    written before the first-N ratio existed has only the paper's."""
    name = summary.get("headline", "uncapped")
    if name == "first_n" and summary.get("first_n"):
        return name, summary["first_n"]
    return "uncapped", {k: summary.get(k) for k in ("vs_baseline", "pinned", "pld", "best_fixed")}


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
    kind, v = headline(s)
    label = RATIO_LABEL[kind]
    vs = v["vs_baseline"] or {}
    others = [a for a in s["arms"] if a in vs]
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
        rows = [[src] + [cell(vs[a]["by_source"].get(src), digits) for a in others] for src in sources]
        rows.append([ALL_LABEL] + [cell(vs[a]["overall"], digits) for a in others])
        rows.append(["replies (convs)"] + [f'{vs[a]["overall"]["replies"]} ({vs[a]["overall"]["conversations"]})'
                                           for a in others])
        what = ("each pair over its first N tokens, N the shorter reply's, capped replies included; "
                "single-delta left out" if kind == "first_n" else "replies capped in either arm or single-delta left out")
        out.append(f"\nOver {base} ({label}): geometric mean of per-reply decode ratios, 95% bootstrap interval "
                   f"over conversations ({what})")
        out.append(_table(rows, ["source"] + others))

        # By context band.
        rows = [[BAND_LABEL[ALL]] + [cell(vs[a]["overall"], digits) for a in others]]
        for b in s["bands"]:
            rows.append([BAND_LABEL.get(b, b)] + [cell(vs[a]["by_band"].get(b), digits) for a in others])
        how = "prompt tokens" if s.get("band_by", "prompt") == "prompt" else "prompt plus half the reply"
        out.append(f"\nOver {base} by context band ({label}; the arm's reply context: {how})")
        out.append(_table(rows, ["replies"] + others))

        # Both ratios, so the headline can be checked against the paper's rule.
        fn = (s.get("first_n") or {}).get("vs_baseline") or {}
        if fn:
            rows = []
            for a in others:
                f, u = fn.get(a, {}).get("overall"), s["vs_baseline"].get(a, {}).get("overall")
                rows.append([a, cell(f, digits), _used(f), _mean_n(f), cell(u, digits), _used(u)])
            out.append(f"\nBoth ratios over {base}, all replies (headline: {label})")
            out.append(_table(rows, ["arm", RATIO_LABEL["first_n"], "used", "mean N",
                                     RATIO_LABEL["uncapped"], "used"]))

    # Pinned widths (Table 3).
    p = v.get("pinned")
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
        out.append(f"\nPinned widths (Table 3, {label}): each pinned arm over adaspark (* = best pinned arm, the "
                   f"one with the highest ratio over {base} in that band); adaspark over the best pinned arm")
        out.append(_table(rows, ["replies", "n"] + [f"{a} / adaspark" for a in pa] +
                          ["best pinned", f"best / {base}", "adaspark / best"]))

    # Best pld.
    q = v.get("pld")
    if q:
        out.append(f"\nBest prompt-lookup arm ({label}): {q['best'] or '-'} ({cell(q['best_over_baseline'], digits)} "
                   f"over {base} over all replies; of {', '.join(q['arms'])})")
        if q["adaspark_over_best"]:
            ada = q["adaspark_over_best"]
            rows = [[src, cell(ada["by_source"].get(src), digits)] for src in sources]
            rows.append([ALL_LABEL, cell(ada["overall"], digits)])
            out.append(_table(rows, ["source", f"adaspark / {q['best']}"]))

    # Best fixed arm: the target is stated against it.
    f = v.get("best_fixed")
    if f:
        out.append(f"\nBest fixed arm ({label}): {f['best'] or '-'} ({cell(f['best_over_baseline'], digits)} over "
                   f"{base} over all replies; of {', '.join(f['arms'])})")
        if f["adaspark_over_best"]:
            ada = f["adaspark_over_best"]
            rows = [[src, cell(ada["by_source"].get(src), digits), _used(ada["by_source"].get(src))] for src in sources]
            rows += [[BAND_LABEL.get(b, b), cell(ada["by_band"].get(b), digits), _used(ada["by_band"].get(b))]
                     for b in s["bands"]]
            rows.append([ALL_LABEL, cell(ada["overall"], digits), _used(ada["overall"])])
            out.append(_table(rows, ["replies", f"adaspark / {f['best']}", "used"]))

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
    paper = [a for a in s["arms"] if a in s["vs_baseline"]]
    if paper:
        fn = (s.get("first_n") or {}).get("vs_baseline") or {}
        rows = []
        for a in paper:
            r = s["vs_baseline"][a]["overall"]
            f = (fn.get(a) or {}).get("overall")
            rows.append([a, r["paired"], r["capped"], r["null"], r["unpaired"], r["replies"],
                         f["replies"] if f else "-", f["no_interval"] if f else "-", f["untraced"] if f else "-",
                         s["looped"].get(a, 0),
                         _frac(r["text_compared"] - r["text_differs"], r["text_compared"]),
                         _frac(r["first_turn_text_compared"] - r["first_turn_text_differs"],
                               r["first_turn_text_compared"]), r["text_differs"]])
        out.append(f"\nReplies paired with {base}, used and left out by each ratio, and whose text is identical to "
                   f"the baseline's (Table 10; {s['looped_any']} replies reached the cap in some arm). Paper: capped "
                   f"in either arm and single-delta left out; first N: no interval (N reached at the first delta) "
                   f"and untraced left out")
        out.append(_table(rows, ["arm", "paired", "capped (either)", "single-delta", "unpaired", "used (paper)",
                                 "used (first N)", "no interval", "untraced", "own capped", "same text",
                                 "same text, first turns", "text differs"]))

    # Structured output: the speeds above mean little for replies that break their schema.
    jv = s.get("json_valid") or {}
    if jv:
        out.append("\nReplies under a JSON schema: those that parse and follow it, and those that reached the cap")
        out.append(_table([["json valid"] + [_frac(jv[a]["valid"], jv[a]["replies"]) for a in jv],
                           ["capped"] + [jv[a]["capped"] for a in jv]], ["replies"] + list(jv)))
    tc = s.get("tool_calls") or {}
    if tc:
        out.append("\nReplies in tool conversations, and those that call a tool")
        out.append(_table([["calling"] + [_frac(tc[a]["calling"], tc[a]["replies"]) for a in tc]], ["replies"] + list(tc)))
    return "\n".join(out) + "\n"


def _frac(a: int, b: int) -> str:
    return f"{a}/{b}" if b else "-"


def _used(res) -> str:
    return "-" if not res else f"{res['replies']}/{res['paired']}"


def _mean_n(res) -> str:
    return "-" if not res or res.get("mean_n") is None else f"{res['mean_n']:.0f}"


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


def figure(summary: dict, path, title: str = "") -> Path | None:
    """A PNG of each arm's headline ratio over the baseline per source and over all replies, with
    95% intervals (points with whiskers, one colour per arm, a dashed line at 1). Returns the path,
    or None, writing nothing, when no arm has a ratio anywhere (e.g. every pair without an
    interval): the run's numbers are still in the tables and compare.json."""
    s = summary
    kind, v = headline(s)
    vs = v["vs_baseline"] or {}
    others = [a for a in s["arms"] if a in vs]
    if not others:
        return None
    cats = list(s["sources"]) + [ALL]
    k = len(others)
    step = 0.7 / k if k > 1 else 0.0
    series = {}
    for i, a in enumerate(others):
        off = (i - (k - 1) / 2) * step
        xs, ys, lo, hi = [], [], [], []
        for j, c in enumerate(cats):
            r = vs[a]["overall"] if c == ALL else vs[a]["by_source"].get(c)
            if r and r["ratio"] is not None:
                xs.append(j + off)
                ys.append(r["ratio"])
                lo.append(r["lo"] if r["lo"] is not None else r["ratio"])
                hi.append(r["hi"] if r["hi"] is not None else r["ratio"])
        if xs:
            series[a] = (xs, ys, lo, hi)
    if not series:
        return None
    # An empty category on the left keeps the legend (drawn top left) off the points.
    room = 1.0
    width = max(800, int(110 * (len(cats) + room)) + 120)
    ticks = [(-room, "")] + [(j, "all" if c == ALL else str(c)) for j, c in enumerate(cats)]
    # The ratio's name on the y axis: the title is often a long model file name already.
    return line_plot(path, series, x_label="source", y_label=f"decode speed over {s['baseline']}: {RATIO_LABEL[kind]}",
                     title=title or f"over {s['baseline']}, 95% interval over conversations",
                     size=(width, 500), connect=False, x_ticks=ticks, hlines=[1.0], legend="left")
