import random

import pytest

from adaspark_core.base import tree
from adaspark_core.base.tree import ANCHOR, NGRAM, PICK, SIBLING
from adaspark_core.candidates.ngram import (
    COPY,
    COPY_ALT,
    COPY_MIN,
    COPY_START,
    FOLLOW,
    FOLLOW_ALT,
    MAX_SCAN,
    KeptIndexes,
    NgramSource,
    SuffixIndex,
    bucket,
    evidence_bin,
    fill,
)


def index_of(tokens, **kw):
    idx = SuffixIndex(**kw)
    idx.extend(tokens)
    return idx


def rows(cands):
    """(token, parent, kind, evidence, bucket) per candidate: the hand-checkable part."""
    return [(c.token, c.parent, c.kind, c.evidence, c.bucket) for c in cands]


def ngram_fill(tokens, depth_limit, max_alts=3, cands=None):
    cands = [] if cands is None else cands
    fill(cands, index_of(tokens), depth_limit, max_alts)
    tree.check_topological(cands)
    return cands


# ---- buckets -------------------------------------------------------------------------------


def test_evidence_and_above_bins():
    assert [evidence_bin(COPY, e) for e in (4, 5, 7, 8, 15, 16, 31, 32, 500)] == [
        "4", "5", "5", "8", "8", "16", "16", "32", "32"]
    assert [evidence_bin(FOLLOW_ALT, e) for e in (1, 2, 3, 4, 5, 8, 9, 64)] == [
        "1", "2", "3", "3", "5", "5", "9", "9"]
    assert [bucket(COPY_ALT, 8, a).split("/")[2] for a in (0, 1, 2, 3, 4, 7, 8, 15, 16, 40)] == [
        "0", "1", "2", "3", "4", "4", "8", "8", "16", "16"]
    assert bucket(COPY, 8, 0) == "copy/8/0" and bucket(FOLLOW, 3, 5) == "follow/3/4"
    with pytest.raises(ValueError):
        evidence_bin("pick", 1)


# ---- copy mode -----------------------------------------------------------------------------


def test_copy_reads_on_into_its_own_tokens_around_a_loop():
    # Longest match: the suffix 1 2 3 4 (length 4) ending at 3; it reads on: 5, then H[5..] = 1 2
    # 3 4 are the committed tokens, then its own 5, 1, ... : the loop continues periodically.
    cands = ngram_fill([1, 2, 3, 4, 5, 1, 2, 3, 4], depth_limit=8)
    assert rows(cands) == [
        (5, ANCHOR, COPY, 4, "copy/4/0"),
        (1, 0, COPY, 5, "copy/5/1"),
        (2, 1, COPY, 6, "copy/5/2"),
        (3, 2, COPY, 7, "copy/5/3"),
        (4, 3, COPY, 8, "copy/8/4"),
        (5, 4, COPY, 9, "copy/8/4"),
        (1, 5, COPY, 10, "copy/8/4"),
        (2, 6, COPY, 11, "copy/8/4"),
    ]
    assert [c.above for c in cands] == list(range(8))
    assert [c.depth for c in cands] == list(range(1, 9))
    assert all(c.source == NGRAM for c in cands)


def test_copy_takes_the_longest_match_over_a_more_recent_shorter_one():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    toks = [1, 2, 3, 4, 9, 7, 2, 3, 4, 8, 1, 2, 3, 4]  # 2 3 4 -> 8 is more recent but shorter
    cands = ngram_fill(toks, depth_limit=5, max_alts=0)
    assert [c.token for c in cands] == [9, 7, 2, 3, 4]
    assert [c.evidence for c in cands] == [4, 5, 6, 7, 8]


def test_copy_continues_the_most_recent_of_equal_matches_and_offers_the_other_as_an_alternative():
    #        0  1  2  3  4  5  6  7  8  9 10 11 12 13
    toks = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4]
    cands = ngram_fill(toks, depth_limit=4)
    assert rows(cands) == [
        (6, ANCHOR, COPY, 4, "copy/4/0"),  # 1 2 3 4 -> 6 (end 8) is the more recent
        (1, 0, COPY, 5, "copy/5/1"),
        (2, 1, COPY, 6, "copy/5/2"),
        (3, 2, COPY, 7, "copy/5/3"),
        # the alternative 1 2 3 4 -> 5 (end 3): same evidence, then reads on along its own passage
        (5, ANCHOR, COPY_ALT, 4, "copy-alt/4/0"),
        (1, 4, COPY, 5, "copy/5/1"),
        (2, 5, COPY, 6, "copy/5/2"),
        (3, 6, COPY, 7, "copy/5/3"),
    ]
    assert ngram_fill(toks, depth_limit=4, max_alts=0) == cands[:4]


