"""Model drafters (issue "Model drafters"): the draft-model drafter on the real default model,
drafting for itself and as a differently quantised copy, and the block's shape."""

from types import SimpleNamespace

import numpy as np
import pytest
from conftest import prompt_tokens
from helpers import decode_checked

from adaspark_core.base import tree
from adaspark_core.base.errors import InputError
from adaspark_core.base.tree import ANCHOR, PICK, SIBLING
from adaspark_core.candidates.drafters import block, check_same_vocab, top_k
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation


def test_top_k_and_the_block_shape():
    logits = np.array([0.0, 3.0, 1.0, 3.0, -1.0, 2.0], dtype=np.float32)
    toks, probs, h = top_k(logits, 3)
    assert toks == [1, 3, 5]  # ties to the lower id, as the target's argmax
    p = np.exp(logits - 3) / np.exp(logits - 3).sum()
    assert probs == pytest.approx([p[1], p[3], p[5]]) and h == pytest.approx(p[1])
    cands = block([(toks, probs), ([7, 8, 9], [0.5, 0.3, 0.2])])
    tree.check_topological(cands)
    assert [(c.token, c.parent, c.source) for c in cands] == [
        (1, ANCHOR, PICK), (3, ANCHOR, SIBLING), (5, ANCHOR, SIBLING), (7, 0, PICK), (8, 0, SIBLING), (9, 0, SIBLING)]
    sigma = p[1] / (p[1] + p[3] + p[5])
    assert cands[0].share == pytest.approx(sigma) and cands[1].sigma == pytest.approx(sigma)
    assert cands[1].share + cands[2].share == pytest.approx(1.0)  # r: share of the siblings' total
    assert cands[3].share == pytest.approx(0.5) and cands[4].share == pytest.approx(0.6)


def fake_model(pieces, name="m.gguf"):
    return SimpleNamespace(n_vocab=len(pieces), piece_special=lambda t: pieces[t], path=SimpleNamespace(name=name))


def test_a_draft_model_with_another_vocabulary_is_refused():
    a = fake_model([b"a", b"b", b"c"])
    check_same_vocab(a, fake_model([b"a", b"b", b"c"]))
    with pytest.raises(InputError, match="vocabulary"):
        check_same_vocab(a, fake_model([b"a", b"b"]))
    with pytest.raises(InputError, match="token 1 differs"):
        check_same_vocab(a, fake_model([b"a", b"x", b"c"]))


@pytest.mark.model
@pytest.mark.parametrize("which", ["self", "q4_1"])
def test_a_draft_model_decodes_exactly_and_its_cache_follows_the_targets(lm, target, which):
    from adaspark_core.candidates.drafters import ModelDrafter
    from adaspark_core.engine.llama import LlamaModel
    from adaspark_core.engine.models import shipped_default

    draft_lm = lm if which == "self" else LlamaModel(shipped_default())
    drafter = ModelDrafter(lm, draft_lm, target.n_ctx, block=4, top_k=4)
    paths = []

    def per_round(gen):
        rec = gen.last_record
        # the draft holds exactly the committed text but the anchor, as the target's: in its
        # cache, or pending until its next draft (none pending right after one)
        assert drafter.n_past == target.n_past and drafter.anchor == target.anchor
        assert drafter.seq.n_past + len(drafter.pending) == target.n_past
        picks = [c for c in rec.candidates if c["source"] == PICK]
        depth = len(rec.drafting.forwards)
        assert len(picks) <= depth <= rec.drafting.limit <= 4 and (rec.drafting.rows > 0) == (depth > 0)
        # a round with one token of the budget left drafts nothing: the target's own token fills it
        # (which round that is depends on the widths the learners chose, so on timing); a fixed
        # arm drafts its whole block, the adaptive one as deep as its depth learner says
        budget = gen.max_tokens - (rec.context - len(gen.prompt))
        if budget <= 1:
            assert not picks and rec.drafting.limit == 0
        elif not gen.arm.adaptive:
            assert depth == rec.drafting.limit and len(picks) >= 1
        assert all(0 < c["h"] <= 1 and 0 < c["share"] <= 1 for c in picks)
        assert all(0 <= c["share"] <= 1 for c in rec.candidates if c["source"] == SIBLING)
        paths.append(len(rec.path))

    for name, arm in [("explain.txt", "tree:8"), ("story.txt", "adaspark"), ("code.txt", "pinned:6")]:
        decode_checked(lm, target, prompt_tokens(lm, name), arm, 200, per_round, drafter=drafter)
    rounds, accepted = len(paths), sum(paths)
    print(f"{which}: {accepted} draft tokens accepted in {rounds} rounds")
    if which == "self":  # the target drafting for itself: its picks are its own argmax
        assert accepted / rounds > 2.0


@pytest.mark.model
def test_block_chain_verifies_the_drafters_picks_as_one_chain(lm, target):
    from adaspark_core.candidates.drafters import ModelDrafter

    drafter = ModelDrafter(lm, lm, target.n_ctx, block=5, top_k=4)
    prompt = prompt_tokens(lm, "explain.txt")

    def per_round(gen):
        rec = gen.last_record
        assert [c["source"] for c in rec.candidates] == [PICK] * len(rec.candidates) and len(rec.candidates) <= 5
        assert [c["parent"] for c in rec.candidates] == list(range(-1, len(rec.candidates) - 1))
        assert rec.width == len(rec.candidates) + 1

    decode_checked(lm, target, prompt, "block-chain", 60, per_round, drafter=drafter)
    with pytest.raises(InputError, match="--drafter"):
        Generation(target, prompt, parse_arm("block-chain"), max_tokens=8)
