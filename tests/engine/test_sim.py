"""The simulated target and drafter: known cost curves, one-sided noise, known acceptance.

Pure and fast: no llama.cpp. The long runs use the virtual clock, so nothing here is timed.
"""

import pytest

from adaspark_core.base import tree
from adaspark_core.base.tree import head_q
from adaspark_core.candidates.ngram import SuffixIndex, fill
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.engine.sim import (
    CURVES,
    EOG,
    SENTINEL,
    CostCurve,
    DraftParams,
    Interference,
    SimText,
    VirtualClock,
    best_pinned,
    expected_rate,
    expected_tokens,
    make_sim,
    rows_verified,
    tree_shape,
)


def _generation(target, prompt, arm, max_tokens, clock, drafter):
    """A Generation over the simulator (SimText never repeats a token, so the n-gram fill of the
    arms that have it finds nothing)."""
    return Generation(target, prompt, parse_arm(arm), max_tokens, clock=clock, drafter=drafter)


def run(target, prompt, arm, max_tokens, clock, drafter):
    gen = _generation(target, prompt, arm, max_tokens, clock, drafter)
    for _ in gen:
        pass
    return gen


def test_presets_have_the_papers_shapes():
    qwen, lfm, moe = CURVES["qwen3-4b-q4km"], CURVES["lfm2.5-2.6b-q8"], CURVES["lfm2.5-8b-a1b-moe"]
    for c in (443, 1596, 8444):
        assert qwen.true_ms(9, c) / qwen.true_ms(8, c) > 1.3  # the 4-bit fragment step at 9 rows
        assert qwen.true_ms(2, c) == qwen.true_ms(8, c)  # flat to 8 rows
        assert lfm.true_ms(48, c) < lfm.true_ms(40, c)  # the non-monotone inversion
        assert lfm.true_ms(48, c) == pytest.approx(0.957 * lfm.true_ms(40, c))
        times = [moe.true_ms(n, c) for n in range(1, 65)]
        assert all(b > a for a, b in zip(times, times[1:]))  # MoE: every row costs more
    assert moe.true_ms(16, 0) / moe.true_ms(2, 0) == pytest.approx(2.16)
    assert qwen.true_ms(16, 0) == pytest.approx(36.7)  # Table 1 intercept
    # Table 1 fits reproduce the measured times within a few percent.
    assert qwen.true_ms(16, 1596) == pytest.approx(40.6, rel=0.02)
    assert lfm.true_ms(32, 8444) == pytest.approx(47.3, rel=0.02)
    for name, curve in CURVES.items():
        for n in (1, 2, 8, 16, 32, 64):
            assert curve.true_ms(n, 4000) > curve.true_ms(n, 200) > 0, name  # context raises time
    # The CPU tables: the measured values at 200 tokens, the context slope as specified.
    q4 = CURVES["cpu-smollm2-q4_0"]
    assert q4.true_ms(6, 200) == pytest.approx(16.0) and q4.true_ms(8, 200) == pytest.approx(14.5)
    assert q4.true_ms(8, 200) < q4.true_ms(6, 200)  # 8 rows cheaper than 6
    assert q4.true_ms(16, 1500) / q4.true_ms(16, 200) == pytest.approx(1.5)
    assert q4.true_ms(4, 1500) / q4.true_ms(4, 200) == pytest.approx(1.3)
    with pytest.raises(ValueError):
        qwen.true_ms(65, 100)


def test_virtual_clock():
    clock = VirtualClock()
    assert clock() == 0.0
    clock.advance_ms(1500.0)
    assert clock() == pytest.approx(1.5) and clock.ms == 1500.0
    with pytest.raises(ValueError):
        clock.advance_ms(-1.0)


def test_custom_curves():
    step = CostCurve.from_points([(4, 10.0, 1.0), (8, 20.0)], kind="step")
    assert step.true_ms(1, 1000) == step.true_ms(4, 1000) == 11.0
    assert step.true_ms(5, 1000) == 20.0
    interp = CostCurve.from_points([(1, 10.0), (5, 30.0)])
    assert interp.true_ms(3, 123) == pytest.approx(20.0)
    with pytest.raises(ValueError):
        CostCurve.from_points([(4, 1.0), (2, 1.0)])


def test_noise_is_one_sided_and_often_zero():
    target, drafter, clock, prompt = make_sim("qwen3-4b-q4km", seed=3)
    gen = _generation(target, prompt, "tree:8", 10**6, clock, drafter)
    clean = 0
    for i, _ in enumerate(gen):
        rec = gen.last_record
        assert rec.times.verify >= target.last_true_ms  # never faster than the machine
        assert rec.times.verify == rec.times.decode
        clean += rec.times.verify == target.last_true_ms
        if i == 1999:
            break
    assert clean / 2000 == pytest.approx(0.7, abs=0.04)
    noise = Interference(p_clean=0.7, noise_mean=0.05, seed=1)
    eps = [noise.draw() for _ in range(20000)]
    assert min(eps) == 0.0
    assert sum(eps) / len(eps) == pytest.approx(0.3 * 0.05, rel=0.1)


def test_text_is_lazy_and_reproducible():
    a, b = SimText(5), SimText(5)
    assert a.truth(100) == b.span(0, 101)[100]
    assert a.span(0, 50) == b.span(0, 50) != SimText(6).span(0, 50)
    assert all(t not in (SENTINEL, EOG) for t in a.span(0, 5000))
    assert SimText(5, eog_at=7).truth(7) == EOG
    text = a.span(0, 5000)
    assert len(set(text)) == len(text)  # no repeats, so the n-gram source never fires
    index = SuffixIndex()
    index.extend(text)
    cands = []
    fill(cands, index, 32)
    assert cands == []