# ---- follower mode -------------------------------------------------------------------------

FOLLOW_TOKS = [
    11, 1, 2, 3, 4,  # 0-4
    12, 1, 2, 3, 4,  # 5-9
    13, 1, 2, 3, 5,  # 10-14
    14, 1, 2, 3, 6,  # 15-19
    15, 1, 2, 3, 7,  # 20-24
    16, 1, 2, 3,  # 25-28
]
# 1 2 3 is followed by 4 (twice, last at end 8), 5 (end 13), 6 (end 18), 7 (end 23); 16 1 2 3
# never occurred, so no copy: the follower vote decides.


def test_follower_mode_takes_the_most_frequent_follower_with_its_count():
    idx = index_of(FOLLOW_TOKS)
    assert idx.followers((1, 2, 3)) == [(4, 2, 8), (7, 1, 23), (6, 1, 18), (5, 1, 13)]
    assert idx.predict() == 4
    cands = ngram_fill(FOLLOW_TOKS, depth_limit=2, max_alts=0)
    # after 4 the context 1 2 3 4 matches (most recent end 9): copy mode reads on with 13
    assert rows(cands) == [(4, ANCHOR, FOLLOW, 2, "follow/2/0"), (13, 0, COPY, 4, "copy/4/1")]


def test_follower_ties_go_to_the_most_recent():
    cands = ngram_fill([7, 1, 2, 3, 4, 8, 1, 2, 3, 5, 9, 1, 2, 3], depth_limit=1, max_alts=0)
    assert rows(cands) == [(5, ANCHOR, FOLLOW, 1, "follow/1/0")]


def test_nothing_is_proposed_below_a_three_token_match():
    toks = [5, 1, 2, 6, 1, 2]  # 1 2 occurred, 6 1 2 did not
    idx = index_of(toks)
    assert idx.predict() is None
    assert ngram_fill(toks, depth_limit=8) == []
    assert ngram_fill([1, 2, 3], depth_limit=8) == []
    assert ngram_fill([], depth_limit=8) == []


def test_followers_are_counted_over_the_most_recent_max_scan_occurrences():
    toks = [1, 2, 3, 9] * (MAX_SCAN + 6) + [1, 2, 3, 8, 1, 2, 3]
    idx = index_of(toks)
    last = len(toks) - 5  # the end of the 1 2 3 before the 8
    assert idx.followers((1, 2, 3)) == [(9, MAX_SCAN - 1, last - 4), (8, 1, last)]
    assert idx.followers((4, 4, 4)) == [] and idx.followers(tuple(range(40))) == []


# ---- alternatives --------------------------------------------------------------------------


def test_alternatives_become_sibling_chains_capped_by_max_alts():
    two = ngram_fill(FOLLOW_TOKS, depth_limit=2, max_alts=2)
    assert rows(two) == [
        (4, ANCHOR, FOLLOW, 2, "follow/2/0"),
        (13, 0, COPY, 4, "copy/4/1"),
        # the shallowest alternatives first, most frequent then most recent: 7, then 6; each
        # reads on along its own occurrence (7 at 24 is followed by 16, 6 at 19 by 15)
        (7, ANCHOR, FOLLOW_ALT, 1, "follow-alt/1/0"),
        (16, 2, COPY, 4, "copy/4/1"),
        (6, ANCHOR, FOLLOW_ALT, 1, "follow-alt/1/0"),
        (15, 4, COPY, 4, "copy/4/1"),
    ]
    three = ngram_fill(FOLLOW_TOKS, depth_limit=2, max_alts=3)
    assert rows(three)[:6] == rows(two)
    assert rows(three)[6:] == [
        (5, ANCHOR, FOLLOW_ALT, 1, "follow-alt/1/0"),
        (14, 6, COPY, 4, "copy/4/1"),
    ]
    # with room for more, the depth-2 alternative: 1 2 3 4 was also followed by 12 (end 4)
    many = ngram_fill(FOLLOW_TOKS, depth_limit=2, max_alts=10)
    assert rows(many)[8:] == [(12, 0, COPY_ALT, 4, "copy-alt/4/1")]  # a sibling of 13
    assert len(ngram_fill(FOLLOW_TOKS, depth_limit=2, max_alts=0)) == 2


