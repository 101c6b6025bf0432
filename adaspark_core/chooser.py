"""The width chooser (paper section 3.4, Eq. 7) and the adaptive width policy.

For each offered width n the chooser weighs the round's expected tokens against its expected time:

    V(n) = 1 + S(n0) + g_d dS_d(n) + g_n dS_ng(n) - rho_m (D + T(n, c))

with n0 = 8, dS the expected tokens the drafter's and the n-gram's nodes add above n0 (negative
below it, priced with a second pair of gains), and rho_m the long-run decode rate of the round's
context band. Until a band has 8 rounds it maximises the per-round ratio (1 + S(n)) / (D + T(n)).
It keeps its incumbent unless another width beats it by a margin.

``AdaptiveWidth`` joins the cost model and the chooser into what a round asks: which width to
verify, given the round's candidates; and what to learn from the round's record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost import CostModel, band_of
from .online import Decayed
from .tree import NGRAM, hindsight_path, products


class GainLine:
    """g(c) = a + b u (u = c / unit), the realised marginal tokens over the predicted, by ridge
    least squares shrunk toward g = 1 (weight 0.02 x each regressor's sum of squares), clamped."""

    def __init__(self, ridge: float = 0.02, clamp: tuple[float, float] = (0.25, 4.0), unit: float = 8192.0):
        self.ridge, self.clamp, self.unit = ridge, clamp, unit
        self.sxx = [0.0, 0.0, 0.0]  # sums of x1 x1, x1 x2, x2 x2 with x = (p, p u)
        self.sxy = [0.0, 0.0]
        self.n = 0
        self._coef: tuple[float, float] | None = (1.0, 0.0)

    def add(self, predicted: float, realised: float, c: int) -> None:
        u = c / self.unit
        x1, x2 = predicted, predicted * u
        self.sxx[0] += x1 * x1
        self.sxx[1] += x1 * x2
        self.sxx[2] += x2 * x2
        self.sxy[0] += x1 * realised
        self.sxy[1] += x2 * realised
        self.n += 1
        self._coef = None

    def coef(self) -> tuple[float, float]:
        if self._coef is None:
            l1, l2 = self.ridge * self.sxx[0], self.ridge * self.sxx[2]
            a11, a12, a22 = self.sxx[0] + l1, self.sxx[1], self.sxx[2] + l2
            b1, b2 = self.sxy[0] + l1 * 1.0, self.sxy[1]  # prior (1, 0)
            det = a11 * a22 - a12 * a12
            if det <= 1e-12 * max(a11 * a22, 1e-300):
                self._coef = (b1 / a11, 0.0) if a11 > 0 else (1.0, 0.0)
            else:
                self._coef = ((b1 * a22 - a12 * b2) / det, (a11 * b2 - a12 * b1) / det)
        return self._coef

    def __call__(self, c: int) -> float:
        a, b = self.coef()
        lo, hi = self.clamp
        return min(max(a + b * c / self.unit, lo), hi)

    def state(self) -> dict:
        return {"sxx": self.sxx, "sxy": self.sxy, "n": self.n}

    def load(self, st: dict) -> "GainLine":
        self.sxx, self.sxy, self.n = [float(v) for v in st["sxx"]], [float(v) for v in st["sxy"]], int(st["n"])
        self._coef = None if self.n else (1.0, 0.0)
        return self


@dataclass
class ChooserParams:
    n0: int = 8
    half_life: float = 64.0  # rounds, for the band rates
    band_min_rounds: int = 8
    margin: float = 0.04  # of the incumbent's expected tokens
    ratio_margin: float = 0.04  # before the band's rate is known
    hold_before_split: int = 8


def source_sums(cands: list[dict], order: list[int], big_q: list[float] | None = None
                ) -> tuple[list[float], list[float]]:
    """S_d(n) and S_ng(n) for n = 1 .. len(order) + 1 (index n - 1): the expected accepted
    candidates of the drafter's nodes and of the n-gram's nodes in the first n - 1 of the order.
    ``big_q``: the candidates' path products, when the caller has them."""
    if big_q is None:
        big_q = products([c["parent"] for c in cands], [c["q"] for c in cands])
    sd, sn = [0.0], [0.0]
    for j in order:
        ng = cands[j]["source"] == NGRAM
        sd.append(sd[-1] + (0.0 if ng else big_q[j]))
        sn.append(sn[-1] + (big_q[j] if ng else 0.0))
    return sd, sn


def accepted_sums(cands: list[dict], order: list[int], path: list[int]) -> tuple[list[int], list[int]]:
    """Realised accepted candidates of each source within the first n - 1 of the order, for every
    n: by Proposition 1 every prefix is a tree, and by width invariance (paper 3.5) its accepted
    path is the longest start of the round's path that lies inside it."""
    rank = {j: i for i, j in enumerate(order)}
    ad, an = [0] * (len(order) + 1), [0] * (len(order) + 1)
    reach = 0  # the shortest prefix (in candidates) holding the path so far
    for j in path:
        reach = max(reach, rank[j] + 1)
        (an if cands[j]["source"] == NGRAM else ad)[reach] += 1  # counts from width reach + 1 on
    for arr in (ad, an):
        for i in range(1, len(arr)):
            arr[i] += arr[i - 1]
    return ad, an


def at(xs: list, n: int):
    """xs[n - 1], or the last value when the tree has fewer candidates than n - 1."""
    return xs[min(n, len(xs)) - 1]


class Chooser:
    """Eq. 7 with band rates, gains and hysteresis (paper 3.4)."""

    def __init__(self, params: ChooserParams | None = None):
        self.p = params or ChooserParams()
        self.bands: dict[int, Decayed] = {}
        self.gains = {k: GainLine() for k in ("d_hi", "n_hi", "d_lo", "n_lo")}
        self.incumbent: int | None = None
        self.held = 0  # rounds the incumbent has been held
        # Rounds of the current request waiting for their continuation (learn), and the tokens
        # committed since the oldest of them. Not stored: a request ends before the store is saved.
        self._pending: list[tuple] = []
        self._committed: list[int] = []

    def rate(self, c: int) -> float | None:
        b = self.bands.get(band_of(c))
        return b.ratio if b is not None and b.count >= self.p.band_min_rounds else None

    def value(self, n: int, sd, sn, price: float, d: float, c: int, rho: float, gains=None) -> float:
        """V(n) of Eq. 7. ``gains``: the four gains at c, when the caller already has them."""
        n0 = self.p.n0
        g = gains or self.gains_at(c)
        gd, gn = (g["d_hi"], g["n_hi"]) if n >= n0 else (g["d_lo"], g["n_lo"])
        sd0, sn0 = at(sd, n0), at(sn, n0)
        return 1.0 + sd0 + sn0 + gd * (at(sd, n) - sd0) + gn * (at(sn, n) - sn0) - rho * (d + price)

    def gains_at(self, c: int) -> dict[str, float]:
        return {k: g(c) for k, g in self.gains.items()}

    def scores(self, prices: dict[int, float], sd, sn, d: float, c: int) -> tuple[dict[int, float], bool]:
        """Each priced width's score, and whether it is Eq. 7's value (else, until the band's
        rate is known, the per-round ratio (1 + S(n)) / (D + T(n)))."""
        rho = self.rate(c)
        if rho is None:
            return {n: (1.0 + at(sd, n) + at(sn, n)) / (d + t) for n, t in prices.items()}, False
        g = self.gains_at(c)
        return {n: self.value(n, sd, sn, t, d, c, rho, g) for n, t in prices.items()}, True

    def choose(self, prices: dict[int, float], sd, sn, d: float, c: int) -> int:
        """The width to verify among the priced widths."""
        widths = list(prices)
        if self.incumbent not in prices:
            self.incumbent = widths[-1]  # the first incumbent is the widest offered width
            self.held = 0
        inc = self.incumbent
        vals, is_value = self.scores(prices, sd, sn, d, c)
        best = max(widths, key=vals.__getitem__)
        if is_value:
            switch = vals[best] > vals[inc] + self.p.margin * (1.0 + at(sd, inc) + at(sn, inc))
        else:
            switch = vals[best] > (1.0 + self.p.ratio_margin) * vals[inc]
        # A wider width priced no higher than the incumbent dominates it (Proposition 2: with
        # gains >= 0 its value is at least the incumbent's), so the margin, which guards trades of
        # tokens against time from flipping on noise, does not hold it back.
        dominant = [n for n in widths if n > inc and prices[n] <= prices[inc]]
        if dominant and not (switch and best != inc):
            best, switch = dominant[-1], True
        if switch and best != inc:
            self.incumbent, self.held = best, 0
        else:
            self.held += 1
        return self.incumbent

    def split_test(self, prices: dict[int, float], cost_price, sd, sn, d: float, c: int):
        """passes(a, b): could a width inside (a, b) beat the incumbent? A width inside costs at
        least T(a) and accepts at most what b - 1 rows accept."""
        rho = self.rate(c)
        inc = self.incumbent

        def passes(a: int, b: int) -> bool:
            ta = cost_price(a)
            if rho is None:
                inside = (1.0 + at(sd, b - 1) + at(sn, b - 1)) / (d + ta)
                here = (1.0 + at(sd, inc) + at(sn, inc)) / (d + prices[inc])
                return inside > (1.0 + self.p.ratio_margin) * here
            inside = self.value(b - 1, sd, sn, ta, d, c, rho)
            here = self.value(inc, sd, sn, prices[inc], d, c, rho)
            return inside > here + self.p.margin * (1.0 + at(sd, inc) + at(sn, inc))

        return passes

    def learn(self, rec, offered: list[int], sums=None) -> None:
        """Band rate from the round's committed tokens and time; gains from what every prefix of
        its order accepted, in hindsight. ``sums``: the round's source_sums, when the caller
        already has them.

        Beyond the paper, which learns the gains only from the prefixes of the verified tree (so
        the upper pair only from rounds wider than n0), a round waits until the tokens committed
        after its anchor cover its deepest candidate (or its request ends): under greedy decoding
        they are the target's own continuation, so they say which candidates of every prefix,
        verified or not, would have been accepted (Proposition 1 and width invariance, 3.5). Every
        round with candidates then teaches both pairs. On a CPU most rounds run one row, and once
        the cold start stopped running every width (``AdaptiveWidth._worth_measuring``), a
        chooser that learned only from its own wide rounds kept its prior gains for long.
        (Simulated Gemma 3 CPU curve, rate over the best pinned width, seeds 0-2: 1.000, 0.978,
        0.972 learning from verified rows only; 1.000, 0.978, 1.007 in hindsight.)"""
        committed = len(rec.path) + 1
        self.bands.setdefault(band_of(rec.context), Decayed(self.p.half_life)).add(committed, rec.times.total)
        if self._pending and self._pending[0][0].request != rec.request:
            self._resolve(everything=True)  # a request that ended without its last round
        if rec.candidates:
            sd, sn = sums or source_sums(rec.candidates, rec.order)
            depth = max(c["depth"] for c in rec.candidates)
            self._pending.append((rec, sd, sn, list(offered), len(self._committed), depth))
        if self._pending:
            self._committed += [rec.candidates[j]["token"] for j in rec.path] + [rec.bonus]
        self._resolve(everything=rec.last)

    def _resolve(self, everything: bool) -> None:
        """Learn the gains of the waiting rounds whose continuation is known (all of them when the
        request ends), oldest first."""
        done = 0
        for rec, sd, sn, offered, start, depth in self._pending:
            cont = self._committed[start:]
            if len(cont) <= depth and not everything:
                break
            path = hindsight_path(rec.candidates, cont)
            ad, an = accepted_sums(rec.candidates, rec.order, path)
            n0, c = self.p.n0, rec.context
            top, low = (max(offered), min(offered)) if offered else (1, 1)
            if top > n0:  # rows above n0 teach the upper pair
                self._gain("d_hi", at(sd, top) - at(sd, n0), at(ad, top) - at(ad, n0), c)
                self._gain("n_hi", at(sn, top) - at(sn, n0), at(an, top) - at(an, n0), c)
            m = min(top, n0)
            if m > low:  # rows between the narrowest offered width and n0: the lower pair
                self._gain("d_lo", at(sd, m) - at(sd, low), at(ad, m) - at(ad, low), c)
                self._gain("n_lo", at(sn, m) - at(sn, low), at(an, m) - at(an, low), c)
            done += 1
        del self._pending[:done]
        if not self._pending:
            self._committed = []

    def _gain(self, key: str, predicted: float, realised: float, c: int) -> None:
        if predicted > 1e-9:
            self.gains[key].add(predicted, realised, c)

    def state(self) -> dict:
        return {"bands": {str(b): d.state() for b, d in self.bands.items()},
                "gains": {k: g.state() for k, g in self.gains.items()},
                "incumbent": self.incumbent, "held": self.held}

    @classmethod
    def from_state(cls, st: dict, params: ChooserParams | None = None) -> "Chooser":
        ch = cls(params)
        ch.bands = {int(b): Decayed(ch.p.half_life).load(d) for b, d in st["bands"].items()}
        for k, g in st["gains"].items():
            ch.gains[k].load(g)
        ch.incumbent, ch.held = st["incumbent"], int(st["held"])
        return ch


@dataclass(slots=True)
class Decision:
    width: int
    offered: list[int]
    prices: list[float] | None
    measure: int | None  # the width a cold-start round measures


class AdaptiveWidth:
    """The cost model and the chooser together: one decision and one learning step per round."""

    def __init__(self, cost: CostModel | None = None, chooser: Chooser | None = None):
        self.cost = cost or CostModel()
        self.chooser = chooser or Chooser()
        self._sums = None  # (candidates, order, sd, sn) of the last decision, reused by learn

    def decide(self, cands: list[dict], order: list[int], context: int, d_ms: float, max_rows: int,
               big_q: list[float] | None = None) -> Decision:
        """The width to verify this round. ``big_q``: the candidates' path products, when the
        caller has them (the scheduler does; replay recomputes them from the record)."""
        offered = [w for w in self.cost.widths if w <= max_rows] or [1]
        if not cands:
            # Nothing was proposed: the round is plain decoding whatever the width (and measures
            # width 1 if the table has it), and it says nothing about which width to hold, so the
            # incumbent, its hold count and the split test are left as they are.
            return Decision(1, offered, None, None)
        prices = {w: t for w, t in self.cost.prices(context).items() if w <= max_rows}
        sd, sn = source_sums(cands, order, big_q)
        measure = self._worth_measuring(prices, sd, sn, len(cands) + 1, d_ms, context, max_rows)
        if measure is not None:
            return Decision(measure, offered, None, measure)
        if not prices:
            return Decision(1, offered, None, None)
        self._sums = (cands, order, sd, sn)
        width = self.chooser.choose(prices, sd, sn, d_ms, context)
        if self.chooser.held >= self.chooser.p.hold_before_split:
            passes = self.chooser.split_test(prices, lambda w: self.cost.class_price(w, context), sd, sn, d_ms, context)
            if self.cost.split(width, context, passes) is not None:
                self.chooser.held = 0
        return Decision(width, list(prices), list(prices.values()), None)

    def _worth_measuring(self, prices: dict[int, float], sd, sn, fill: int, d_ms: float, context: int,
                         max_rows: int) -> int | None:
        """The width this round measures, if any (cold start or a new split, narrowest first).

        Unlike the paper, which measures every new width in the next rounds whatever they hold, a
        width is measured only in a round whose candidates fill it and that could win there even
        at an optimistic price: what the widest measured narrower width costs (a width costs at
        least that much on every kernel we know). On a CPU a wide verify costs several narrow
        ones, and measuring the ladder in whatever rounds came next spent a quarter of a cold
        run's verify time on trees of junk. A width no round makes plausible is never measured
        and never offered. With nothing measured yet the narrowest fillable width is measured."""
        for m in self.cost.unmeasured():
            if m > min(max_rows, fill):
                return None
            below = [w for w in prices if w < m]
            if not below:
                return m if not prices else None
            optimistic = {**prices, m: prices[below[-1]]}
            vals, _ = self.chooser.scores(optimistic, sd, sn, d_ms, context)
            if vals[m] > max(v for w, v in vals.items() if w != m):
                return m
        return None

    def learn(self, rec) -> None:
        self.cost.learn(rec)
        cached = self._sums
        same = cached is not None and cached[0] is rec.candidates and cached[1] is rec.order
        self.chooser.learn(rec, rec.offered, cached[2:] if same else None)
        self._sums = None

    def state(self) -> dict:
        return {"cost": self.cost.state(), "chooser": self.chooser.state()}

    @classmethod
    def from_state(cls, st: dict) -> "AdaptiveWidth":
        return cls(CostModel.from_state(st["cost"]), Chooser.from_state(st["chooser"]))
