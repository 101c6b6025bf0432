"""Statistics of ``adaspark compare`` (paper §4.1, Appendix A; Tables 3, 4, 6, 8, 10, Figure 8).
Pure functions over reply records; nothing here prints, times or runs a model.

A reply record (``Reply``) is a plain dict, one per (arm, conversation, turn, reply); every dict
shape here is a typed record below.

Rules (paper §4.1 and Appendix A):

* A comparison of ``arm`` over ``base`` pairs their replies by (conversation, turn, reply). A pair
  whose reply reached the token cap in EITHER arm is left out of the ratio and counted
  (``capped``); of the rest, a pair with a null ``tok_s`` in either arm (a single-delta reply, no
  client-clock decode interval) is left out and counted (``null``). A pair that is capped and null
  counts as capped only. Replies present in one arm only are counted (``unpaired``).
* The ratio is the geometric mean over replies of tok_s[arm] / tok_s[base], i.e.
  ``exp(mean(log r))``; all replies of all conversations are pooled (no per-conversation mean).
* Its 95% interval is a percentile bootstrap over conversations: with ``rng =
  numpy.random.default_rng(seed)``, the used conversations sorted by id (``C`` of them), ONE
  draw ``idx = rng.integers(0, C, size=(resamples, C))``; resample b pools every reply of the
  conversations ``idx[b]`` (a conversation drawn twice counts twice) and takes their geometric mean;
  ``lo, hi = numpy.percentile(stats, [2.5, 97.5])`` (linear interpolation). Each group of a keyed
  comparison is bootstrapped on its own, from a fresh ``default_rng(seed)``.
* Group keys are taken from the ``arm``'s record (its source, its context band). The context band
  is ``"<2048"`` / ``">=2048"`` of the arm's ``context`` (prompt tokens of the reply) by default;
  ``band_by="midpoint"`` uses prompt plus half the reply (``context + tokens / 2``), which is the
  paper's definition for Table 3.
* Text agreement (Table 10) counts over ALL paired replies (capped and single-delta included),
  from the ``arm``'s ``same_text_as_baseline`` (a flag the runner sets against ITS baseline, which
  need not be ``base``); null flags are not counted.
* Decode speed of an arm (Tables 4, 6: "generated tokens over decode time, summed over replies")
  is sum(tokens) / sum(tokens / tok_s) over the arm's replies that are neither capped nor null.
* Widths (Figure 8): an arm's ``widths`` (verified rows -> rounds) summed over its replies that
  did not reach the cap (a loop is left out of every statistic, §4.3), as shares of its rounds.

The first-N ratio (all paired replies; not the paper's). On a slow machine most replies reach the
cap, and the paper's rule leaves nearly all of them out; this ratio uses them, over a common length:

* A record's ``trace`` lists its streamed deltas on the client clock: ``[tokens so far, seconds
  since the first delta]``, cumulative, in order. Its first entry is the reference point: the
  first delta, or, for our arms, the decode's start (after the prefill) as ``[0, seconds before
  the first delta]``, so that a reply the first round emitted whole still has an interval.
* For a pair, N = min of the two replies' token counts (the traces' last counts), capped replies
  included. In each arm take the FIRST entry whose count reaches N; its speed is (that count minus
  the reference's count) over (that entry's time minus the reference's time): tokens after the
  first delta, as ``tok_s``, or every token from the decode's start, over about N tokens in both
  arms. The ratio is arm speed / base speed. (A peer's first delta is the one token sampled from
  the prompt's logits, so both references time the same work: the decode after the prompt.)
* A pair where either arm reaches N at its reference, or in no time, has no interval: left out and
  counted (``no_interval``); a pair where either record has no trace is left out and counted
  (``untraced``). Geometric mean, conversation bootstrap and grouping are as for the paper's ratio.
* The headline of a summary is the ratio that uses more replies over the baseline, summed over
  arms (``first_n`` on ties, and normally: it includes what the other leaves out).

``pinned`` needs the baseline and at least one ``pinned:*`` arm; ``pld`` the baseline and a
``pld:*`` arm; ``best_fixed`` the baseline and a fixed arm. Best-arm ties go to the earlier arm in
``arms``. ``adaspark_over_best`` needs an ``adaspark`` arm.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Iterable, Optional, TypedDict

import numpy as np

BANDS = ("<2048", ">=2048")
BAND_SPLIT = 2048
ALL = "all"


# ---------------------------------------------------------------------------------------------
# The records: JSON-ready dicts (floats or None, ints), typed


class Reply(TypedDict, total=False):
    """One reply of one arm, as ``compare`` records it."""

    arm: str
    source: str  # e.g. "specbench"
    conversation: str  # e.g. "specbench/writing-0"
    turn: int
    reply: int
    tok_s: float | None  # None: a single-delta reply, no client-clock interval
    tokens: int
    capped: bool
    context: int  # prompt tokens
    same_text_as_baseline: bool | None
    widths: dict[str, int]  # verified rows -> rounds
    finish: str
    trace: list | None  # [[tokens so far, seconds since the first delta], ...]: the first-N ratio


class Result(TypedDict):
    """``compare()``: the paper's ratio of one arm over another."""

    ratio: float | None
    lo: float | None
    hi: float | None
    replies: int  # pairs used in the ratio
    conversations: int  # conversations with a used pair (the bootstrap's units)
    paired: int  # pairs found (used + capped + null)
    capped: int
    null: int
    unpaired: int
    text_differs: int  # of all paired replies
    text_compared: int
    first_turn_text_differs: int  # turn 0 only
    first_turn_text_compared: int


