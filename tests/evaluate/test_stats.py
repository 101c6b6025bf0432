"""adaspark_core.evaluate.stats and adaspark_cli.compare_report on hand-made reply records (no model)."""

import json
import math

import numpy as np
import pytest

from adaspark_core.evaluate import stats
from adaspark_core.evaluate.stats import compare, context_band, ratio_rows, summarize, widths_histogram


def rec(arm, conv, tok_s, turn=0, reply=0, source=None, context=500, tokens=100, capped=False, same=None,
        widths=None):
    return {"arm": arm, "source": source or conv.split("/")[0], "conversation": conv, "turn": turn, "reply": reply,
            "tok_s": tok_s, "tokens": tokens, "capped": capped, "context": context,
            "same_text_as_baseline": same, "widths": widths or {}, "finish": "length" if capped else "stop"}


def pair(conv, ratio, turn=0, reply=0, base_speed=10.0, **kw):
    """An "a" record and a "b" record whose speed ratio is ``ratio``."""
    return [rec("a", conv, base_speed * ratio, turn, reply, **kw), rec("b", conv, base_speed, turn, reply)]


# --- geometric mean ------------------------------------------------------------------------------


def test_geometric_mean_of_per_reply_ratios_pools_replies():
    # conv x: ratios 1 and 2; conv y: ratio 4 -> exp(mean(log)) = (1*2*4)^(1/3) = 2 (a mean of
    # per-conversation means would give sqrt(sqrt(2)*4) = 2.378).
    rs = pair("s/x", 1.0, turn=0) + pair("s/x", 2.0, turn=1, base_speed=33.0) + pair("s/y", 4.0)
    r = compare(rs, "a", "b", resamples=200)
    assert r["ratio"] == pytest.approx(2.0)
    assert (r["replies"], r["conversations"], r["paired"]) == (3, 2, 3)
    assert (r["capped"], r["null"], r["unpaired"]) == (0, 0, 0)
    assert r["lo"] <= r["ratio"] <= r["hi"]


def test_pairs_by_conversation_turn_and_reply():
    rs = [rec("a", "s/x", 20.0, turn=0, reply=0), rec("a", "s/x", 30.0, turn=0, reply=1),
          rec("b", "s/x", 10.0, turn=0, reply=1), rec("b", "s/x", 10.0, turn=0, reply=0),
          rec("a", "s/x", 99.0, turn=1, reply=0)]  # no base reply: unpaired
    rr = ratio_rows(rs, "a", "b")
    assert sorted(r["ratio"] for r in rr["rows"]) == [2.0, 3.0]
    assert rr["unpaired"] == 1 and rr["paired"] == 2
    assert compare(rs, "a", "b", resamples=50)["ratio"] == pytest.approx(math.sqrt(6))


def test_duplicate_and_bad_records_are_rejected():
    with pytest.raises(ValueError):
        ratio_rows([rec("a", "s/x", 1.0), rec("a", "s/x", 2.0), rec("b", "s/x", 1.0)], "a", "b")
    with pytest.raises(ValueError):
        ratio_rows([rec("a", "s/x", 0.0), rec("b", "s/x", 1.0)], "a", "b")


# --- exclusions ----------------------------------------------------------------------------------


def test_cap_in_either_arm_excludes_the_pair():
    rs = pair("s/x", 2.0, turn=0) + pair("s/x", 8.0, turn=1)
    rs += [rec("a", "s/y", 100.0, capped=True), rec("b", "s/y", 10.0)]          # capped in the arm
    rs += [rec("a", "s/z", 1.0), rec("b", "s/z", 10.0, capped=True)]            # capped in the base
    r = compare(rs, "a", "b", resamples=100)
    assert r["capped"] == 2 and r["replies"] == 2 and r["paired"] == 4
    assert r["ratio"] == pytest.approx(4.0)      # sqrt(2*8); the looped pairs would move it
    assert r["conversations"] == 1               # only s/x has a used pair
    assert stats.arm_speed(rs, "a") == pytest.approx((100 + 100 + 100) / (100 / 20 + 100 / 80 + 100 / 1.0))


