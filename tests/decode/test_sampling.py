"""Sampling that speculation cannot change (issue 17, first part; adaspark_core/base/sampling.py): the
sampler chain's distribution against a plain reference of llama.cpp's chain, the draw's exact
distribution, and on the real model a speculative sampled decode that gives the very tokens a
one-row-per-round decode with the same seed gives."""

import copy
import math

import numpy as np
import orjson
import pytest
from conftest import PROMPTS, assert_same_sample

from adaspark_core.base.sampling import Sampling, distribution, draw, gumbel, scores


def reference(logits, s: Sampling) -> np.ndarray:
    """llama.cpp's chain, written plainly: top-k, top-p (softmax of what is left, shortest prefix
    reaching p), min-p (p >= min_p x the top p), temperature, softmax. A full distribution."""
    x = np.asarray(logits, dtype=np.float64)
    order = sorted(range(len(x)), key=lambda i: -x[i])
    if s.top_k > 0:
        order = order[: s.top_k]
    if s.top_p < 1:
        e = [math.exp(x[i] - x[order[0]]) for i in order]
        cum, keep = 0.0, []
        for i, w in zip(order, e):
            keep.append(i)
            cum += w / sum(e)
            if cum >= s.top_p:
                break
        order = keep
    if s.min_p > 0:
        order = [i for i in order if math.exp(x[i] - x[order[0]]) >= s.min_p]
    w = np.array([math.exp((x[i] - x[order[0]]) / s.temperature) for i in order])
    out = np.zeros(len(x))
    out[order] = w / w.sum()
    return out


SETTINGS = [Sampling(0.7), Sampling(1.0, top_k=5), Sampling(0.8, top_p=0.9), Sampling(1.3, min_p=0.05),
            Sampling(0.7, top_p=0.95, top_k=40, min_p=0.02), Sampling(0.5, top_p=0.5)]


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: s.describe())
def test_the_chains_distribution_is_llama_cpps(s):
    rng = np.random.default_rng(3)
    for n in (50, 3000):
        logits = rng.normal(0, 3, n).astype(np.float32)
        ids, p = distribution(logits, s)
        got = np.zeros(n)
        got[ids] = p
        assert np.allclose(got, reference(logits, s), atol=1e-9)


def test_top_p_reaches_past_the_prefilter_when_the_head_is_flat():
    logits = np.linspace(0.0, 0.01, 5000).astype(np.float32)  # almost flat: top-p 0.5 keeps about 2,500
    s = Sampling(1.0, top_p=0.5)
    ids, p = distribution(logits, s)
    got = np.zeros(len(logits))
    got[ids] = p
    assert len(ids) > 2000 and np.allclose(got, reference(logits, s), atol=1e-12)


def test_draws_follow_the_chains_distribution_and_are_keyed_by_seed_and_position():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], dtype=np.float32)
    for s in (Sampling(0.9, top_p=0.97), Sampling(1.0), Sampling(0.6, top_k=3)):
        n = 40_000  # enough to see a total variation of 1%
        counts = np.zeros(len(logits))
        for pos in range(n):
            counts[draw(logits, s, seed=7, pos=pos)] += 1
        assert 0.5 * np.abs(counts / n - reference(logits, s)).sum() < 0.01, s
    ids = np.arange(50_000)
    g = gumbel(3, 9, ids)
    assert abs(g.mean() - 0.5772) < 0.02 and abs(g.var() - math.pi ** 2 / 6) < 0.05  # standard Gumbel
    assert np.array_equal(gumbel(3, 9, ids[[5, 7]]), g[[5, 7]])  # a token's noise, whatever else is drawn
    assert abs(np.corrcoef(g, gumbel(3, 10, ids))[0, 1]) < 0.02  # the next position: independent
    assert abs(np.corrcoef(g, gumbel(4, 9, ids))[0, 1]) < 0.02  # another seed: independent
    assert abs(np.corrcoef(g[1:], gumbel(3, 10, ids)[:-1])[0, 1]) < 0.02  # no shifted copies