def test_an_alternative_equal_to_a_drafter_candidate_agrees_with_it_and_continues_below_it():
    cands = [tree.child_of([], ANCHOR, 9, PICK)]
    cands.append(tree.child_of(cands, ANCHOR, 7, SIBLING))
    fill(cands, index_of(FOLLOW_TOKS), depth_limit=2, max_alts=1)
    tree.check_topological(cands)
    pick, sib = cands[0], cands[1]
    assert pick.contradicted and not pick.agreed and pick.bucket == "follow/2/0"
    # contradicted by the main proposal 4 first, then agreed by the alternative: agreed wins
    assert sib.agreed and not sib.contradicted
    assert (sib.kind, sib.evidence, sib.bucket) == (FOLLOW_ALT, 1, "follow-alt/1/0")
    assert rows(cands[2:]) == [
        (4, ANCHOR, FOLLOW, 2, "follow/2/0"),
        (13, 2, COPY, 4, "copy/4/1"),
        (16, 1, COPY, 4, "copy/4/0"),  # below the sibling: no n-gram node above it
    ]


# ---- agreement, contradiction, chains from picks -------------------------------------------

#        0  1  2  3  4  5  6  7  8  9 10 11 12
AGREE_TOKS = [4, 5, 7, 8, 1, 2, 3, 4, 5, 1, 2, 3, 4]
# from the anchor: 1 2 3 4 (end 7) -> 5 1 2 3 4 5 ...; after 5 7: 4 5 7 -> 8, then copy 1 2 ...


class SpyIndex(SuffixIndex):
    """Records the context of every fresh chain step (a chain start or a follower step)."""

    def __init__(self):
        super().__init__()
        self.fresh: list[list[int]] = []

    def step(self, extra, p=-1, length=0, alts=False):
        if p < 0:
            self.fresh.append(list(extra))
        return super().step(extra, p, length, alts)


def drafter_block():
    """pick A=5 (anchor) | sibling 9 (anchor) | pick B=7 (A) | sibling 1 (A) | pick C=8 (B) |
    sibling 6 (B)"""
    cands: list = []
    for token, parent, source in [(5, ANCHOR, PICK), (9, ANCHOR, SIBLING), (7, 0, PICK),
                                  (1, 0, SIBLING), (8, 2, PICK), (6, 2, SIBLING)]:
        cands.append(tree.child_of(cands, parent, token, source))
    return cands


def test_agreed_and_contradicted_drafter_candidates_and_chains_from_picks():
    cands = drafter_block()
    idx = SpyIndex()
    idx.extend(AGREE_TOKS)
    fill(cands, idx, depth_limit=4)
    tree.check_topological(cands)
    a, s9, b, s1, c, s6 = cands[:6]
    # anchor chain: 5 agrees with pick A, contradicts sibling 9; below A it proposes 1, which
    # agrees with sibling 1 and contradicts pick B; then goes on below sibling 1
    assert a.agreed and (a.kind, a.evidence, a.bucket) == (COPY, 4, "copy/4/0")
    assert s9.contradicted and (s9.kind, s9.evidence, s9.bucket) == (COPY, 4, "copy/4/0")
    assert s1.agreed and (s1.kind, s1.evidence, s1.bucket) == (COPY, 5, "copy/5/0")
    assert b.contradicted and (b.kind, b.evidence, b.bucket) == (COPY, 5, "copy/5/0")
    # B was not reached, so it starts a chain: 4 5 7 -> 8 agrees with pick C, contradicts 6
    assert c.agreed and (c.kind, c.evidence, c.bucket) == (FOLLOW, 1, "follow/1/0")
    assert s6.contradicted and (s6.kind, s6.evidence, s6.bucket) == (FOLLOW, 1, "follow/1/0")
    assert not any(x.agreed and x.contradicted for x in cands)
    assert rows(cands[6:]) == [
        (2, 3, COPY, 6, "copy/5/0"),  # anchor chain below sibling 1 (depth 3)
        (3, 6, COPY, 7, "copy/5/1"),  # depth 4: the limit
        (1, 4, COPY, 4, "copy/4/0"),  # B's chain below C: 4 5 7 8 (end 3) -> 1
    ]
    # A was reached by the anchor chain, so it starts no chain of its own (the anchor chain
    # reaches it in copy mode, so no fresh step has the context [5]); B and C do start one
    assert [5] not in idx.fresh and [5, 7] in idx.fresh and [5, 7, 8] in idx.fresh


def test_a_pick_reached_by_a_pick_chain_starts_no_chain_either():
    # a pick chain from B agrees with C, so C starts no chain: the fill is the same as above
    cands = drafter_block()
    idx = SpyIndex()
    idx.extend(AGREE_TOKS)
    fill(cands, idx, depth_limit=4)
    starts = [e for e in idx.fresh if e == [5, 7, 8]]
    assert len(starts) == 1  # C's context is stepped once, by B's chain (a follower step)