def test_null_tok_s_is_excluded_and_counted_separately():
    rs = pair("s/x", 3.0)
    rs += [rec("a", "s/x", None, turn=1), rec("b", "s/x", 10.0, turn=1)]
    rs += [rec("a", "s/x", 10.0, turn=2), rec("b", "s/x", None, turn=2)]
    rs += [rec("a", "s/x", None, turn=3, capped=True), rec("b", "s/x", 10.0, turn=3)]  # capped wins
    rr = ratio_rows(rs, "a", "b")
    assert (rr["null"], rr["capped"], len(rr["rows"])) == (2, 1, 1)
    r = compare(rs, "a", "b", resamples=10)
    assert r["ratio"] == pytest.approx(3.0) and r["null"] == 2 and r["capped"] == 1
    assert r["lo"] == pytest.approx(3.0) and r["hi"] == pytest.approx(3.0)


def test_nothing_left_gives_no_ratio():
    rs = [rec("a", "s/x", None), rec("b", "s/x", 10.0)]
    r = compare(rs, "a", "b")
    assert r["ratio"] is None and r["lo"] is None and r["hi"] is None and r["null"] == 1 and r["replies"] == 0


# --- text agreement (Table 10) ----------------------------------------------------------------------


def test_text_differs_counts_every_paired_reply_of_the_arm():
    rs = pair("s/x", 2.0, turn=0, same=True) + pair("s/x", 2.0, turn=1, same=False)
    rs += pair("s/y", 2.0, turn=0, same=False) + pair("s/y", 2.0, turn=1, same=None)
    rs += [rec("a", "s/z", 5.0, capped=True, same=False), rec("b", "s/z", 5.0)]   # capped still counts
    rs += [rec("a", "s/w", None, same=True), rec("b", "s/w", 5.0, same=False)]    # base's flag ignored
    rs += [rec("a", "s/v", 5.0, same=False)]                                      # unpaired: not counted
    r = compare(rs, "a", "b", resamples=10)
    assert (r["text_differs"], r["text_compared"]) == (3, 5)
    assert (r["first_turn_text_differs"], r["first_turn_text_compared"]) == (2, 4)


# --- bootstrap over conversations ---------------------------------------------------------------------


def brute_force_interval(rs, arm, base, resamples, seed):
    """An independent recomputation: the documented draw, then each resample's replies listed
    explicitly and their geometric mean taken with plain math."""
    by_conv = {}
    for r in ratio_rows(rs, arm, base)["rows"]:
        by_conv.setdefault(r["conversation"], []).append(r["ratio"])
    convs = sorted(by_conv)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(convs), size=(resamples, len(convs)))
    vals = []
    for row in idx:
        pooled = [x for i in row for x in by_conv[convs[i]]]
        vals.append(math.exp(math.fsum(math.log(x) for x in pooled) / len(pooled)))
    return tuple(np.percentile(vals, [2.5, 97.5]))


def test_bootstrap_matches_brute_force_with_one_big_conversation():
    rng = np.random.default_rng(123)
    rs = []
    for t in range(40):                                   # one conversation with 40 replies
        rs += pair("s/big", float(rng.uniform(1.5, 2.5)), turn=t)
    for c in range(6):                                    # six with one or two replies
        for t in range(1 + c % 2):
            rs += pair(f"s/small{c}", float(rng.uniform(0.8, 1.2)), turn=t)
    r = compare(rs, "a", "b", resamples=500, seed=7)
    lo, hi = brute_force_interval(rs, "a", "b", 500, 7)
    assert r["lo"] == pytest.approx(lo, rel=1e-12) and r["hi"] == pytest.approx(hi, rel=1e-12)
    assert r["conversations"] == 7 and r["replies"] == 49
    # Seeded: the same seed reproduces it; another seed moves it.
    assert compare(rs, "a", "b", resamples=500, seed=7)["lo"] == r["lo"]
    assert compare(rs, "a", "b", resamples=500, seed=8)["lo"] != r["lo"]


def test_bootstrap_draws_whole_conversations():
    # Conv A: 10 replies at ratio 2; conv B: 1 reply at ratio 1. Drawing 2 conversations gives only
    # AA -> 2, AB/BA -> 2^(10/11), BB -> 1, so (BB has probability 1/4) the interval is exactly
    # [1, 2]. Resampling replies instead would put it close around 2^(10/11).
    rs = [x for t in range(10) for x in pair("s/A", 2.0, turn=t)] + pair("s/B", 1.0)
    r = compare(rs, "a", "b", resamples=2000, seed=0)
    assert r["ratio"] == pytest.approx(2 ** (10 / 11))
    assert r["lo"] == pytest.approx(1.0) and r["hi"] == pytest.approx(2.0)