class FirstN(TypedDict):
    """``compare_first_n()``: the first-N ratio of one arm over another."""

    ratio: float | None
    lo: float | None
    hi: float | None
    replies: int  # pairs used
    conversations: int  # conversations with a used pair
    paired: int  # pairs found (used + no_interval + untraced)
    capped_used: int  # used pairs in which either reply reached the cap
    no_interval: int
    untraced: int
    unpaired: int
    mean_n: float | None  # mean N over the used pairs


class Hist(TypedDict):
    """Figure 8 for one arm (and source): verified widths as shares of its rounds."""

    rounds: int
    replies: int
    capped_excluded: int
    counts: dict[str, int]  # width -> rounds, keys in numeric order
    share: dict[str, float]


class PinnedBand(TypedDict):
    best: str | None  # highest ratio over the baseline in that band
    best_over_baseline: Result | None
    adaspark_over_best: Result | None  # None without an "adaspark" arm
    over_adaspark: dict[str, Result]  # pinned arm -> Table 3's column; {} without adaspark


class Pinned(TypedDict):
    """Table 3: the pinned arms, by band ("all" or a band)."""

    arms: list[str]
    by_band: dict[str, PinnedBand]


class BestOf(TypedDict):
    """AdaSpark over the best arm of a family: ``pld`` (pld:N arms) or ``best_fixed`` (every arm
    of fixed width: chain:N, pinned:N, tree:N, pld:N, block-chain, llama:...)."""

    arms: list[str]
    best: str | None  # best overall ratio over the baseline
    best_over_baseline: Result | None
    adaspark_over_best: dict | None  # {"overall": Result, "by_source": {...}} (best_fixed: "by_band" too)


class Summary(TypedDict):
    """``summarize()``: every key always present; a part whose arms are missing is None. Under
    ``first_n`` the same four parts on the first-N ratio, each Result a FirstN, best arms chosen on it."""

    baseline: str
    arms: list[str]  # asked for and present, in the order given
    sources: list[str]  # in order of first appearance in the records
    bands: list[str]
    band_by: str  # "prompt" | "midpoint"
    resamples: int
    seed: int
    looped: dict[str, int]  # replies of the arm that reached the cap
    looped_any: int  # (conversation, turn, reply) capped in any arm
    speed: dict[str, dict]  # arm -> {"overall": tok/s | None, "by_source": {source: tok/s | None}}
    vs_baseline: dict[str, dict]  # arm -> {"overall": Result, "by_source": {..}, "by_band": {..}}
    widths: dict[str, dict]  # arm -> {"overall": Hist, "by_source": {source: Hist}}
    pinned: Pinned | None
    pld: BestOf | None
    best_fixed: BestOf | None
    first_n: dict  # {"vs_baseline": ..., "pinned": ..., "pld": ..., "best_fixed": ...}
    headline: str  # "first_n" | "uncapped": which of the two the report leads with
    # arm -> its replies under a JSON schema, those that follow it and those the cap cut:
    # {"replies", "valid", "capped"}; {} for a workload without schemas
    json_valid: dict[str, dict]
    # arm -> its replies in tool conversations and those that call a tool (calls parsed in the
    # template's format where it takes tools): {"replies", "calling"}; {} for a workload without tools
    tool_calls: dict[str, dict]


