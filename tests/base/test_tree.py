import random

import pytest

from adaspark_core.base import tree
from adaspark_core.base.tree import ANCHOR, NGRAM, PICK, SIBLING, Candidate


def make(specs):
    """specs: (token, parent, source, q) in index order."""
    cands = []
    for tok, parent, src, q in specs:
        c = tree.child_of(cands, parent, tok, src)
        c.q = q
        cands.append(c)
    return cands


def random_tree(rng, n):
    specs = []
    for j in range(n):
        parent = rng.choice([ANCHOR] + list(range(j)))
        specs.append((rng.randrange(100), parent, rng.choice([PICK, SIBLING, NGRAM]), rng.choice([0.0, 0.25, 0.5, 0.5, 1.0, rng.random()])))
    return make(specs)


def test_path_products_multiply_along_the_path():
    cands = make([(1, ANCHOR, PICK, 0.5), (2, 0, PICK, 0.4), (3, ANCHOR, SIBLING, 0.2), (4, 1, NGRAM, 0.5)])
    assert tree.path_products(cands) == pytest.approx([0.5, 0.2, 0.2, 0.1])


def test_best_first_breaks_ties_toward_the_lower_index():
    cands = make([(1, ANCHOR, PICK, 0.5), (2, ANCHOR, SIBLING, 0.5), (3, 0, PICK, 1.0), (4, 1, NGRAM, 1.0)])
    # Q = .5 .5 .5 .5: all tied, so index order; parents still precede children.
    assert tree.best_first(tree.path_products(cands)) == [0, 1, 2, 3]


@pytest.mark.parametrize("seed", range(30))
def test_every_prefix_is_a_tree_with_maximal_expected_tokens(seed):
    rng = random.Random(seed)
    cands = random_tree(rng, rng.randrange(1, 12))
    big_q = tree.path_products(cands)
    order = tree.best_first(big_q)
    for width in range(1, len(cands) + 2):
        chosen = tree.prefix(order, width)
        assert set(chosen) >= {cands[j].parent for j in chosen} - {ANCHOR}
        tree.layout(7, cands, chosen)  # raises if not a tree
        # Proposition 1: no set of width-1 candidates has a larger sum (trees included).
        best_any = sum(sorted(big_q, reverse=True)[: width - 1])
        assert sum(big_q[j] for j in chosen) == pytest.approx(best_any)


def test_layout_is_depth_first_with_contiguous_leaf_ranges():
    # anchor -> a(0) -> b(1) -> c(3); anchor -> d(2); a -> e(4)
    cands = make([(10, ANCHOR, PICK, .9), (11, 0, PICK, .9), (12, ANCHOR, SIBLING, .1), (13, 1, PICK, .9), (14, 0, SIBLING, .05)])
    lay = tree.layout(99, cands, [0, 1, 3, 2, 4])
    assert lay.token == [99, 10, 11, 13, 14, 12]
    assert lay.cand == [ANCHOR, 0, 1, 3, 4, 2]
    assert lay.parent_row == [-1, 0, 1, 2, 1, 0]
    assert lay.depth == [0, 1, 2, 3, 2, 1]
    assert lay.n_leaves == 3 and not lay.is_chain
    # leaves: row 3 -> 1, row 4 -> 2, row 5 -> 3; internal rows cover their leaves.
    assert [(lay.seq_lo[r], lay.seq_hi[r]) for r in range(6)] == [(1, 3), (1, 2), (1, 1), (1, 1), (2, 2), (3, 3)]


@pytest.mark.parametrize("seed", range(20))
def test_a_rows_sequence_set_is_exactly_the_leaves_below_it(seed):
    rng = random.Random(100 + seed)
    cands = random_tree(rng, rng.randrange(1, 15))
    lay = tree.layout(0, cands, list(range(len(cands))))
    for r in range(lay.width):
        below = set()
        stack = [r]
        while stack:
            x = stack.pop()
            if not lay.children[x]:
                below.add(lay.seq_lo[x])
            stack += lay.children[x]
        assert set(range(lay.seq_lo[r], lay.seq_hi[r] + 1)) == below
        # depth-first: a row's parent comes before it, positions never decrease along a sequence
        assert lay.parent_row[r] < r


def test_layout_rejects_an_orphan():
    cands = make([(1, ANCHOR, PICK, .5), (2, 0, PICK, .5)])
    with pytest.raises(ValueError):
        tree.layout(0, cands, [1])


def test_width_one_is_the_anchor_alone():
    cands = make([(10, ANCHOR, PICK, .9), (11, 0, PICK, .9)])
    for lay in (tree.layout(5, [], []), tree.layout(5, cands, [])):  # proposed but none verified
        assert lay.width == 1 and lay.is_chain and lay.n_leaves == 0
        # Row 0 is the anchor on sequence 0 alone, at depth 0, with no parent and no children.
        assert (lay.cand, lay.token, lay.parent_row, lay.depth) == ([ANCHOR], [5], [-1], [0])
        assert (lay.children, lay.seq_lo, lay.seq_hi) == ([[]], [0], [0])
        assert tree.accept_walk(lay, [42]) == ([], 42)


def test_accept_walk_follows_the_argmax_and_returns_the_bonus():
    cands = make([(10, ANCHOR, PICK, .9), (11, 0, PICK, .9), (12, ANCHOR, SIBLING, .1), (13, 1, PICK, .9)])
    lay = tree.layout(99, cands, [0, 1, 2, 3])  # rows: 99, 10, 11, 13, 12
    # argmax at anchor = 10 (row 1), at row 1 = 11 (row 2), at row 2 = 77 (no child 77)
    path, bonus = tree.accept_walk(lay, [10, 11, 77, 5, 6])
    assert path == [1, 2] and bonus == 77
    # a sibling accepted: argmax at anchor is 12
    path, bonus = tree.accept_walk(lay, [12, 0, 0, 0, 33])
    assert path == [4] and bonus == 33


def test_check_topological():
    tree.check_topological(make([(1, ANCHOR, PICK, .5), (2, 0, PICK, .5)]))
    with pytest.raises(ValueError):
        tree.check_topological([Candidate(1, 1, PICK, 1), Candidate(2, ANCHOR, PICK, 1)])


def test_cut_below_ends_drops_what_hangs_below_an_end_token_and_reindexes_parents():
    end = 99
    # 0: 1 <- anchor; 1: end <- 0; 2: 3 <- 1 (below the end); 3: 4 <- 0; 4: 5 <- 2 (below it too);
    # 5: 6 <- 3; 6: end <- anchor, 7: 8 <- 6 (below the second end)
    cands = make([(1, ANCHOR, PICK, 0.5), (end, 0, NGRAM, 0.5), (3, 1, NGRAM, 0.5), (4, 0, SIBLING, 0.5),
                  (5, 2, NGRAM, 0.5), (6, 3, NGRAM, 0.5), (end, ANCHOR, SIBLING, 0.2), (8, 6, NGRAM, 0.5)])
    kept = tree.cut_below_ends(cands, lambda t: t == end)
    assert [(c.token, c.parent) for c in kept] == [(1, ANCHOR), (end, 0), (4, 0), (6, 2), (end, ANCHOR)]
    tree.check_topological(kept)


def test_cut_below_ends_keeps_a_tree_without_end_tokens_as_it_is():
    cands = make([(1, ANCHOR, PICK, 0.5), (2, 0, NGRAM, 0.5)])
    assert tree.cut_below_ends(cands, lambda t: t == 99) is cands
