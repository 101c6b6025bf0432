"""One round of Algorithm 1 as pure functions, engine-agnostic: price the candidates and order them
best first, choose the width (``decide_round``: the live round, the batched step and replay all
decide through it), a draft model's depth rule (``draft_rule``), where a reply stops
(``stop_cut``) and a sampled verify's draws (``Draws``). ``decode/generation.py`` drives them."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from adaspark_core.base import tree
from adaspark_core.base.decision import WidthDecision
from adaspark_core.base.sampling import Sampling, draw
from adaspark_core.base.tree import head_q
from adaspark_core.decode.arms import Arm
from adaspark_core.learn.acceptance import HEAD
from adaspark_core.learn.depth import DraftDepth
from adaspark_core.learn.learned import Learners

STOP, LENGTH, CONTEXT = "stop", "length", "context"
INTERRUPTED = "interrupted"  # ended by its consumer: a stop string's cut, a client gone, a signal


@dataclass(slots=True)
class RoundDecision:
    """What a round decided before its verify: which estimate priced the candidates (None: there
    were none), their order best first, and its width (``choice``)."""

    priced: str | None
    order: list[int]
    choice: WidthDecision

    @property
    def chosen(self) -> list[int]:
        """The candidates verified: the first width - 1 of the order (a tree, Proposition 1)."""
        return tree.prefix(self.order, self.choice.width)


def decide_round(cands: list[dict], context: int, p_src: float | None, arm: Arm, max_rows: int,
                 learners: Learners | None, constrained: bool = False) -> RoundDecision:
    """One round's decisions before its verify (Algorithm 1): price every candidate (sets its
    ``q``), order them best first (Proposition 1), and choose the width, the arm's or, for an
    adaptive arm, the width policy's, at most ``max_rows``. ``cands``: the round record's
    candidate dicts. The live round and replay both decide through here, so a replayed log
    drives the learners exactly as the run did.

    With learners, the acceptance model prices (the fitted model only where the arm allows it);
    without, the head-based estimate with no offset. ``p_src`` None (no n-gram source): 0.5.
    ``constrained``: the round decodes under a grammar (its FORCED candidates are certain)."""
    priced, order, big_q = price_round(cands, context, p_src, arm, learners, constrained)
    if arm.adaptive:
        policy = learners.policy
        dec = policy.decide(cands, order, context, policy.cost.d_now(), max_rows, big_q)
    else:
        dec = WidthDecision.unpriced(min(arm.max_width, max_rows), [arm.max_width])
    return RoundDecision(priced, order, fitted_to(dec, len(cands)))


def fitted_to(dec: WidthDecision, n_cands: int) -> WidthDecision:
    """``dec`` with a width the round's candidates can fill: a tree with fewer candidates comes
    out narrower."""
    return dec if dec.width <= n_cands + 1 else dataclasses.replace(dec, width=n_cands + 1)


def price_round(cands: list[dict], context: int, p_src: float | None, arm: Arm,
                learners: Learners | None, constrained: bool = False) -> tuple[str | None, list[int], list[float]]:
    """Price every candidate (sets its ``q``) and order them best first: (which estimate priced,
    the order, the path products Q). The first half of ``decide_round``; a batched step
    (decode/batch.py) prices each request so and chooses the widths of all together."""
    priced = None
    if cands:
        p_src = 0.5 if p_src is None else p_src
        if learners is not None:
            est = learners.acceptance.estimate(cands, context, p_src, fitted_allowed=arm.fitted, constrained=constrained)
            qs, priced = est.q, est.priced
        else:
            qs, priced = [head_q(c, p_src) for c in cands], HEAD
        for c, q in zip(cands, qs):
            c["q"] = q
    big_q = tree.products([c["parent"] for c in cands], [c["q"] for c in cands])
    return priced, tree.best_first(big_q), big_q


def draft_rule(learners: Learners, context: int, max_rows: int):
    """An adaptive round's depth rule for a draft model (``go_on(hs, limit)``, learn/depth.py):
    the depth learner's, at the cost model's prices of the widths within ``max_rows`` and the
    chooser's score at the round's D and ``context``, time charged at no less than plain
    decoding's rate (Chooser.charged_rate; here the forwards are in the prices, so plain decoding's
    rate is given apart). The live round and replay both build it here, before the round decides."""
    policy = learners.policy
    cost = policy.cost
    ladder = DraftDepth.ladder_prices([w for w in cost.widths if w <= max_rows], cost.prices(context),
                                      lambda w: cost.price_floor(w, context))
    d_ms = cost.d_now()
    plain = 1.0 / (d_ms + ladder[1]) if 1 in ladder else 0.0

    def score(prices: dict[int, float], s: list[float]) -> dict[int, float]:
        return policy.chooser.scores(prices, s, d_ms, context, rho_floor=plain)[0]

    return functools.partial(learners.depth.go_on, context=context, ladder=ladder, score=score)


def stop_cut(accepted: list[int], is_eog: Callable[[int], bool], budget: int) -> tuple[int, str | None]:
    """How many of a round's accepted tokens to commit, and the finish reason if the reply ends.

    The reply ends at the first end-of-generation token (committed, not emitted) or when the
    token budget runs out."""
    for i, t in enumerate(accepted):
        if i >= budget:
            return i, LENGTH
        if is_eog(t):
            return i + 1, STOP
    if len(accepted) >= budget:
        return len(accepted), LENGTH
    return len(accepted), None


class Draws:
    """A sampled verify's token per row, drawn when first read (sampling.draw at the row's
    position); ``as_list`` gives -1 for the rows never read."""

    def __init__(self, logits, sampling: Sampling, seed: int, pos0: int, depth: list[int]):
        self.logits, self.sampling, self.seed, self.pos0, self.depth = logits, sampling, seed, pos0, depth
        self._got: dict[int, int] = {}

    def __getitem__(self, row: int) -> int:
        t = self._got.get(row)
        if t is None:
            t = self._got[row] = draw(self.logits[row], self.sampling, self.seed, self.pos0 + self.depth[row])
        return t

    def as_list(self) -> list[int]:
        return [self._got.get(r, -1) for r in range(len(self.depth))]