# ---------------------------------------------------------------------------------------------
# Keys


def context_band(reply: dict, band_by: str = "prompt") -> str:
    """``"<2048"`` or ``">=2048"``: of the reply's prompt tokens (``band_by="prompt"``) or of
    prompt plus half the reply (``"midpoint"``, the paper's Table 3)."""
    if band_by == "prompt":
        c = reply["context"]
    elif band_by == "midpoint":
        c = reply["context"] + (reply.get("tokens") or 0) / 2
    else:
        raise ValueError(f"band_by must be 'prompt' or 'midpoint', not {band_by!r}")
    return BANDS[0] if c < BAND_SPLIT else BANDS[1]


def by_source(reply: dict) -> str:
    return reply["source"]


def _rid(r: dict) -> tuple:
    return (r["conversation"], r["turn"], r["reply"])


# ---------------------------------------------------------------------------------------------
# Pairing and ratios


def _index(replies: Iterable[dict], arm: str) -> dict:
    out = {}
    for r in replies:
        if r["arm"] != arm:
            continue
        k = _rid(r)
        if k in out:
            raise ValueError(f"duplicate reply record for arm {arm!r}: {k}")
        out[k] = r
    return out


def _pairs(replies: list[dict], arm: str, base: str) -> tuple[list[tuple[dict, dict]], int]:
    """Paired (arm record, base record) in the arm's record order, and the number of replies
    present in only one of the two arms."""
    a, b = _index(replies, arm), _index(replies, base)
    pairs = [(ra, b[k]) for k, ra in a.items() if k in b]
    unpaired = len(a.keys() ^ b.keys())
    return pairs, unpaired


def _speed(r: dict) -> float:
    v = float(r["tok_s"])
    if not (v > 0 and math.isfinite(v)):
        raise ValueError(f"tok_s must be a positive number or null, got {r['tok_s']!r} in {_rid(r)} of {r['arm']!r}")
    return v


def ratio_rows(replies: list[dict], arm: str, base: str) -> dict:
    """The per-reply ratios of ``arm`` over ``base`` and what was left out::

        {"rows": [{"conversation", "turn", "reply", "source", "ratio", "arm": record,
                   "base": record}, ...],       # used pairs, in the arm's record order
         "capped": int,   # pairs capped in either arm
         "null": int,     # remaining pairs with a null tok_s in either arm
         "unpaired": int, "paired": int}
    """
    pairs, unpaired = _pairs(replies, arm, base)
    rows, capped, null = [], 0, 0
    for ra, rb in pairs:
        if ra.get("capped") or rb.get("capped"):
            capped += 1
        elif ra.get("tok_s") is None or rb.get("tok_s") is None:
            null += 1
        else:
            rows.append({"conversation": ra["conversation"], "turn": ra["turn"], "reply": ra["reply"],
                         "source": ra.get("source"), "ratio": _speed(ra) / _speed(rb), "arm": ra, "base": rb})
    return {"rows": rows, "capped": capped, "null": null, "unpaired": unpaired, "paired": len(pairs)}


def bootstrap_geomean(conversations: list, log_ratios: list[float], resamples: int = 2000,
                      seed: int = 0) -> tuple[Optional[float], Optional[float]]:
    """95% percentile interval of the pooled geometric mean, resampling whole conversations
    (``conversations[i]`` is the conversation of ``log_ratios[i]``; see the module docstring)."""
    if not log_ratios:
        return None, None
    convs = sorted(set(conversations))
    pos = {c: i for i, c in enumerate(convs)}
    n = len(convs)
    sums = np.zeros(n)
    counts = np.zeros(n)
    for c, x in zip(conversations, log_ratios):
        sums[pos[c]] += x
        counts[pos[c]] += 1
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(int(resamples), n))
    stats = np.exp(sums[idx].sum(axis=1) / counts[idx].sum(axis=1))
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)


