"""The one-row account (adaspark_core/evaluate/onerow.py, ``make bench-onerow``): an arm's one-row
decodes paired with ar's by request and context, kept apart after a wider verify."""

from types import SimpleNamespace

import pytest

from adaspark_core.evaluate.onerow import MIN_PAIRS, one_row


def rnd(request, k, context, width, decode):
    return SimpleNamespace(request=request, round=k, context=context, width=width,
                           times=SimpleNamespace(decode=decode))


def plain(request, n, ms, start=100):
    return [rnd(request, k, start + k, 1, ms) for k in range(n)]


def test_pairs_are_by_request_and_context_and_a_wider_verify_is_kept_apart():
    ar = plain("a", 12, 10.0) + plain("b", 12, 20.0)
    arm = []
    for k, c in enumerate(range(100, 112)):  # reply a: one row at 11 ms, a 4-row round at 104
        arm.append(rnd("a", k, c, 4 if c == 104 else 1, 30.0 if c == 104 else 11.0))
    arm[5].times.decode = 13.0  # the round right after the wide one: the graph rebuild
    arm += plain("b", 12, 20.0)  # reply b: as ar
    got = one_row(ar, arm)
    # reply a's first round (after the prefill) is left out; its rounds after one row are 1.1x
    assert got.pairs == (11 - 2) + 11  # a: rounds 1-11 but the wide one and the one after it
    assert got.replies == 2 and got.reply_median == pytest.approx((1.1 + 1.0) / 2)
    assert got.after_wider == 1 and got.after_wider_median == pytest.approx(1.3)
    total = sum(r.times.decode for r in arm)
    assert got.rebuild_share == pytest.approx((13.0 - 10.0) / total)
    assert got.lo <= got.reply_median <= got.hi


def test_a_reply_with_few_pairs_counts_in_the_pooled_median_only():
    ar = plain("a", MIN_PAIRS, 10.0)
    arm = plain("a", MIN_PAIRS, 12.0)
    got = one_row(ar, arm)
    assert got.pairs == MIN_PAIRS - 1 and got.median == pytest.approx(1.2)
    assert got.replies == 0 and got.reply_median is None and got.lo is None


def test_rounds_ar_never_decoded_are_not_paired():
    ar = plain("a", 10, 10.0)
    got = one_row(ar, plain("b", 10, 10.0) + plain("a", 10, 10.0, start=500))
    assert got.pairs == 0 and got.median is None and got.after_wider == 0 and got.rebuild_share is None
