"""The draft depth (beyond the paper): how many positions a sequential draft model drafts a round.

The paper's DSpark drafter proposes its whole block in one forward, so its cost is one number, D.
A draft model (drafters.ModelDrafter) pays one forward per position, one after another: on a
2-core CPU a 0.5B draft costs half of a 1.5B target's verify row a position, on a GPU a tenth. So
whether the next position pays is a question of this machine and this pair, which no fixed
``--block`` (llama.cpp's ``--spec-draft-n-max``) answers. ``DraftDepth`` answers it each round,
before each forward, from what it learns online:

- ``first`` and ``next``: the time of a draft's first forward (the anchor, with the committed
  tokens the draft cache has not seen yet) and of each one after (one row), context laws as the
  verify classes' (cost.Law), learned from the forwards a round logs (``RoundRecord.drafting``);
- ``calibration``: how often a pick of confidence h is accepted, given its parent was, in ten h
  bins shrunk towards h (a draft model's h is its pick's probability, a fair guess before any
  round); ``lead`` and ``follow``: how often a round's first pick is, and a later one given its
  parent was, the guesses for positions not drafted yet.

Before each forward, ``go_on`` plans the rest of the draft: the positions drafted so far at their
calibrated q, each further one at the last pick's q (before any, the first at ``lead`` and the
rest at ``follow``), each position's
expected tokens against its forward and the verify it needs, valued by the chooser's own score (V
of Eq. 7 at the band's rate, or the per-round ratio before the band has one) at the cost model's
prices, an unmeasured width at the widest measured narrower width's (as the policy measures). It
drafts one more position when a deeper stop beats stopping now; the forwards already paid are
sunk. Zero positions is a depth: the round is then plain decoding, and the draft cache does not
even follow the text until the next draft (drafters.ModelDrafter). A learner that never drafts
learns nothing about the draft, so after ``probe`` rounds without one it drafts a position, and
waits twice as long before each next probe until a round drafts of its own accord.

Learns only from round records, so a log replays into the same state and the same depths (replay
checks each round's depth against the log).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from adaspark_core.base.checks import VERSION_FIELD, array, count, section
from adaspark_core.base.tree import ANCHOR, PICK
from adaspark_core.learn.cost import Law, LawParams
from adaspark_core.learn.online import Decayed

BINS = 10  # calibration bins over the pick's confidence h in [0, 1]


@dataclass
class DepthParams:
    half_life: float = 256.0  # picks, for each calibration bin
    lead_half_life: float = 16.0  # drafts, for the lead rate: it follows the request's text
    prior: float = 4.0  # pseudo-picks at the bin's h (the lead rate: at lead_prior)
    lead_prior: float = 0.7  # the first pick's acceptance before any was tried
    follow_prior: float = 0.8  # a later pick's, given its parent was accepted
    probe: int = 16  # rounds without a draft before one position is drafted to learn
    max_probe: int = 1024  # the longest wait between probes
    # A first forward that decodes more than this many rows (the prompt, or a long stretch the
    # draft cache did not follow) is a prefill, not the cost of a round's draft: not learned.
    first_rows: int = 16
    law: LawParams = field(default_factory=LawParams)


class DraftDepth:
    """The draft depth learner: forward-cost laws, pick calibration, probing; ``go_on`` decides."""

    VERSION = 1  # of its section (state)

    def __init__(self, params: DepthParams | None = None):
        self.p = params or DepthParams()
        self.first = Law(self.p.law)
        self.next = Law(self.p.law)
        self.calibration = [Decayed(self.p.half_life) for _ in range(BINS)]
        self.lead = Decayed(self.p.lead_half_life)
        self.follow = Decayed(self.p.lead_half_life)
        self.rounds = 0  # rounds a draft model could draft in
        self.idle = 0  # rounds since the last one that drafted
        self.probe_every = self.p.probe

    # --- deciding -------------------------------------------------------------------------------

    def q(self, h: float) -> float:
        """A pick's acceptance given its parent's, from its confidence h."""
        b = self.calibration[_bin(h)]
        return (b.x + self.p.prior * h) / (b.y + self.p.prior)

    def lead_q(self) -> float:
        return (self.lead.x + self.p.prior * self.p.lead_prior) / (self.lead.y + self.p.prior)

    def follow_q(self) -> float:
        return (self.follow.x + self.p.prior * self.p.follow_prior) / (self.follow.y + self.p.prior)

    def forward_ms(self, position: int, context: int) -> float:
        """The predicted time of the forward that drafts ``position`` (1: the first): 0 before
        any was measured, so a cold learner drafts and measures."""
        law = self.first if position == 1 else self.next
        return law.value(context) if law.samples else 0.0

    def go_on(self, hs: list[float], limit: int, context: int, ladder: dict[int, float], score) -> bool:
        """Whether to draft position ``len(hs) + 1`` of at most ``limit`` (the drafter's block
        within the round's depth limit), given the picks' h so far. ``ladder``: the widths the
        round may verify with their prices (``ladder_prices``; empty while no width is measured:
        a cold learner drafts nothing until plain decoding's price is known); ``score(prices,
        s)``: the chooser's score of each width given S (chooser.Chooser.scores at the round's D
        and context), higher is better."""
        i = len(hs)
        if i >= limit or not ladder:
            return False
        if i == 0 and self.idle >= self.probe_every:
            return True
        qs = [self.q(h) for h in hs]
        q_next = qs[-1] if qs else self.follow_q()
        best_depth, best = i, _value(qs, 0.0, ladder, score)
        future, spine = 0.0, list(qs)
        for d in range(i + 1, limit + 1):
            future += self.forward_ms(d, context)
            spine.append(self.lead_q() if d == 1 else q_next)
            v = _value(spine, future, ladder, score)
            if v > best:
                best_depth, best = d, v
        return best_depth > i

    @staticmethod
    def ladder_prices(widths: list[int], prices: dict[int, float], floor) -> dict[int, float]:
        """The widths of ``widths`` a draft may be planned for, with their prices: every measured
        one, and the narrowest unmeasured one above a measured one at ``floor(w)`` (the price the
        policy gives a width it may measure, CostModel.price_floor). One at a time: a draft
        planned for a wide width the chooser then does not measure (its candidates must also win
        there) would be drafted again and again for a verify that never comes."""
        ladder, measured, explored = {}, False, False
        for w in sorted(widths):
            if w in prices:
                ladder[w], measured = prices[w], True
            elif measured and not explored:
                ladder[w], explored = floor(w), True
        return ladder

    # --- learning -------------------------------------------------------------------------------

    def learn(self, rec) -> None:
        """Fold one round in: its forwards' times, its verified picks' outcomes, the probe clock."""
        dr = rec.drafting
        if dr is None or dr.limit == 0:  # no draft model, or no room to draft: no decision
            return
        self.rounds += 1
        forwards = dr.forwards
        if not forwards:
            self.idle += 1
            return
        # A probe (it drafted because the clock ran out) makes the next wait twice as long; a
        # round that drafted of its own accord starts the waits over (the state before this
        # round is the decision's).
        if self.idle >= self.probe_every:
            self.probe_every = min(2 * self.probe_every, self.p.max_probe)
        else:
            self.probe_every = self.p.probe
        self.idle = 0
        if dr.rows <= self.p.first_rows:
            self.first.observe(rec.context, forwards[0])
        for ms in forwards[1:]:
            self.next.observe(rec.context, ms)
        # A pick whose parent was verified and accepted has an outcome whether or not it was
        # verified itself: it is right iff it is the target's token on its parent's row. (Learned
        # from verified picks alone, a learner that drafts a pick the chooser then leaves out
        # would never see that it should not have drafted it.)
        row_of = {j: r for r, j in enumerate(rec.rows)}
        accepted = {ANCHOR, *rec.path}
        for c in rec.candidates:
            parent = c["parent"]
            if c["source"] != PICK or parent not in accepted or parent not in row_of:
                continue  # not a pick, or its parent was rejected or not verified: never tried
            truth = rec.argmax[row_of[parent]]
            if truth < 0:
                continue  # a sampled verify that never drew that row
            hit = 1.0 if c["token"] == truth else 0.0
            self.calibration[_bin(c["h"])].add(hit, 1.0)
            (self.lead if parent == ANCHOR else self.follow).add(hit, 1.0)
        if rec.last:
            self.first.refit()
            self.next.refit()

    # --- the store ------------------------------------------------------------------------------

    def state(self) -> dict:
        return {VERSION_FIELD: self.VERSION, "first": self.first.state(), "next": self.next.state(),
                "calibration": [b.state() for b in self.calibration], "lead": self.lead.state(),
                "follow": self.follow.state(),
                "rounds": self.rounds, "idle": self.idle, "probe_every": self.probe_every}

    @classmethod
    def from_state(cls, st: dict, params: DepthParams | None = None, path: str = "depth") -> "DraftDepth":
        """Restore a ``state()``, checked (checks.py)."""
        section(st, path, cls.VERSION, ("first", "next", "calibration", "lead", "follow", "rounds", "idle",
                                        "probe_every"))
        dd = cls(params)
        dd.first.load(st["first"], f"{path}.first")
        dd.next.load(st["next"], f"{path}.next")
        bins = array(st["calibration"], f"{path}.calibration", length=BINS)
        dd.calibration = [Decayed(dd.p.half_life).load(b, f"{path}.calibration.{i}") for i, b in enumerate(bins)]
        dd.lead = Decayed(dd.p.lead_half_life).load(st["lead"], f"{path}.lead")
        dd.follow = Decayed(dd.p.lead_half_life).load(st["follow"], f"{path}.follow")
        dd.rounds = count(st["rounds"], f"{path}.rounds")
        dd.idle = count(st["idle"], f"{path}.idle", 0, dd.rounds)
        dd.probe_every = count(st["probe_every"], f"{path}.probe_every", 1)
        return dd


def _bin(h: float | None) -> int:
    h = 0.5 if h is None or math.isnan(h) else min(max(h, 0.0), 1.0)
    return min(int(h * BINS), BINS - 1)


def _value(spine: list[float], future_ms: float, ladder: dict[int, float], score) -> float:
    """The best score over the ``ladder`` widths (their prices) of a draft whose picks have the
    q of ``spine``, with ``future_ms`` of forwards still to pay added to every price. A width wider
    than the draft verifies all of it (chooser.at)."""
    s, p = [0.0], 1.0
    for q in spine:
        p *= q
        s.append(s[-1] + p)
    return max(score({w: t + future_ms for w, t in ladder.items()}, s).values())