def _result(rows: list[dict], pairs: list[tuple[dict, dict]], capped: int, null: int, unpaired: int,
            resamples: int, seed: int) -> Result:
    logs = [math.log(r["ratio"]) for r in rows]
    convs = [r["conversation"] for r in rows]
    point = float(math.exp(sum(logs) / len(logs))) if logs else None
    lo, hi = bootstrap_geomean(convs, logs, resamples, seed)
    flags = [(ra["turn"], ra.get("same_text_as_baseline")) for ra, _ in pairs]
    flags = [(t, f) for t, f in flags if f is not None]
    return {
        "ratio": point, "lo": lo, "hi": hi,
        "replies": len(rows), "conversations": len(set(convs)), "paired": len(pairs),
        "capped": capped, "null": null, "unpaired": unpaired,
        "text_differs": sum(1 for _, f in flags if not f),
        "text_compared": len(flags),
        "first_turn_text_differs": sum(1 for t, f in flags if t == 0 and not f),
        "first_turn_text_compared": sum(1 for t, _ in flags if t == 0),
    }


def compare(replies: list[dict], arm: str, base: str, resamples: int = 2000, seed: int = 0,
            key: Optional[Callable[[dict], str]] = None) -> dict:
    """``arm`` over ``base``: a Result over all replies pooled, or with ``key``
    (a function of the arm's record) ``{group: Result}`` in order of first appearance. ``unpaired``
    is only counted in the pooled result (a missing reply has no group)."""
    rr = ratio_rows(replies, arm, base)
    pairs, _ = _pairs(replies, arm, base)
    if key is None:
        return _result(rr["rows"], pairs, rr["capped"], rr["null"], rr["unpaired"], resamples, seed)
    groups: dict = {}
    for ra, rb in pairs:
        g = groups.setdefault(key(ra), {"pairs": [], "rows": [], "capped": 0, "null": 0})
        g["pairs"].append((ra, rb))
        if ra.get("capped") or rb.get("capped"):
            g["capped"] += 1
        elif ra.get("tok_s") is None or rb.get("tok_s") is None:
            g["null"] += 1
    for row in rr["rows"]:
        groups[key(row["arm"])]["rows"].append(row)
    return {k: _result(g["rows"], g["pairs"], g["capped"], g["null"], 0, resamples, seed) for k, g in groups.items()}


# ---------------------------------------------------------------------------------------------
# The first-N ratio (every paired reply, over the common first N tokens)


def _trace(r: dict) -> Optional[list]:
    t = r.get("trace")
    if not t:
        return None
    try:
        pts = [(int(n), float(x)) for n, x in t]
    except (TypeError, ValueError):
        raise ValueError(f"trace must be [[tokens, seconds], ...], got {t!r:.60} in {_rid(r)} of {r['arm']!r}") from None
    return pts


def prefix_speed(trace: list, n: int) -> Optional[float]:
    """Tokens per second from the trace's reference (its first entry: the first delta, or the
    decode's start) to the first entry whose cumulative count reaches ``n`` (tokens after the
    reference over the time between); None without such an interval."""
    if not trace:
        return None
    n0, t0 = trace[0]
    for tok, t in trace:
        if tok >= n:
            if tok <= n0 or not t > t0:  # reached at the first delta, or in no time
                return None
            return (tok - n0) / (t - t0)
    return None


def first_n_rows(replies: list[dict], arm: str, base: str) -> dict:
    """The per-reply first-N ratios of ``arm`` over ``base``::

        {"rows": [{"conversation", "turn", "reply", "source", "ratio", "n", "capped", "arm": record,
                   "base": record}, ...],       # used pairs, in the arm's record order
         "no_interval": int, "untraced": int, "unpaired": int, "paired": int}
    """
    pairs, unpaired = _pairs(replies, arm, base)
    rows, no_interval, untraced = [], 0, 0
    for ra, rb in pairs:
        ta, tb = _trace(ra), _trace(rb)
        if ta is None or tb is None:
            untraced += 1
            continue
        n = min(ta[-1][0], tb[-1][0])
        sa, sb = prefix_speed(ta, n), prefix_speed(tb, n)
        if sa is None or sb is None:
            no_interval += 1
            continue
        rows.append({"conversation": ra["conversation"], "turn": ra["turn"], "reply": ra["reply"],
                     "source": ra.get("source"), "ratio": sa / sb, "n": n,
                     "capped": bool(ra.get("capped") or rb.get("capped")), "arm": ra, "base": rb})
    return {"rows": rows, "no_interval": no_interval, "untraced": untraced, "unpaired": unpaired,
            "paired": len(pairs)}