def test_interval_collapses_with_one_or_identical_conversations():
    one = pair("s/x", 1.5, turn=0) + pair("s/x", 3.0, turn=1) + pair("s/x", 0.9, turn=2)
    r = compare(one, "a", "b", resamples=300)
    assert r["lo"] == pytest.approx(r["ratio"]) and r["hi"] == pytest.approx(r["ratio"])
    same = [x for c in range(5) for t, q in enumerate((1.5, 3.0, 0.9)) for x in pair(f"s/c{c}", q, turn=t)]
    r = compare(same, "a", "b", resamples=300)
    assert r["ratio"] == pytest.approx((1.5 * 3.0 * 0.9) ** (1 / 3))
    assert r["lo"] == pytest.approx(r["ratio"]) and r["hi"] == pytest.approx(r["ratio"])


# --- groups ---------------------------------------------------------------------------------------------


def test_context_band_uses_the_arms_context():
    rs = []
    for t, (ctx, q) in enumerate([(100, 2.0), (2047, 2.0), (2048, 8.0), (5000, 8.0)]):
        rs += [rec("a", "s/x", 10.0 * q, turn=t, context=ctx), rec("b", "s/x", 10.0, turn=t, context=3000 - ctx)]
    g = compare(rs, "a", "b", resamples=50, key=context_band)
    assert list(g) == ["<2048", ">=2048"]
    assert g["<2048"]["ratio"] == pytest.approx(2.0) and g["<2048"]["replies"] == 2
    assert g[">=2048"]["ratio"] == pytest.approx(8.0) and g[">=2048"]["replies"] == 2
    assert context_band({"context": 1900, "tokens": 400}, "midpoint") == ">=2048"
    assert context_band({"context": 1900, "tokens": 400}) == "<2048"


def test_key_by_source_counts_exclusions_per_group():
    rs = pair("p/x", 2.0) + pair("p/y", 2.0) + pair("q/x", 4.0, same=False)
    rs += [rec("a", "q/y", 9.0, capped=True), rec("b", "q/y", 1.0)]
    g = compare(rs, "a", "b", resamples=50, key=stats.by_source)
    assert g["p"]["ratio"] == pytest.approx(2.0) and g["p"]["conversations"] == 2
    assert g["q"]["ratio"] == pytest.approx(4.0) and g["q"]["capped"] == 1 and g["q"]["text_differs"] == 1


# --- widths (Figure 8) --------------------------------------------------------------------------------


def test_widths_histogram_shares_per_source_without_capped_replies():
    rs = [rec("ada", "p/x", 10.0, widths={"8": 6, "16": 2}), rec("ada", "q/x", 10.0, widths={"2": 2, "8": 10}),
          rec("ada", "q/y", 10.0, capped=True, widths={"32": 100}), rec("pld:3", "p/x", 10.0)]
    h = widths_histogram(rs, "ada")
    assert h["overall"]["rounds"] == 20 and h["overall"]["capped_excluded"] == 1
    assert list(h["overall"]["share"]) == ["2", "8", "16"]   # numeric order, string keys
    assert h["overall"]["share"] == pytest.approx({"2": 0.1, "8": 0.8, "16": 0.1})
    assert h["by_source"]["p"]["share"] == pytest.approx({"8": 0.75, "16": 0.25})
    assert h["by_source"]["q"]["counts"] == {"2": 2, "8": 10}
    assert widths_histogram(rs, "pld:3")["overall"]["rounds"] == 0


def test_mean_of_runs():
    rs = [rec("r1", "s/x", 10.0), rec("r2", "s/x", 20.0), rec("r1", "s/x", 5.0, turn=1),
          rec("r2", "s/x", 5.0, turn=1, capped=True), rec("r1", "s/x", None, turn=2), rec("r2", "s/x", 3.0, turn=2)]
    m = {r["turn"]: r for r in stats.mean_of_runs(rs, "r1", "r2", "ada")}
    assert m[0]["tok_s"] == 15.0 and m[0]["arm"] == "ada"
    assert m[1]["capped"] is True and m[2]["tok_s"] is None


# --- summarize ------------------------------------------------------------------------------------------