def test_the_head_based_estimate_prices_candidates_at_their_true_probability():
    def prior_q(c):
        return head_q(c.to_dict(), 0.5)

    p = DraftParams()
    cands = tree_shape(p, 7)
    assert len(cands) == 7 * 8
    tree.check_topological(cands)
    for c in cands:
        a = p.a(c.depth)
        if c.source == "pick":
            assert prior_q(c) == pytest.approx(a)
    sib = [c for c in cands if c.depth == 2 and c.source == "sibling"]
    assert sum(prior_q(c) for c in sib) == pytest.approx((1 - p.a(2)) * p.sibling_hit)
    assert prior_q(sib[0]) > prior_q(sib[-1])  # r_k decreasing
    assert expected_tokens(p, 1) == 1.0
    assert expected_tokens(p, 2) == pytest.approx(1.8)
    assert expected_tokens(p, 4) == pytest.approx(1 + 0.8 + 0.8 * 0.7 + 0.8 * 0.7 * 0.65)
    assert rows_verified(p, 64) == 57  # a 7 x 8 block offers 56 candidates


def test_proposals_are_a_dspark_block_with_distinct_tokens():
    target, drafter, clock, prompt = make_sim("lfm2.5-2.6b-q8", seed=1)
    drafter.begin(prompt)
    cands = drafter.block(3)
    assert clock.ms == pytest.approx(2.0)
    assert len(cands) == 3 * 8 and max(c.depth for c in cands) == 3
    tree.check_topological(cands)
    for d in (1, 2, 3):
        toks = [c.token for c in cands if c.depth == d]
        assert len(set(toks)) == 8 and SENTINEL not in toks
        picks = [j for j, c in enumerate(cands) if c.depth == d and c.source == "pick"]
        assert len(picks) == 1
        assert all(c.parent == cands[picks[0]].parent for c in cands if c.depth == d)
    # Common random numbers: the same position gives the same proposals at any depth limit.
    again = drafter.block(7)
    assert [c.token for c in again[:24]] == [c.token for c in cands]


@pytest.mark.parametrize("arm", ["ar", "tree:8", "tree:16"])
def test_generation_emits_the_truth(arm):
    target, drafter, clock, prompt = make_sim("qwen3-4b-q4km", seed=2, prompt_len=50)
    gen = run(target, prompt, arm, 300, clock, drafter)
    assert gen.tokens == target.text.span(50, 350) and gen.finish == "length"
    if arm != "ar":
        assert gen.stats.rounds < 300 / 2  # the drafter's blocks are accepted
        assert max(gen.stats.widths) <= parse_arm(arm).max_width


def test_end_token_stops_the_reply():
    target, drafter, clock, prompt = make_sim("qwen3-4b-q4km", seed=2, prompt_len=50, eog_at=80)
    gen = run(target, prompt, "tree:16", 1000, clock, drafter)
    assert gen.finish == "stop" and gen.tokens == target.text.span(50, 80)


def _run_rounds(name, arm, rounds, seed=0, **kw):
    target, drafter, clock, prompt = make_sim(name, seed=seed, n_ctx=10**6, **kw)
    gen = _generation(target, prompt, arm, 10**7, clock, drafter)
    recs = []
    for _ in gen:
        recs.append(gen.last_record)
        if len(recs) == rounds:
            break
    return gen, clock, recs


@pytest.mark.parametrize("width", [4, 8, 16])
def test_realised_tokens_per_round_match_the_exact_expectation(width):
    gen, clock, recs = _run_rounds("lfm2.5-2.6b-q8", f"tree:{width}", 3000, seed=width)
    realised = gen.stats.generated / gen.stats.rounds
    assert realised == pytest.approx(expected_tokens(DraftParams(), width), rel=0.03)
    assert set(gen.stats.widths) == {width}


def test_realised_rate_matches_expected_rate_at_fixed_context():
    # A context-free curve, so the rate does not drift as the reply grows.
    curve = CostCurve.from_points([(1, 10.0), (8, 20.0), (16, 40.0)], kind="step", name="flat")
    gen, clock, recs = _run_rounds("", "tree:8", 3000, seed=4, curve=curve)
    realised = gen.stats.generated / clock.ms
    assert realised == pytest.approx(expected_rate(curve, DraftParams(), 8, 200, 2.0), rel=0.03)


def test_best_pinned_is_the_fastest_width():
    p = DraftParams()
    for name, curve in CURVES.items():
        widths = list(range(1, 65))
        n, rate = best_pinned(curve, p, widths, 1000, 2.0)
        assert rate == max(expected_rate(curve, p, w, 1000, 2.0) for w in widths)
        assert expected_rate(curve, p, n, 1000, 2.0) == rate
    # On the 4-bit Qwen curve nothing beats the top of the flat 8-row class.
    assert best_pinned(CURVES["qwen3-4b-q4km"], p, range(1, 65), 1000, 2.0)[0] == 8


def test_clock_advances_by_draft_plus_verify():
    gen, clock, recs = _run_rounds("cpu-smollm2-q4_0", "tree:16", 200)
    assert all(r.times.draft == pytest.approx(2.0) for r in recs)
    total = sum(r.times.draft + r.times.verify + r.times.commit for r in recs)
    assert clock.ms == pytest.approx(total)
    assert gen.stats.decode_seconds > 0


def test_same_seed_same_records():
    a = [r.to_json() for r in _run_rounds("lfm2.5-8b-a1b-moe", "tree:16", 100, seed=9)[2]]
    b = [r.to_json() for r in _run_rounds("lfm2.5-8b-a1b-moe", "tree:16", 100, seed=9)[2]]
    c = [r.to_json() for r in _run_rounds("lfm2.5-8b-a1b-moe", "tree:16", 100, seed=10)[2]]
    assert a == b != c