def _result_first_n(rows: list[dict], paired: int, no_interval: int, untraced: int, unpaired: int,
                    resamples: int, seed: int) -> FirstN:
    logs = [math.log(r["ratio"]) for r in rows]
    convs = [r["conversation"] for r in rows]
    point = float(math.exp(sum(logs) / len(logs))) if logs else None
    lo, hi = bootstrap_geomean(convs, logs, resamples, seed)
    return {"ratio": point, "lo": lo, "hi": hi, "replies": len(rows), "conversations": len(set(convs)),
            "paired": paired, "capped_used": sum(1 for r in rows if r["capped"]),
            "no_interval": no_interval, "untraced": untraced, "unpaired": unpaired,
            "mean_n": sum(r["n"] for r in rows) / len(rows) if rows else None}


def compare_first_n(replies: list[dict], arm: str, base: str, resamples: int = 2000, seed: int = 0,
                    key: Optional[Callable[[dict], str]] = None) -> dict:
    """``arm`` over ``base`` on the first-N ratio: a FirstN over all replies
    pooled, or with ``key`` ``{group: FirstN}`` in order of first appearance, as ``compare``."""
    fr = first_n_rows(replies, arm, base)
    if key is None:
        return _result_first_n(fr["rows"], fr["paired"], fr["no_interval"], fr["untraced"], fr["unpaired"],
                               resamples, seed)
    pairs, _ = _pairs(replies, arm, base)
    groups: dict = {}
    for ra, rb in pairs:
        g = groups.setdefault(key(ra), {"rows": [], "paired": 0, "untraced": 0})
        g["paired"] += 1
        g["untraced"] += _trace(ra) is None or _trace(rb) is None
    for row in fr["rows"]:
        groups[key(row["arm"])]["rows"].append(row)
    # A traced pair that is not a row had no interval.
    return {k: _result_first_n(g["rows"], g["paired"], g["paired"] - len(g["rows"]) - g["untraced"], g["untraced"],
                               0, resamples, seed) for k, g in groups.items()}


# ---------------------------------------------------------------------------------------------
# Per-arm quantities


def arm_speed(replies: list[dict], arm: str) -> Optional[float]:
    """Decode tok/s of ``arm``: summed tokens over summed decode time, its capped and null replies
    left out; None when nothing is left."""
    tok = t = 0.0
    for r in replies:
        if r["arm"] == arm and not r.get("capped") and r.get("tok_s") is not None:
            tok += r["tokens"]
            t += r["tokens"] / _speed(r)
    return tok / t if t > 0 else None


def widths_histogram(replies: list[dict], arm: str, exclude_capped: bool = True) -> dict:
    """Figure 8 for one arm: ``{"overall": Hist, "by_source": {source: Hist}}``; ``share`` is a
    width's rounds over all the arm's rounds."""
    overall: dict = defaultdict(int)
    per: dict = {}
    meta = {ALL: [0, 0]}  # replies counted, capped excluded

    def add(h, m, r):
        if exclude_capped and r.get("capped"):
            m[1] += 1
            return
        m[0] += 1
        for w, n in (r.get("widths") or {}).items():
            h[int(w)] += int(n)

    for r in replies:
        if r["arm"] != arm:
            continue
        src = r.get("source")
        if src not in per:
            per[src] = defaultdict(int)
            meta[src] = [0, 0]
        add(overall, meta[ALL], r)
        add(per[src], meta[src], r)

    def hist(h, m):
        total = sum(h.values())
        ws = sorted(w for w in h if h[w])
        return {"rounds": total, "replies": m[0], "capped_excluded": m[1],
                "counts": {str(w): h[w] for w in ws},
                "share": {str(w): h[w] / total for w in ws}}

    return {"overall": hist(overall, meta[ALL]), "by_source": {s: hist(h, meta[s]) for s, h in per.items()}}


