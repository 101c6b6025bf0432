"""Is width 1 plain decoding? A speculating arm's one-row rounds against ``ar``'s, from the round
logs of one ``compare`` run (``make bench-onerow``).

A one-row round is paired with ar's round of the same request at the same context (committed
tokens): the same position of the same reply, decoded minutes apart in the same run, so neither
the context length nor the reply's mix of positions can tell them apart (unpaired medians by
context band do both: an arm's one-row rounds are the positions where it found nothing to bet
on). Paired rounds of one reply share the machine's state while it ran, so the interval is a
bootstrap over replies. Two kinds of round are kept apart:

- after a one-row round: the same graph as the round before (llama.cpp reuses its compute graph
  while the batch keeps its shape), so any difference is ours: the context's state, host work;
- right after a wider verify: llama.cpp rebuilds the graph for the one-row batch, a cost that
  plain decoding never pays; its share of the arm's decode time is what it costs a run."""

from __future__ import annotations

import random
import statistics
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from adaspark_core.store.record import RoundRecord

MIN_PAIRS = 5  # a reply's paired rounds before its median counts


@dataclass(frozen=True)
class OneRow:
    """An arm's one-row decodes over ar's at the same request and context (llama_decode time)."""

    pairs: int  # after a one-row round
    median: float | None  # of every pair's ratio
    replies: int  # replies with at least MIN_PAIRS pairs
    reply_median: float | None  # median over those replies of each one's median ratio
    lo: float | None  # 95% bootstrap interval of ``reply_median`` over replies
    hi: float | None
    after_wider: int  # pairs right after a wider verify
    after_wider_median: float | None
    rebuild_share: float | None  # what those rounds cost beyond ar's, over the arm's decode time


def one_row(ar: Iterable[RoundRecord], arm: Iterable[RoundRecord], resamples: int = 2000, seed: int = 0) -> OneRow:
    """``arm``'s one-row rounds paired with ``ar``'s (module doc). A request's first round, which
    follows the prefill, is left out."""
    base = {(r.request, r.context): r.times.decode for r in ar if r.round > 0}
    per_reply: dict[str, list[float]] = defaultdict(list)
    after_wider: list[float] = []
    extra_ms = decode_ms = 0.0
    prev: RoundRecord | None = None
    for r in arm:
        decode_ms += r.times.decode
        same = prev is not None and prev.request == r.request
        theirs = base.get((r.request, r.context))
        if r.width == 1 and same and theirs:
            if prev.width == 1:
                per_reply[r.request].append(r.times.decode / theirs)
            else:
                after_wider.append(r.times.decode / theirs)
                extra_ms += r.times.decode - theirs
        prev = r
    ratios = [x for xs in per_reply.values() for x in xs]
    medians = [statistics.median(xs) for xs in per_reply.values() if len(xs) >= MIN_PAIRS]
    lo = hi = None
    if medians:
        rng = random.Random(seed)
        boots = sorted(statistics.median(rng.choices(medians, k=len(medians))) for _ in range(resamples))
        lo, hi = boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]
    return OneRow(len(ratios), statistics.median(ratios) if ratios else None, len(medians),
                  statistics.median(medians) if medians else None, lo, hi, len(after_wider),
                  statistics.median(after_wider) if after_wider else None,
                  extra_ms / decode_ms if after_wider and decode_ms else None)