def test_chains_respect_the_depth_limit():
    toks = [1, 2, 3, 4, 5, 1, 2, 3, 4]
    assert [c.depth for c in ngram_fill(toks, depth_limit=3)] == [1, 2, 3]
    assert ngram_fill(toks, depth_limit=0) == []
    # a pick at the limit starts no chain; the anchor chain still runs up to it
    cands = drafter_block()
    fill(cands, index_of(AGREE_TOKS), depth_limit=2)
    tree.check_topological(cands)
    assert [(c.token, c.depth) for c in cands[6:]] == []  # A, then sibling 1 at depth 2: agreed
    assert cands[0].agreed and cands[3].agreed
    assert not cands[4].agreed and not cands[4].contradicted  # C (depth 3) untouched


# ---- the index -----------------------------------------------------------------------------


def test_source_precision_on_a_hand_computed_sequence():
    idx = SuffixIndex()
    assert idx.p_src == 0.5
    # predictions: before the 2nd 3 (1 2 3 -> 4: follower, hit), before the 3rd 1 (1 2 3 4 -> 1:
    # copy, hit), before 9 (1 2 3 4 1 -> 2: copy, miss); before the rest nothing is proposed.
    idx.extend([1, 2, 3, 4, 1, 2, 3, 4, 1, 9])
    assert (idx.predictions, idx.hits) == (3, 2)
    assert idx.p_src == pytest.approx(3 / 5)


INDEX_STATE = ("tokens", "start", "_end_of", "_prev", "_match", "_match_end", "predictions", "hits")


def test_incremental_extend_equals_bulk():
    rng = random.Random(3)
    seq = [rng.randrange(4) for _ in range(300)] + [i % 7 for i in range(60)]
    a, b = SuffixIndex(), SuffixIndex()
    a.extend(seq)
    for t in seq:
        b.extend([t])
    assert all(getattr(a, s) == getattr(b, s) for s in INDEX_STATE)
    ca, cb = [], []
    fill(ca, a, 16)
    fill(cb, b, 16)
    assert ca and [c.to_dict() for c in ca] == [c.to_dict() for c in cb]


def test_a_kept_index_goes_on_into_the_next_prompt_exactly_as_a_fresh_one():
    rng = random.Random(5)
    turn = lambda n: [rng.randrange(6) for _ in range(n)]  # noqa: E731 (a small alphabet: grams recur)
    kept, slot, other = KeptIndexes(), object(), object()
    first = turn(120)
    src = NgramSource(1, kept=kept, slot=slot)
    src.begin(first)
    reply = turn(30)
    for k in range(0, 30, 4):  # committed round by round, as the scheduler does
        src.accept(reply[k : k + 4], [], [])
    src.end(reply)
    # The next turn's prompt goes on from the first request's text: the kept index is taken and
    # extended, and is what indexing the whole prompt gives, down to the fill.
    second = first + reply + turn(40)
    nxt = NgramSource(1, kept=kept, slot=slot)
    nxt.begin(second)
    assert nxt.index is src.index
    fresh = NgramSource(1)
    fresh.begin(second)
    assert all(getattr(nxt.index, f) == getattr(fresh.index, f) for f in INDEX_STATE)
    assert nxt.p_src == fresh.p_src
    a, b = [], []
    nxt.propose(a, 16)
    fresh.propose(b, 16)
    assert a and [c.to_dict() for c in a] == [c.to_dict() for c in b]
    # Another slot's request, or a prompt that does not go on from the kept text (an edited
    # history), indexes afresh; a kept index is taken once.
    nxt.end([])
    for s, prompt in ((other, second + [1]), (slot, [9] + second)):
        again = NgramSource(1, kept=kept, slot=s)
        again.begin(prompt)
        assert again.index is not nxt.index and again.index.tokens == prompt and again.index.start == len(prompt)
    assert kept.take(slot, second + [1]) is None