def mean_of_runs(replies: list[dict], first: str, second: str, into: str) -> list[dict]:
    """Records of a new arm ``into`` whose speed on a reply is the mean of two runs' (paper §3.4:
    AdaSpark runs twice). A reply is capped if it was in either run, null if either speed is null;
    the other fields (text flag, context, widths, trace...) are the first run's. Replies of one run
    only are dropped."""
    a, b = _index(replies, first), _index(replies, second)
    out = []
    for k, ra in a.items():
        if k not in b:
            continue
        rb = b[k]
        s = None if ra.get("tok_s") is None or rb.get("tok_s") is None else (_speed(ra) + _speed(rb)) / 2
        out.append({**ra, "arm": into, "tok_s": s, "capped": bool(ra.get("capped") or rb.get("capped"))})
    return out


# ---------------------------------------------------------------------------------------------
# Summary


def _ordered(values: Iterable) -> list:
    seen: dict = {}
    for v in values:
        seen.setdefault(v, None)
    return list(seen)


def _best(results: dict) -> Optional[str]:
    best, val = None, None
    for arm, res in results.items():
        if res is not None and res["ratio"] is not None and (val is None or res["ratio"] > val):
            best, val = arm, res["ratio"]
    return best


def summarize(replies: list[dict], arms: list[str], baseline: str = "ar", resamples: int = 2000, seed: int = 0,
              band_by: str = "prompt") -> Summary:
    """Everything ``adaspark compare`` reports, JSON-ready: a Summary."""
    replies = list(replies)
    present = set(r["arm"] for r in replies)
    arms = [a for a in _ordered(arms) if a in present]
    sources = _ordered(r.get("source") for r in replies if r["arm"] in arms)
    band = lambda r: context_band(r, band_by)  # noqa: E731
    kw = dict(resamples=resamples, seed=seed)

    looped = {a: sum(1 for r in replies if r["arm"] == a and r.get("capped")) for a in arms}
    looped_any = len({_rid(r) for r in replies if r["arm"] in arms and r.get("capped")})
    speed = {}
    for a in arms:
        mine = [r for r in replies if r["arm"] == a]
        speed[a] = {"overall": arm_speed(mine, a),
                    "by_source": {s: arm_speed([r for r in mine if r.get("source") == s], a) for s in sources}}

    widths = {}
    for a in arms:
        h = widths_histogram(replies, a)
        if h["overall"]["rounds"]:
            widths[a] = h

    vs, pinned, pld, best_fixed = _comparisons(replies, arms, baseline, sources, band, compare, _empty, kw)
    first_n = dict(zip(("vs_baseline", "pinned", "pld", "best_fixed"),
                       _comparisons(replies, arms, baseline, sources, band, compare_first_n, _empty_first_n, kw)))
    used = lambda v: sum(x["overall"]["replies"] for x in v.values())  # noqa: E731
    headline = "first_n" if used(first_n["vs_baseline"]) >= used(vs) else "uncapped"
    under = {a: [r for r in replies if r["arm"] == a and r.get("json_valid") is not None] for a in arms}
    json_valid = {a: {"replies": len(v), "valid": sum(r["json_valid"] for r in v),
                      "capped": sum(1 for r in v if r.get("capped"))} for a, v in under.items() if v}
    in_tools = {a: [r for r in replies if r["arm"] == a and r.get("tool_calls") is not None] for a in arms}
    tool_calls = {a: {"replies": len(v), "calling": sum(1 for r in v if r["tool_calls"])}
                  for a, v in in_tools.items() if v}

    return {"baseline": baseline, "arms": arms, "sources": sources, "bands": list(BANDS), "band_by": band_by,
            "resamples": resamples, "seed": seed, "looped": looped, "looped_any": looped_any, "speed": speed,
            "vs_baseline": vs, "widths": widths, "pinned": pinned, "pld": pld, "best_fixed": best_fixed,
            "first_n": first_n, "headline": headline, "json_valid": json_valid, "tool_calls": tool_calls}


FIXED_PREFIXES = ("chain:", "pinned:", "tree:", "pld:", "llama:")
FIXED_NAMES = ("block-chain",)