# Speeds per arm and band; conversations in two sources, each with a short and a long reply.
SPEEDS = {  # arm: (speed at context < 2048, speed at context >= 2048)
    "ar": (10.0, 10.0), "pinned:8": (20.0, 30.0), "pinned:16": (25.0, 24.0), "adaspark": (30.0, 33.0),
    "pld:2": (12.0, 12.0), "pld:4": (15.0, 15.0), "chain:3": (18.0, 16.0),
}


def workload(arms=SPEEDS):
    rs = []
    for src in ("specbench", "longbench"):
        for c in range(3):
            conv = f"{src}/c{c}"
            for t, ctx in enumerate((600, 4000)):
                for arm in arms:
                    s = SPEEDS[arm][t] * (1.2 if (src == "longbench" and arm.startswith("pld")) else 1.0)
                    rs.append(rec(arm, conv, s, turn=t, context=ctx, tokens=200,
                                  same=None if arm == "ar" else (t == 0),
                                  widths={"8": 5, "16": 5} if arm == "adaspark" else {}))
    # a looped reply in pinned:16 and a single-delta reply in ar
    rs.append(rec("ar", "toolace/c0", 10.0, context=700))
    rs.append(rec("pinned:16", "toolace/c0", 50.0, context=700, capped=True))
    rs.append(rec("adaspark", "toolace/c0", 40.0, context=700, widths={"4": 10}))
    rs.append(rec("ar", "toolace/c0", None, reply=1, context=800))
    rs.append(rec("adaspark", "toolace/c0", 40.0, reply=1, context=800))
    return rs


def test_best_pinned_and_best_pld_selection():
    s = summarize(workload(), list(SPEEDS), resamples=200)
    p = s["pinned"]["by_band"]
    assert p["<2048"]["best"] == "pinned:16" and p[">=2048"]["best"] == "pinned:8"
    assert p[">=2048"]["best_over_baseline"]["ratio"] == pytest.approx(3.0)
    assert p[">=2048"]["adaspark_over_best"]["ratio"] == pytest.approx(33 / 30)
    # <2048: pinned:16 over ar 2.5 on 6 replies (its toolace reply is capped); adaspark over it 30/25
    assert p["<2048"]["best_over_baseline"]["ratio"] == pytest.approx(2.5)
    assert p["<2048"]["adaspark_over_best"]["ratio"] == pytest.approx(1.2)
    assert p["<2048"]["adaspark_over_best"]["capped"] == 1
    assert p["<2048"]["over_adaspark"]["pinned:8"]["ratio"] == pytest.approx(20 / 30)
    # all replies: pinned:8 = sqrt(2*3) = 2.449 (no toolace record); pinned:16 = sqrt(2.5*2.4) = 2.449...
    all8, all16 = s["vs_baseline"]["pinned:8"]["overall"]["ratio"], s["vs_baseline"]["pinned:16"]["overall"]["ratio"]
    assert all8 == pytest.approx(math.sqrt(6)) and all16 == pytest.approx(math.sqrt(2.5 * 2.4))
    assert p["all"]["best"] == ("pinned:8" if all8 > all16 else "pinned:16")
    q = s["pld"]
    assert q["best"] == "pld:4" and q["arms"] == ["pld:2", "pld:4"]
    assert q["adaspark_over_best"]["by_source"]["specbench"]["ratio"] == pytest.approx(math.sqrt(2.0 * 2.2))
    assert q["adaspark_over_best"]["by_source"]["longbench"]["ratio"] == pytest.approx(math.sqrt(2.0 * 2.2) / 1.2)
    assert q["adaspark_over_best"]["by_source"]["toolace"]["ratio"] is None   # pld ran no toolace reply