def test_index_agrees_with_a_naive_scan():
    rng = random.Random(7)
    for _ in range(20):
        toks = [rng.randrange(3) for _ in range(rng.randrange(1, 120))]
        idx = SuffixIndex(max_match=6)
        for t in toks:  # check the longest match after every token
            idx.extend([t])
            n = len(idx.tokens)
            naive = 0
            for k in range(1, min(6, n - 1) + 1):
                suffix = idx.tokens[n - k:]
                ends = [e for e in range(k - 1, n - 1) if idx.tokens[e - k + 1:e + 1] == suffix]
                if ends:
                    naive = k
                    assert idx._end_of[tuple(suffix)] == max(ends)
            assert idx.match()[1] == naive
        gram = tuple(toks[-3:])
        ends = [e for e in range(len(toks) - 2, 1, -1) if tuple(toks[e - 2:e + 1]) == gram]
        counts: dict = {}
        for e in ends[:MAX_SCAN]:
            counts.setdefault(toks[e + 1], [0, e])[0] += 1
        expect = sorted(((f, c, e) for f, (c, e) in counts.items()), key=lambda x: (-x[1], -x[2]))
        assert idx.followers(gram) == expect


def test_small_max_match_is_refused_and_the_match_is_capped():
    with pytest.raises(ValueError):
        SuffixIndex(max_match=COPY_MIN - 1)
    idx = index_of(list(range(10)) + list(range(10)), max_match=4)
    assert idx.match() == (9, 4)


# ---- property ------------------------------------------------------------------------------


def random_block(rng, vocab, depth):
    """A drafter block: a spine of picks, each position with a few distinct siblings."""
    cands: list = []
    parent = ANCHOR
    for _ in range(depth):
        tokens = rng.sample(range(vocab), rng.randrange(1, min(4, vocab) + 1))
        pick = len(cands)
        cands.append(tree.child_of(cands, parent, tokens[0], PICK))
        for t in tokens[1:]:
            cands.append(tree.child_of(cands, parent, t, SIBLING))
        parent = pick
    return cands


def test_property_random_texts_give_well_formed_trees():
    rng = random.Random(12345)
    for trial in range(300):
        vocab = rng.randrange(2, 7)
        toks = [rng.randrange(vocab) for _ in range(rng.randrange(0, 200))]
        idx = index_of(toks)
        depth_limit = rng.randrange(1, 14)
        max_alts = rng.randrange(0, 5)
        cands = random_block(rng, vocab, rng.randrange(0, depth_limit + 1)) if trial % 3 else []
        drafted = [(c.token, c.parent, c.source) for c in cands]
        fill(cands, idx, depth_limit, max_alts)

        tree.check_topological(cands)
        assert [(c.token, c.parent, c.source) for c in cands[:len(drafted)]] == drafted
        pairs = [(c.parent, c.token) for c in cands]
        assert len(pairs) == len(set(pairs))
        alts = 0
        for j, c in enumerate(cands):
            assert not (c.agreed and c.contradicted)
            if c.kind in (COPY_ALT, FOLLOW_ALT) and (c.source == NGRAM or c.agreed):
                alts += 1
            if c.source != NGRAM:
                continue
            assert c.depth <= depth_limit and j >= len(drafted)
            above, p = 0, c.parent
            while p != ANCHOR:
                above += cands[p].source == NGRAM
                p = cands[p].parent
            assert c.above == above
            assert c.bucket == bucket(c.kind, c.evidence, c.above)
            if c.kind in (COPY, COPY_ALT):
                assert c.evidence >= COPY_MIN
        assert alts <= max_alts
        # the anchor chain's first step is the source's own prediction
        first = idx.predict()
        at_anchor = {c.token: c for c in cands if c.parent == ANCHOR}
        if first is None:
            assert not any(c.source == NGRAM or c.agreed for c in at_anchor.values())
        else:
            hit = at_anchor[first]
            assert hit.source == NGRAM or hit.agreed


def test_a_copy_whose_match_reaches_into_the_prompt_is_a_copy_start_until_the_reply_repeats_itself():
    # The prompt ends as an earlier passage of it did (a chat template's tail does at every turn):
    # the copy that match proposes at the reply's start says only that the reply may begin as
    # the earlier text went on, so it has a kind, and buckets, of its own.
    src = NgramSource(max_alts=0)
    src.begin([50, 1, 2, 3, 4, 60, 61, 1, 2, 3, 4])
    cands = []
    src.propose(cands, depth_limit=4)
    assert [(c.token, c.kind) for c in cands] == [(60, COPY_START), (61, COPY_START), (1, COPY_START), (2, COPY_START)]
    assert cands[0].bucket.startswith("copy-start/")
    # Once the reply repeats a passage of its own, the match lies within the reply: a plain copy.
    src.accept([70, 71, 72, 73, 80, 70, 71, 72, 73], [], [])
    cands = []
    src.propose(cands, depth_limit=1)
    assert [(c.token, c.kind, c.evidence) for c in cands] == [(80, COPY, 4)]