def is_fixed_arm(arm: str) -> bool:
    """An arm whose width does not learn (pinned:N learns its acceptance model, not its width):
    the set the issue's target "adaspark over the best fixed arm" ranges over."""
    return arm.startswith(FIXED_PREFIXES) or arm in FIXED_NAMES


def _comparisons(replies: list[dict], arms: list[str], baseline: str, sources: list, band: Callable, fn: Callable,
                 empty: Callable[[], dict], kw: dict) -> tuple:
    """``(vs_baseline, pinned, pld, best_fixed)`` on one ratio: ``fn`` is ``compare`` or
    ``compare_first_n``, ``empty`` its empty result; best arms are chosen on that ratio."""
    vs = {}
    if baseline in arms:
        for a in arms:
            if a == baseline:
                continue
            vs[a] = {"overall": fn(replies, a, baseline, **kw),
                     "by_source": _fill(fn(replies, a, baseline, key=by_source, **kw), sources, empty),
                     "by_band": _fill(fn(replies, a, baseline, key=band, **kw), BANDS, empty)}
    has_ada = "adaspark" in arms

    def one(arm, other, b=ALL):
        if b == ALL:
            return fn(replies, arm, other, **kw)
        return fn(replies, arm, other, key=band, **kw).get(b) or empty()

    pinned = None
    pinned_arms = [a for a in arms if a.startswith("pinned:")]
    if baseline in arms and pinned_arms:
        by = {}
        for b in (ALL,) + BANDS:
            over_base = {p: (vs[p]["overall"] if b == ALL else vs[p]["by_band"][b]) for p in pinned_arms}
            best = _best(over_base)
            by[b] = {"best": best, "best_over_baseline": over_base[best] if best else None,
                     "adaspark_over_best": one("adaspark", best, b) if (has_ada and best) else None,
                     "over_adaspark": {p: one(p, "adaspark", b) for p in pinned_arms} if has_ada else {}}
        pinned = {"arms": pinned_arms, "by_band": by}

    pld = None
    pld_arms = [a for a in arms if a.startswith("pld:")]
    if baseline in arms and pld_arms:
        best = _best({p: vs[p]["overall"] for p in pld_arms})
        ada = None
        if best and has_ada:
            ada = {"overall": fn(replies, "adaspark", best, **kw),
                   "by_source": _fill(fn(replies, "adaspark", best, key=by_source, **kw), sources, empty)}
        pld = {"arms": pld_arms, "best": best, "best_over_baseline": vs[best]["overall"] if best else None,
               "adaspark_over_best": ada}

    best_fixed = None
    fixed_arms = [a for a in arms if a != baseline and is_fixed_arm(a)]
    if baseline in arms and fixed_arms:
        best = _best({a: vs[a]["overall"] for a in fixed_arms})
        ada = None
        if best and has_ada:
            ada = {"overall": fn(replies, "adaspark", best, **kw),
                   "by_source": _fill(fn(replies, "adaspark", best, key=by_source, **kw), sources, empty),
                   "by_band": _fill(fn(replies, "adaspark", best, key=band, **kw), BANDS, empty)}
        best_fixed = {"arms": fixed_arms, "best": best, "best_over_baseline": vs[best]["overall"] if best else None,
                      "adaspark_over_best": ada}
    return vs, pinned, pld, best_fixed


def _empty() -> Result:
    return {"ratio": None, "lo": None, "hi": None, "replies": 0, "conversations": 0, "paired": 0, "capped": 0,
            "null": 0, "unpaired": 0, "text_differs": 0, "text_compared": 0, "first_turn_text_differs": 0,
            "first_turn_text_compared": 0}


def _empty_first_n() -> FirstN:
    return {"ratio": None, "lo": None, "hi": None, "replies": 0, "conversations": 0, "paired": 0, "capped_used": 0,
            "no_interval": 0, "untraced": 0, "unpaired": 0, "mean_n": None}


def _fill(groups: dict, keys: Iterable, empty: Callable[[], dict] = _empty) -> dict:
    """Every expected group present (an empty result where an arm had no reply), in ``keys``'
    order; groups outside ``keys`` are kept after them."""
    out = {k: groups.get(k) or empty() for k in keys}
    out.update({k: v for k, v in groups.items() if k not in out})
    return out
