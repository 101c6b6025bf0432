"""The DSpark block drafter (issue "Model drafters") on the real default model, with a synthetic
DSpark GGUF written by fixtures/make_dspark_gguf.py: random weights, the target's vocabulary and
width, block size 4, Markov rank 8, a confidence head. Its drafts are junk; what is tested is
that the whole path runs exactly: hidden states in, blocks out, caches in step, decoding exact."""

import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT, prompt_tokens
from helpers import adaspark, assert_one_error_line, decode_checked

from adaspark_core.base.tree import ANCHOR, PICK, SIBLING
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation

pytestmark = pytest.mark.model

B, K = 4, 8


def make_gguf(out, *extra):
    subprocess.run([sys.executable, str(ROOT / "fixtures" / "make_dspark_gguf.py"), "--out", str(out), *extra],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def dspark_file(tmp_path_factory):
    return make_gguf(tmp_path_factory.mktemp("dspark") / "dspark.gguf", "--block", str(B), "--markov-rank", "8")


@pytest.fixture(scope="module")
def dspark(lm, dspark_file):
    """A target of its own (the drafter switches on its hidden-state capture) and the drafter."""
    from adaspark_core.candidates.drafters import make_drafter
    from adaspark_core.engine.llama_target import LlamaTarget

    target = LlamaTarget(lm, n_ctx=2048)
    return target, make_drafter(f"dspark:{dspark_file}", target, top_k=K)


def check_block(cands, depth_limit):
    """Paper 2.2's shape: min(B, depth) positions, each a pick on the spine and K - 1 sibling leaves
    beside it, with features in range."""
    n = min(B, depth_limit)
    assert len(cands) == n * K
    for i in range(n):
        pick, sibs = cands[i * K], cands[i * K + 1 : (i + 1) * K]
        assert pick.source == PICK and pick.parent == (ANCHOR if i == 0 else (i - 1) * K)
        assert pick.depth == i + 1
        assert all(s.source == SIBLING and s.parent == pick.parent for s in sibs)
        assert len({pick.token, *(s.token for s in sibs)}) == K
        assert 0 <= pick.h <= 1 and 0 < pick.share <= 1 and pick.sigma == pick.share
        assert all(s.h == pick.h and s.sigma == pick.sigma and 0 <= s.share <= 1 for s in sibs)
        assert sum(s.share for s in sibs) == pytest.approx(1.0)


def test_dspark_decodes_exactly_and_its_cache_follows_the_targets(lm, dspark):
    target, drafter = dspark
    assert drafter.B == B and drafter.ctx.has_confidence and len(drafter.ctx.layer_ids) == 3
    rounds = []
    confidences = set()

    def per_round(gen):
        rec = gen.last_record
        # the draft cache holds a cell at every committed position but the anchor's, as the
        # target's does, and no block cell survives a round
        assert drafter.n_past == target.n_past and drafter.ctx.pos_range() == (0, target.n_past - 1)
        assert drafter.anchor == target.anchor
        drafted = [c for c in rec.candidates if c["source"] in (PICK, SIBLING)]
        # no deeper than the arm, the context or the tokens the reply may still emit less one,
        # and nothing below a pick that is an end token
        budget = gen.max_tokens - (len(gen.tokens) - len(rec.emitted))
        n = min(B, gen.arm.max_width - 1, target.n_ctx - rec.context, budget - 1)
        picks = [c["token"] for c in drafted if c["source"] == PICK]
        ends = [i for i, tok in enumerate(picks) if lm.is_eog(tok)]
        if ends:
            n = min(n, ends[0] + 1)
        assert len(drafted) == n * K
        confidences.update(c["h"] for c in drafted)
        rounds.append(rec.round)

    for name, arm in [("explain.txt", "tree:8"), ("story.txt", "adaspark"), ("code.txt", "pinned:6"),
                      ("list.txt", "tree:16")]:
        decode_checked(lm, target, prompt_tokens(lm, name), arm, 160, per_round, drafter=drafter)
    assert len(rounds) >= 200
    assert len(confidences) > 10  # the confidence head's output, not a constant


def test_dspark_blocks_have_the_papers_shape_and_follow_the_markov_head(lm, dspark):
    target, drafter = dspark
    prompt = prompt_tokens(lm, "explain.txt")
    target.start(prompt)
    drafter.begin(prompt)
    check_block(drafter.block(16), 16)
    check_block(drafter.block(2), 2)  # a depth limit shortens the block
    logits, conf = drafter.ctx.draft(drafter.anchor, drafter.n_past, B)
    assert logits.shape == (B, lm.n_vocab) and conf.shape == (B,) and np.all((conf > 0) & (conf < 1))
    # Every proposal is computed afresh from the same cache: the block leaves no cell behind.
    again, _ = drafter.ctx.draft(drafter.anchor, drafter.n_past, B)
    assert np.array_equal(logits, again)
    assert drafter.ctx.pos_range() == (0, target.n_past - 1)


def test_the_incremental_cache_matches_a_fresh_prefill(lm, dspark):
    """After a reply, the block drafted from the cache the rounds built up (the kept rows of each
    verify injected) is the block drafted after prefilling the whole text at once."""
    target, drafter = dspark
    prompt = prompt_tokens(lm, "story.txt")
    gen = Generation(target, prompt, parse_arm("tree:8"), max_tokens=40, drafter=drafter)
    for _ in gen:
        pass
    text = prompt + gen.tokens
    if gen.finish == "stop":
        return pytest.skip("the reply ended on an end token")
    assert target.anchor == text[-1]
    grown, grown_conf = drafter.ctx.draft(drafter.anchor, drafter.n_past, B)
    target.start(text)
    drafter.begin(text)
    fresh, fresh_conf = drafter.ctx.draft(drafter.anchor, drafter.n_past, B)
    assert grown.argmax(axis=1).tolist() == fresh.argmax(axis=1).tolist()
    np.testing.assert_allclose(grown, fresh, atol=0.05)
    np.testing.assert_allclose(grown_conf, fresh_conf, atol=0.01)


def test_files_that_are_not_dspark_drafters_are_refused(tmp_path, default_model_path):
    prompt = ROOT / "fixtures" / "prompts" / "explain.txt"
    assert_one_error_line(adaspark("decode", prompt, "--drafter", f"dspark:{default_model_path}"),
                          "not a DSpark drafter")
    assert_one_error_line(adaspark("decode", prompt, "--drafter", f"dspark:{tmp_path / 'none.gguf'}"), "not found")
    selector = make_gguf(tmp_path / "dflash2.gguf", "--selector-top-k", "2")
    assert_one_error_line(adaspark("decode", prompt, "--drafter", f"dspark:{selector}"), "DFlash2")
    other = make_gguf(tmp_path / "narrow.gguf", "--block", "2")
    assert_one_error_line(adaspark("decode", prompt, "--drafter", f"dspark:{other}", "--block", "3"), "block size")