def test_summarize_shape_and_counts():
    s = summarize(workload(), ["ar", "chain:3", "adaspark", "pinned:8", "pinned:16", "pld:2", "pld:4", "tree:16"],
                  resamples=100)
    json.dumps(s, allow_nan=False)
    assert set(s) == {"baseline", "arms", "sources", "bands", "band_by", "resamples", "seed", "looped", "looped_any",
                      "speed", "vs_baseline", "widths", "pinned", "pld", "best_fixed", "first_n", "headline",
                      "json_valid", "tool_calls"}
    assert s["json_valid"] == {} and s["tool_calls"] == {}  # no reply under a JSON schema, none with tools
    assert s["headline"] == "uncapped"  # no record has a trace: the paper's ratio is all there is
    assert s["arms"] == ["ar", "chain:3", "adaspark", "pinned:8", "pinned:16", "pld:2", "pld:4"]  # tree:16 absent
    assert s["sources"] == ["specbench", "longbench", "toolace"]
    assert s["bands"] == ["<2048", ">=2048"]
    assert set(s["vs_baseline"]) == set(s["arms"]) - {"ar"}
    result_keys = set(stats._empty())
    for a, v in s["vs_baseline"].items():
        assert set(v) == {"overall", "by_source", "by_band"}
        assert list(v["by_source"]) == s["sources"] and list(v["by_band"]) == s["bands"]
        for r in [v["overall"], *v["by_source"].values(), *v["by_band"].values()]:
            assert set(r) == result_keys
    ada = s["vs_baseline"]["adaspark"]["overall"]
    assert ada["null"] == 1 and ada["capped"] == 0 and ada["replies"] == 13 and ada["conversations"] == 7
    assert (ada["text_differs"], ada["text_compared"]) == (6, 12)
    assert s["vs_baseline"]["pinned:16"]["overall"]["capped"] == 1
    assert s["looped"]["pinned:16"] == 1 and s["looped_any"] == 1
    assert list(s["widths"]) == ["adaspark"]
    assert s["widths"]["adaspark"]["overall"]["share"] == pytest.approx({"4": 10 / 130, "8": 60 / 130, "16": 60 / 130})
    assert s["speed"]["ar"]["overall"] == pytest.approx(10.0)
    assert s["speed"]["pld:4"]["by_source"]["longbench"] == pytest.approx(18.0)
    assert set(s["pinned"]["by_band"]) == {"all", "<2048", ">=2048"}


def test_summarize_skips_parts_whose_arms_are_missing():
    s = summarize(workload(["ar", "adaspark"]), ["ar", "adaspark"], resamples=50)
    assert s["pinned"] is None and s["pld"] is None
    s = summarize(workload(["ar", "pinned:8"]), ["ar", "pinned:8"], resamples=50)
    assert s["pinned"]["by_band"]["all"]["best"] == "pinned:8"
    assert s["pinned"]["by_band"]["all"]["adaspark_over_best"] is None
    s = summarize(workload(["adaspark", "pinned:8"]), ["adaspark", "pinned:8"], resamples=50)  # no baseline
    assert s["vs_baseline"] == {} and s["pinned"] is None
    json.dumps(s, allow_nan=False)


# --- report ---------------------------------------------------------------------------------------------


