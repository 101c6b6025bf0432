from adaspark_core.ngram import SuffixIndex


def test_chain_continues_the_most_recent_longest_match():
    idx = SuffixIndex()
    #        0  1  2  3  4  5  6  7  8  9
    idx.extend([1, 2, 3, 4, 9, 2, 3, 5, 1, 2])
    idx.extend([3])  # suffix ... 1 2 3 matches positions 0..2 (length 3); 2 3 also at 5..6
    toks, k = idx.chain(4)
    assert k == 3 and toks == [4, 9, 2, 3]


def test_most_recent_occurrence_wins_among_equal_lengths():
    idx = SuffixIndex()
    idx.extend([7, 1, 7, 2, 7])
    toks, k = idx.chain(2)
    assert k == 1 and toks == [2, 7]


def test_no_match_and_the_current_suffix_never_matches_itself():
    idx = SuffixIndex()
    idx.extend([1, 2, 3])
    assert idx.chain(5) == ([], 0)
    idx.extend([4])
    assert idx.match() == (-1, 0)


def test_incremental_extend_equals_bulk():
    seq = [i % 7 for i in range(50)] + [3, 3, 3, 1, 2]
    a, b = SuffixIndex(max_match=5), SuffixIndex(max_match=5)
    a.extend(seq)
    for t in seq:
        b.extend([t])
    assert a._end_of == b._end_of and a.chain(10) == b.chain(10)


def test_match_length_is_capped():
    idx = SuffixIndex(max_match=4)
    idx.extend(list(range(10)) + list(range(10)))
    end, k = idx.match()
    assert k == 4 and end == 9
