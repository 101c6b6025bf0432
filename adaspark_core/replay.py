"""Drive fresh learners from a round log (DESIGN.md: replay must reproduce the live state).

A learning arm's rounds are replayed in order: the adaptive width policy re-decides each round
from the record's own inputs (candidates, order, context) and learns from the record, exactly as
the live run did, so its final state equals the live one. A re-decided width that differs from
the logged one means the log and the learners disagree, and replay says so.
"""

from __future__ import annotations

from typing import Iterable

from .chooser import AdaptiveWidth
from .record import RoundRecord
from .scheduler import parse_arm


class ReplayMismatch(ValueError):
    pass


def replay_width_policy(records: Iterable[RoundRecord], policy: AdaptiveWidth | None = None,
                        check: bool = True) -> AdaptiveWidth:
    """Feed ``records`` of learning arms to ``policy`` (fresh by default) and return it."""
    policy = policy or AdaptiveWidth()
    for rec in records:
        arm = parse_arm(rec.arm)
        if not arm.learns:
            continue
        if arm.adaptive:
            max_rows = max(rec.offered) if rec.offered else 1
            dec = policy.decide(rec.candidates, rec.order, rec.context, policy.cost.d_now(), max_rows)
            width = min(dec.width, len(rec.candidates) + 1)
            if check and (width != rec.width or dec.measure != rec.measure):
                raise ReplayMismatch(f"request {rec.request} round {rec.round}: replay chose width {width}"
                                     f" (measuring {dec.measure}); the log has {rec.width} (measuring {rec.measure})")
        policy.learn(rec)
    return policy
