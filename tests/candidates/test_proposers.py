"""The proposer contract (candidates/base.py) and the round split (decode/generation.py): every
candidate source begins, proposes, accepts and ends the same way, and a round is ``plan``, one
verify, ``complete``, so verifies could be shared between requests."""

import pytest
from conftest import SIM

from adaspark_core.base import tree
from adaspark_core.base.tree import ANCHOR, NGRAM, PICK, Candidate, append_proposal
from adaspark_core.candidates.base import PicksOnly, propose_round
from adaspark_core.candidates.memory import NgramMemory
from adaspark_core.candidates.ngram import NgramSource
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.decode.runtime import open_model
from adaspark_core.engine.sim import make_sim

CONTRACT = ("begin", "propose", "accept", "end")


def test_a_proposal_appended_keeps_its_own_tree():
    cands = [Candidate(5, ANCHOR, PICK, 1), Candidate(6, 0, PICK, 2)]
    new = [Candidate(7, ANCHOR, NGRAM, 1), Candidate(8, 0, NGRAM, 2), Candidate(9, 1, NGRAM, 3)]
    append_proposal(cands, new)
    assert [c.parent for c in cands] == [ANCHOR, 0, ANCHOR, 2, 3]
    tree.check_topological(cands)


def test_every_source_implements_the_contract():
    _, drafter, _, _ = make_sim("lfm2.5-2.6b-q8", seed=1)
    for source in (drafter, NgramSource(1), PicksOnly(drafter)):
        assert all(callable(getattr(source, m, None)) for m in CONTRACT), source
        assert isinstance(source.name, str)


def test_the_ngram_fill_hangs_from_the_drafters_block_and_the_memory_hears_the_reply():
    _, drafter, _, prompt = make_sim("lfm2.5-2.6b-q8", seed=1)
    memory = NgramMemory()
    ngram = NgramSource(1, memory)
    text = prompt + prompt[:20]  # the request repeats itself: the fill has copies to offer
    for source in (drafter, ngram):
        source.begin(text)
    block = [c.token for c in drafter.block(8)]
    cands = propose_round([drafter, ngram], 8)
    tree.check_topological(cands)
    assert [c.token for c in cands[: len(block)]] == block  # the drafter's block first, whole
    assert all(c.source == NGRAM for c in cands[len(block):]) and len(cands) > len(block)
    assert propose_round([drafter, ngram], 0) == []
    picks = propose_round([PicksOnly(drafter)], 5)
    assert [c.parent for c in picks] == [ANCHOR, 0, 1, 2, 3] and all(c.source == PICK for c in picks)
    for source in (drafter, ngram):
        source.end([1, 2, 3, 4, 5, 6])
    assert memory.documents == 1


@pytest.mark.parametrize("arm", ["adaspark", "chain:3", "tree:8"])
def test_two_requests_planned_verified_and_completed_in_step_reply_as_they_do_alone(arm):
    """What batching needs: two requests advanced phase by phase, interleaved (both plan, both
    verify, both complete), give each the reply it gives alone."""
    model = open_model(SIM)
    prompts = [model.tokenize(t) for t in ("Say it twice: the cat sat on the mat.", "Count: one two three four.")]

    def alone(prompt):
        gen = Generation(model.target(n_ctx=512), prompt, parse_arm(arm), 60)
        for _ in gen:
            pass
        return gen.tokens, gen.finish, gen.stats.widths  # the widths: the same decisions

    gens = [Generation(model.target(n_ctx=512), p, parse_arm(arm), 60) for p in prompts]
    for g in gens:
        g.begin()
    while any(g.finish is None for g in gens):
        live = [g for g in gens if g.finish is None]
        plans = []
        for g in live:
            g.learn_previous_round()
            plans.append(g.decide(g.propose()))
        verified = [g.target.verify(p.layout) for g, p in zip(live, plans)]
        for g, p, v in zip(live, plans, verified):
            g.complete(p, v)
    for g in gens:
        g.close()
    assert [(g.tokens, g.finish, g.stats.widths) for g in gens] == [alone(p) for p in prompts]
    assert all(g.last_record.last for g in gens)