def test_the_fast_draw_is_the_best_perturbed_score_among_the_kept_tokens():
    rng = np.random.default_rng(5)
    for scale in (1.0, 3.0, 8.0):  # flat to peaky
        logits = rng.normal(0, scale, 3000).astype(np.float32)
        for s in (Sampling(0.7), Sampling(0.8, top_p=0.9), Sampling(1.2, min_p=0.1), Sampling(0.7, top_p=0.95, min_p=0.02)):
            for pos in range(150):
                ids, sc = scores(logits, s, 3, pos)  # the kept set built, then Gumbel-max over it
                assert draw(logits, s, 3, pos) == ids[int(np.argmax(sc))], (scale, s, pos)


def test_the_top_k_threshold_finds_the_k_largest():
    from adaspark_core.base.sampling import _top

    rng = np.random.default_rng(3)
    for scale, k in [(3.0, 1), (3.0, 40), (0.01, 40), (30.0, 1024), (3.0, 5000)]:
        x = (rng.normal(size=49152) * scale).astype(np.float32)
        assert set(_top(x, k).tolist()) == set(np.argsort(-x, kind="stable")[:k].tolist()), (scale, k)
    x = np.full(1000, -np.inf, dtype=np.float32)
    x[[5, 9]] = [1.0, 2.0]  # fewer finite logits than k: the rest come from the -inf tokens
    got = _top(x, 4)
    assert len(got) == 4 and {5, 9} <= set(got.tolist())