def test_tables_render_the_numbers(tmp_path):
    from adaspark_cli.compare_report import figure, tables

    s = summarize(workload(), list(SPEEDS), resamples=200)
    text = tables(s)
    ada = s["vs_baseline"]["adaspark"]["overall"]
    assert f"{ada['ratio']:.2f}x [{ada['lo']:.2f}, {ada['hi']:.2f}]" in text
    assert "3.00x" in text                       # pinned:8 over ar at >= 2048
    assert "1.100x" in text                      # adaspark over the best pinned arm at >= 2048
    for word in ("specbench", "longbench", "toolace", "all replies", "pld:4", "under 2,048", "6/12", "46.2%", "7.7%"):
        assert word in text
    png = figure(s, tmp_path / "cmp.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Without the optional parts, still renders.
    assert "Pinned" not in tables(summarize(workload(["ar", "adaspark"]), ["ar", "adaspark"], resamples=20))


# --- the first-N ratio (every paired reply, capped included) ----------------------------------------------


def steady(tokens, tok_s, first=1, step=1):
    """A trace of a reply streamed at a steady ``tok_s`` after a first delta of ``first`` tokens,
    ``step`` tokens per later delta, up to ``tokens``."""
    out, n = [[first, 0.0]], first
    while n < tokens:
        n = min(tokens, n + step)
        out.append([n, (n - first) / tok_s])
    return out


def traced(arm, conv, trace, turn=0, reply=0, capped=False, context=500, **kw):
    """A record with its delta trace; ``tok_s`` over the whole trace, as the runner's."""
    n = trace[-1][0] if trace else 0
    span = trace[-1][1] - trace[0][1] if trace else 0
    tok_s = (n - trace[0][0]) / span if trace and span > 0 else None
    r = rec(arm, conv, tok_s, turn, reply, tokens=n, capped=capped, context=context, **kw)
    r["trace"] = trace
    return r


def tpair(conv, ratio, tokens_a=96, tokens_b=96, turn=0, base_speed=10.0, capped=True, **kw):
    """Arm "a" at ``ratio`` times "b"'s steady speed; both capped by default."""
    return [traced("a", conv, steady(tokens_a, base_speed * ratio), turn, capped=capped, **kw),
            traced("b", conv, steady(tokens_b, base_speed), turn, capped=capped, **kw)]


def test_prefix_speed_takes_the_first_delta_that_reaches_n():
    tr = [[2, 0.0], [4, 0.1], [6, 0.2], [9, 0.3], [12, 0.4]]
    assert stats.prefix_speed(tr, 6) == pytest.approx(4 / 0.2)
    assert stats.prefix_speed(tr, 7) == pytest.approx(7 / 0.3)   # overshoot: that delta's own count
    assert stats.prefix_speed(tr, 2) is None                     # reached at the first delta
    assert stats.prefix_speed(tr, 13) is None                    # never reached
    assert stats.prefix_speed([[1, 0.0], [5, 0.0]], 5) is None   # no time
    assert stats.prefix_speed([], 5) is None
    # led by the decode's start (our arms): a reply whose first round emitted it whole has an interval
    assert stats.prefix_speed([[0, -0.2], [16, 0.0]], 16) == pytest.approx(16 / 0.2)
    assert stats.prefix_speed([[0, -0.1], [2, 0.0], [4, 0.1]], 3) == pytest.approx(4 / 0.2)


def test_first_n_ratio_uses_capped_replies_over_the_shorter_reply():
    # a: first delta 2 tokens, then 2 per 0.1 s, capped at 8; b: 1 per 0.1 s, stops at 6. N = 6:
    # a reaches 6 at 0.2 s -> 4/0.2 = 20 tok/s; b reaches 6 at 0.5 s -> 5/0.5 = 10 tok/s.
    rs = [traced("a", "s/x", [[2, 0.0], [4, 0.1], [6, 0.2], [8, 0.3]], capped=True),
          traced("b", "s/x", [[1, 0.0], [2, 0.1], [3, 0.2], [4, 0.3], [5, 0.4], [6, 0.5]])]
    fr = stats.first_n_rows(rs, "a", "b")
    assert [(r["n"], r["capped"]) for r in fr["rows"]] == [(6, True)]
    assert fr["rows"][0]["ratio"] == pytest.approx(2.0)
    assert compare(rs, "a", "b")["ratio"] is None               # the paper's rule leaves it out
    r = stats.compare_first_n(rs, "a", "b", resamples=50)
    assert r["ratio"] == pytest.approx(2.0) and r["replies"] == 1 and r["capped_used"] == 1 and r["mean_n"] == 6


def test_first_n_ratio_counts_what_it_leaves_out():
    rs = tpair("s/x", 3.0) + tpair("s/y", 1.5, tokens_a=40, turn=1, capped=False)
    rs += [traced("a", "s/z", [[5, 0.0]]), traced("b", "s/z", steady(50, 10.0))]        # single delta
    rs += [traced("a", "s/t", [[0, -0.25], [5, 0.0]]), traced("b", "s/t", steady(5, 10.0))]  # ... from its start
    rs += [traced("a", "s/w", steady(20, 20.0)), traced("b", "s/w", [[30, 0.0], [31, 0.1]])]  # N=20 at b's 1st
    rs += [rec("a", "s/v", 20.0), traced("b", "s/v", steady(50, 10.0))]                   # untraced
    rs += [traced("a", "s/u", steady(50, 10.0))]                                           # unpaired
    r = stats.compare_first_n(rs, "a", "b", resamples=100)
    # s/t: a's 5 tokens in 0.25 s from its decode's start, b's 4 after its first delta in 0.4 s: 2x
    assert r["ratio"] == pytest.approx((3.0 * 1.5 * 2.0) ** (1 / 3))
    assert (r["replies"], r["paired"], r["no_interval"], r["untraced"], r["unpaired"]) == (3, 6, 2, 1, 1)
    assert r["conversations"] == 3 and r["capped_used"] == 1 and r["mean_n"] == pytest.approx((96 + 40 + 5) / 3)
    g = stats.compare_first_n(rs, "a", "b", resamples=100, key=stats.by_source)
    assert g["s"]["replies"] == 3 and g["s"]["no_interval"] == 2 and g["s"]["untraced"] == 1
    bad = {**rec("a", "s/x", None), "trace": [[1, "x", 3]]}
    with pytest.raises(ValueError):
        stats.first_n_rows([bad, traced("b", "s/x", [[1, 0.0]])], "a", "b")


def brute_force_first_n(rs, resamples, seed):
    by_conv = {}
    for r in stats.first_n_rows(rs, "a", "b")["rows"]:
        by_conv.setdefault(r["conversation"], []).append(r["ratio"])
    convs = sorted(by_conv)
    idx = np.random.default_rng(seed).integers(0, len(convs), size=(resamples, len(convs)))
    vals = [math.exp(math.fsum(math.log(x) for i in row for x in by_conv[convs[i]]) /
                     sum(len(by_conv[convs[i]]) for i in row)) for row in idx]
    return tuple(np.percentile(vals, [2.5, 97.5]))


def test_first_n_bootstrap_resamples_conversations():
    rng = np.random.default_rng(5)
    rs = []
    for t in range(12):
        rs += tpair("s/big", float(rng.uniform(1.5, 2.5)), turn=t)
    for c in range(5):
        rs += tpair(f"s/small{c}", float(rng.uniform(0.8, 1.2)), tokens_a=30 + c, capped=False)
    r = stats.compare_first_n(rs, "a", "b", resamples=400, seed=3)
    lo, hi = brute_force_first_n(rs, 400, 3)
    assert r["lo"] == pytest.approx(lo, rel=1e-9) and r["hi"] == pytest.approx(hi, rel=1e-9)
    assert r["conversations"] == 6 and r["replies"] == 17
    # conversation A: 10 replies at 2, B: 1 at 1 -> exactly [1, 2], as for the paper's ratio
    rs = [x for t in range(10) for x in tpair("s/A", 2.0, turn=t)] + tpair("s/B", 1.0)
    r = stats.compare_first_n(rs, "a", "b", resamples=2000)
    assert r["ratio"] == pytest.approx(2 ** (10 / 11)) and (r["lo"], r["hi"]) == pytest.approx((1.0, 2.0))


CAPPED_SPEEDS = {"ar": 10.0, "chain:3": 14.0, "pinned:4": 18.0, "pld:3": 12.0, "cost": 15.0, "adaspark": 20.0}


def all_capped(speeds=CAPPED_SPEEDS, tokens=96):
    """Every reply of every arm hits the cap, as on a 2-core CPU."""
    rs = []
    for src in ("specbench", "longbench"):
        for c in range(3):
            for t, ctx in enumerate((600, 4000)):
                for arm, v in speeds.items():
                    rs.append(traced(arm, f"{src}/c{c}", steady(tokens, v * (1.1 if src == "longbench" else 1.0)),
                                     turn=t, capped=True, context=ctx, same=None if arm == "ar" else True,
                                     widths={"4": 8} if arm == "adaspark" else {}))
    return rs


def test_summary_of_capped_replies_leads_with_the_first_n_ratio():
    s = summarize(all_capped(), list(CAPPED_SPEEDS), resamples=100, band_by="midpoint")
    json.dumps(s, allow_nan=False)
    assert s["headline"] == "first_n"
    for a in CAPPED_SPEEDS:
        if a == "ar":
            continue
        assert s["vs_baseline"][a]["overall"]["ratio"] is None and s["vs_baseline"][a]["overall"]["capped"] == 12
        f = s["first_n"]["vs_baseline"][a]
        assert f["overall"]["ratio"] == pytest.approx(CAPPED_SPEEDS[a] / 10.0) and f["overall"]["replies"] == 12
        assert f["by_source"]["longbench"]["replies"] == 6 and f["by_band"][">=2048"]["replies"] == 6
    fn = s["first_n"]
    assert fn["pinned"]["by_band"]["all"]["best"] == "pinned:4"
    assert fn["pinned"]["by_band"]["all"]["adaspark_over_best"]["ratio"] == pytest.approx(20 / 18)
    assert fn["pld"]["best"] == "pld:3"
    assert fn["pld"]["adaspark_over_best"]["overall"]["ratio"] == pytest.approx(20 / 12)
    # The paper's parts keep their shape, with nothing in them.
    assert s["pinned"]["by_band"]["all"]["best"] is None and s["pld"]["adaspark_over_best"] is None


def test_best_fixed_arm_ranges_over_every_fixed_arm():
    speeds = {**CAPPED_SPEEDS, "tree:16": 19.0, "llama:server": 21.0, "block-chain": 9.0}
    s = summarize(all_capped(speeds), list(speeds), resamples=200)
    bf = s["first_n"]["best_fixed"]
    assert bf["arms"] == ["chain:3", "pinned:4", "pld:3", "tree:16", "llama:server", "block-chain"]  # not cost
    assert bf["best"] == "llama:server"
    assert bf["best_over_baseline"]["ratio"] == pytest.approx(2.1)
    ada = bf["adaspark_over_best"]
    assert ada["overall"]["ratio"] == pytest.approx(20 / 21) and ada["overall"]["lo"] <= ada["overall"]["hi"]
    assert set(ada) == {"overall", "by_source", "by_band"} and ada["by_band"]["<2048"]["replies"] == 6
    # Without adaspark there is a best arm but nothing over it; with no fixed arm there is no part.
    s = summarize(all_capped({"ar": 10.0, "chain:3": 12.0}), ["ar", "chain:3"], resamples=50)
    assert s["first_n"]["best_fixed"]["best"] == "chain:3" and s["first_n"]["best_fixed"]["adaspark_over_best"] is None
    s = summarize(all_capped({"ar": 10.0, "adaspark": 12.0, "cost": 9.0}), ["ar", "adaspark", "cost"], resamples=50)
    assert s["best_fixed"] is None and s["first_n"]["best_fixed"] is None
    # The paper's ratio picks its own best (here on uncapped replies of the workload above).
    s = summarize(workload(), list(SPEEDS), resamples=50)
    assert s["best_fixed"]["arms"] == ["pinned:8", "pinned:16", "pld:2", "pld:4", "chain:3"]
    assert s["best_fixed"]["best"] in ("pinned:8", "pinned:16")   # both sqrt(6) over ar, to rounding
    assert s["best_fixed"]["adaspark_over_best"]["overall"]["replies"] == 12


def test_report_of_all_capped_replies_shows_the_first_n_ratio(tmp_path):
    from adaspark_cli.compare_report import figure, tables

    s = summarize(all_capped(), list(CAPPED_SPEEDS), resamples=100)
    text = tables(s)
    assert "all paired replies, first N tokens" in text and "uncapped replies only (paper)" in text
    assert "2.00x" in text and "Best fixed arm" in text and "1.11x" in text   # adaspark / pinned:4
    assert figure(s, tmp_path / "f.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_without_any_usable_reply_has_dashes_and_no_figure(tmp_path):
    from adaspark_cli.compare_report import figure, tables

    # Every reply a single delta: no ratio of either kind anywhere.
    rs = [traced(a, f"s/c{c}", [[7, 0.0]], capped=True) for c in range(2) for a in CAPPED_SPEEDS]
    s = summarize(rs, list(CAPPED_SPEEDS), resamples=100)
    json.dumps(s, allow_nan=False)
    text = tables(s)
    assert "-" in text and "x [" not in text
    assert figure(s, tmp_path / "f.png") is None and not (tmp_path / "f.png").exists()
    # One arm without a usable reply next to others that have one: a dash in its column only.
    rs = all_capped({"ar": 10.0, "adaspark": 20.0})
    rs += [traced("chain:3", r["conversation"], [[96, 0.0]], turn=r["turn"], capped=True) for r in rs if r["arm"] == "ar"]
    s = summarize(rs, ["ar", "chain:3", "adaspark"], resamples=100)
    assert s["first_n"]["vs_baseline"]["chain:3"]["overall"]["ratio"] is None
    assert s["first_n"]["best_fixed"]["best"] is None and s["first_n"]["best_fixed"]["adaspark_over_best"] is None
    text = tables(s)
    assert "2.00x" in text
    assert figure(s, tmp_path / "g.png").exists()
    # No baseline at all, or an empty run: still no exception.
    assert figure(summarize(rs, ["chain:3", "adaspark"], resamples=100), tmp_path / "h.png") is None
    empty = summarize([], ["ar", "adaspark"], resamples=100)
    assert tables(empty).strip() == "" or "-" in tables(empty)
    assert figure(empty, tmp_path / "i.png") is None