def g_test_p(counts: dict, probs: dict) -> float:
    """The G-test's p-value of observed ``counts`` against a distribution ``probs`` over the same
    outcomes (Wilson-Hilferty's normal approximation of the chi-square tail); 0 if an outcome with
    no probability was seen."""
    n = sum(counts.values())
    if any(probs.get(k, 0.0) <= 0.0 for k in counts):
        return 0.0
    g = 2.0 * sum(o * math.log(o / (n * probs[k])) for k, o in counts.items() if o)
    df = sum(1 for p in probs.values() if p > 0) - 1
    z = ((g / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.model
def test_speculative_sampling_gives_the_targets_joint_distribution_of_the_next_three_tokens(lm, target):
    """Exactness in distribution on the real model: one tree verify holds every path of the
    sampler's kept tokens two deep (top_k 3: 1 + 3 + 9 rows); for 40,000 seeds the live round's
    acceptance (tree.accept_walk over scheduler.Draws) yields two accepted drafts and a bonus.
    Their counts match the closed-form joint p(t1) p(t2 | t1) p(t3 | t1, t2) of the same rows'
    distributions (G-test), and the same counts reject that joint with 1% of its mass moved
    between its two likeliest outcomes: the test detects a 1% total-variation error."""
    from conftest import prompt_tokens

    from adaspark_core.base.sampling import distribution
    from adaspark_core.base.tree import NGRAM, Candidate, accept_walk, layout
    from adaspark_core.decode.round import Draws

    s = Sampling(1.0, top_k=3)
    target.start(prompt_tokens(lm, "rewrite.txt"))

    def verified(cands):
        lay = layout(target.anchor, cands, list(range(len(cands))))
        target.verify(lay)
        rows = target.row_logits().copy()
        target.discard(lay)
        return lay, rows

    # Grow the tree a level a verify, each row's 5 likeliest tokens its children: a superset of the
    # 3 the sampler keeps on the final verify's rows (rows of other widths differ by up to ~0.3 in
    # a logit here, enough to swap ranks 3 and 4).
    cands, wider = [], Sampling(1.0, top_k=5)
    for depth in (1, 2):
        lay, rows = verified(cands)
        for r in range(lay.width):
            if lay.depth[r] == depth - 1:
                cands += [Candidate(int(t), lay.cand[r], NGRAM, depth) for t in distribution(rows[r], wider)[0]]
    lay, rows = verified(cands)
    assert lay.width == 31

    def p(row: int) -> dict:  # the sampler's distribution on a row of the final verify
        ids, ps = distribution(rows[row], s)
        return dict(zip(ids.tolist(), ps.tolist()))

    truth = {}
    for r1 in lay.children[0]:
        for r2 in lay.children[r1]:
            pre = p(0).get(lay.token[r1], 0.0) * p(r1).get(lay.token[r2], 0.0)
            for t, q in p(r2).items():
                truth[(lay.token[r1], lay.token[r2], t)] = pre * q
    assert math.isclose(sum(truth.values()), 1.0, rel_tol=1e-9)
    truth = {k: v for k, v in truth.items() if v > 0}
    assert len(truth) == 27

    counts: dict = {}
    for seed in range(40_000):
        path, bonus = accept_walk(lay, Draws(rows, s, seed, target.n_past, lay.depth))
        key = (*(lay.token[r] for r in path), bonus)
        counts[key] = counts.get(key, 0) + 1
    assert g_test_p(counts, truth) > 1e-3, sorted(counts.items())
    first, second = sorted(truth, key=truth.get)[-2:]
    moved = {**truth, first: truth[first] + 0.01, second: truth[second] - 0.01}
    assert g_test_p(counts, moved) < 1e-3


@pytest.mark.model
def test_speculation_never_changes_a_seeded_sample(lm, target):
    from adaspark_core.decode.arms import parse_arm
    from adaspark_core.decode.generation import run
    from adaspark_core.learn.learned import Learners

    prompt = lm.chat_prompt([{"role": "user", "content": (PROMPTS / "rewrite.txt").read_text()}])
    s = Sampling(0.8, top_p=0.95, seed=12)  # a sample adaspark finds worth speculating on (not every one is)
    plain = run(target, prompt, parse_arm("ar"), 64, sampling=s)
    assert plain.seed == 12 and set(plain.stats.widths) == {1}
    warm = Learners()
    run(target, prompt, parse_arm("adaspark"), 64, learners=warm)
    before = warm.state()
    sampled = copy.deepcopy(warm)  # the sampled regime's own learners
    for arm in ("chain:4", "tree:8", "adaspark"):
        spec = run(target, prompt, parse_arm(arm), 64, sampling=s, learners=sampled if arm == "adaspark" else None)
        assert max(spec.stats.widths) > 1, arm  # it did speculate
        assert_same_sample(lm, prompt, spec.tokens, plain.tokens, s, 12, arm)
    assert sampled.state() != before and warm.state() == before  # it learnt into the learners it was given
    other = run(target, prompt, parse_arm("ar"), 64, sampling=Sampling(0.8, top_p=0.95, seed=13))
    assert other.tokens != plain.tokens  # another seed, another sample
    greedy = run(target, prompt, parse_arm("ar"), 64)
    assert greedy.tokens != plain.tokens and greedy.seed is None


# --- the sampled regime, on the simulated model (its rows have a distribution: engine/simlm.py) ------


def _sim():
    from conftest import SIM

    from adaspark_core.engine.simlm import SimModel

    return SimModel(SIM)


def test_on_the_simulated_model_every_arm_samples_the_same_text_for_a_seed():
    from adaspark_core.decode.arms import parse_arm
    from adaspark_core.decode.generation import run

    model = _sim()
    prompt = model.tokenize("Tell me about the sea, and the sea again.")
    s = Sampling(0.7, seed=5)
    plain = run(model.target(), prompt, parse_arm("ar"), 150, sampling=s)
    for arm in ("chain:3", "tree:16", "adaspark"):
        spec = run(model.target(), prompt, parse_arm(arm), 150, sampling=s)
        assert spec.tokens == plain.tokens and spec.stats.rounds < plain.stats.rounds, arm  # no kernel ties here
    assert run(model.target(), prompt, parse_arm("ar"), 150, sampling=Sampling(0.7, seed=6)).tokens != plain.tokens
    greedy = run(model.target(), prompt, parse_arm("ar"), 150)
    assert greedy.tokens != plain.tokens


def test_sampled_rounds_are_logged_and_a_mixed_log_replays_into_both_regimes(tmp_path):
    from adaspark_core.decode.arms import parse_arm
    from adaspark_core.decode.generation import run
    from adaspark_core.evaluate.replay import replay
    from adaspark_core.learn.learned import SAMPLED_SECTION, Learners
    from adaspark_core.store.record import RoundLog, read_log

    model = _sim()
    target = model.target()
    prompts = [model.tokenize(t) for t in ("the sea, the sea and the sea", "tell a story of the sea")]
    live, arm = Learners(), parse_arm("adaspark")
    with RoundLog(tmp_path / "r.jsonl") as log:
        for i, how in enumerate([None, Sampling(0.8, top_p=0.95, seed=3), None, Sampling(1.0, top_k=5), None]):
            learners = live.regime(how is not None)
            gen = run(target, prompts[i % 2], arm, 120, request_id=f"q{i}", log=log, learners=learners, sampling=how)
            assert gen.finish == "length"
            if i == 1:
                assert live.sampled is learners and live.sampled.acceptance.requests == live.acceptance.requests + 1  # the copy, and this one
    records = list(read_log(tmp_path / "r.jsonl"))
    sampled = [r for r in records if r.sampling is not None]
    assert {r.request for r in sampled} == {"q1", "q3"}
    assert sampled[0].sampling == {"temperature": 0.8, "top_k": 0, "top_p": 0.95, "min_p": 0.0, "seed": 3}
    assert isinstance(sampled[-1].sampling["seed"], int)  # an unseeded request records the seed it drew
    for r in sampled:  # the draws of the rows the accept walk read, -1 for the rest
        row_of = {j: k for k, j in enumerate(r.rows)}
        path_rows = [0] + [row_of[j] for j in r.path]
        assert all(r.argmax[k] >= 0 for k in path_rows) and r.argmax[path_rows[-1]] == r.bonus
        assert all(r.argmax[k] == -1 for k in range(len(r.rows)) if k not in path_rows)
    replayed, report = replay(records)  # raises on any round decided otherwise
    assert replayed.state() == live.state() and SAMPLED_SECTION in live.state()
    assert [q.sampled for q in report.requests] == [False, True, False, True, False]
    assert live.sampled.acceptance.state() != live.acceptance.state()
    # a regime restored from its section goes on as the live one
    st = orjson.loads(orjson.dumps(live.state()))  # as the store holds it
    assert orjson.loads(orjson.dumps(Learners.from_state(st).state())) == st
    with pytest.raises(ValueError, match="sampled"):
        Learners.from_state({**st, SAMPLED_SECTION: st})


def test_sampled_decodes_save_their_regime_and_replay_across_processes(tmp_path):
    from conftest import SIM
    from helpers import adaspark

    from adaspark_core.evaluate.replay import replay
    from adaspark_core.learn.learned import Learners
    from adaspark_core.store.record import read_log
    from adaspark_core.store.store import Store

    (tmp_path / "p.txt").write_text("Tell me about the sea, and the sea again.")
    store, log = tmp_path / "s.json", tmp_path / "r.jsonl"
    base = ["decode", tmp_path / "p.txt", "--model", SIM, "--store", store, "--log", log, "--max-tokens", 80]
    texts = []
    for extra in ([], ["--temperature", "0.8", "--seed", "4"], [], ["--temperature", "0.8", "--seed", "4"]):
        res = adaspark(*base, *extra)
        assert res.returncode == 0, res.stderr
        texts.append(res.stdout)
    assert texts[1] == texts[3] and texts[1] != texts[0]  # seeded: the same sample in another process
    saved = Learners.from_store(Store.read(store)[0])
    assert saved.sampled is not None
    replayed, _ = replay(read_log(log))
    assert replayed.state() == saved.state()
    res = adaspark("replay", log)
    assert res.returncode == 0 and "sampled" in res.stdout, res.stderr
    shown = adaspark("store", "show", "--store", store)
    assert shown.returncode == 0 and "Sampled regime (temperature > 0" in shown.stdout, shown.stderr
