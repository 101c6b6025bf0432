"""The width chooser (paper section 3.4, Eq. 7) and the adaptive width policy.

For each offered width n the chooser weighs the round's expected tokens against its expected time:

    V(n) = 1 + S(n) + L(n) - rho_m (D + T(n, c))

with S(n) the expected accepted candidates among the first n - 1 of the best-first order, rho_m
the long-run decode rate of the round's context band, and L(n) what the nodes a width leaves
unverified are worth to the next rounds (``lookahead``; beyond the paper, which has no L and
scales S above and below n0 = 8 by learned gains instead). Until a band has 8 rounds it maximises
the per-round ratio (1 + S(n)) / (D + T(n)). It keeps its incumbent unless another width beats it
by a margin.

Why L, and why no gains: Eq. 7 values a round alone, as if the nodes it leaves unverified were
lost. They are not: when a verify of the first m nodes of a chain accepts them all and the target's
next token is node m + 1, the next round starts on the rest of the chain and chooses again, knowing
the first m were right. So a narrow verify of a long chain keeps an option a wide one spends, and a
myopic V prefers wide trees whose deep nodes are often wasted (on a CPU a wide verify costs
several narrow ones). The paper's gains, learned from realised over predicted tokens, damp that
bias by scaling the deep part of S down; with L the bias is gone at its source and the gains
(which then damp twice) only cost: on trace simulations of the bench workload L alone beats
gains alone and the two together (ARCHITECTURE.md, section 5).

``AdaptiveWidth`` joins the cost model and the chooser into what a round asks: which width to
verify, given the round's candidates; and what to learn from the round's record. Each of the
three keeps a versioned section of the store (``state`` / ``from_state``, checks.section).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from adaspark_core.base.checks import VERSION_FIELD, count, int_key, mapping, section
from adaspark_core.base.decision import WidthDecision
from adaspark_core.base.tree import ANCHOR, MAX_CHAIN_DEPTH, MAX_WIDTH, products
from adaspark_core.learn.cost import MAX_BAND, CostModel, CostParams, band_of
from adaspark_core.learn.online import Decayed


@dataclass
class ChooserParams:
    half_life: float = 64.0  # rounds, for the band rates
    band_min_rounds: int = 8
    margin: float = 0.04  # of the incumbent's expected tokens
    ratio_margin: float = 0.04  # before the band's rate is known
    hold_before_split: int = 8


def expected_sums(cands: list[dict], order: list[int], big_q: list[float] | None = None) -> list[float]:
    """S(n) for n = 1 .. len(order) + 1 (index n - 1): the expected accepted candidates in the
    first n - 1 of the order. ``big_q``: the candidates' path products, when the caller has them."""
    if big_q is None:
        big_q = products([c["parent"] for c in cands], [c["q"] for c in cands])
    s = [0.0]
    for j in order:
        s.append(s[-1] + big_q[j])
    return s


def spine(cands: list[dict], order: list[int]) -> tuple[list[float], list[int], bool]:
    """The round's most likely path from the anchor (each step to the child of highest q), as the
    q of its nodes; for every width n (index n - 1) how many of its nodes the first n - 1 of the
    order hold (a start of it: a child ranks after its parent); and whether it was cut at the
    chain depth limit rather than ended."""
    best: dict[int, int] = {}
    for j, c in enumerate(cands):
        b = best.get(c["parent"])
        if b is None or c["q"] > cands[b]["q"]:
            best[c["parent"]] = j
    qs, on, node, reach, last = [], set(), best.get(ANCHOR), 1.0, None
    # It ends where it can no longer matter (and its products cannot underflow): at a node that
    # cannot be accepted or one reached with a chance below 1e-12.
    while node is not None and reach * cands[node]["q"] > 1e-12:
        reach *= cands[node]["q"]
        qs.append(cands[node]["q"])
        on.add(node)
        node, last = best.get(node), node
    held = [0]
    for j in order:
        held.append(held[-1] + (j in on))
    return qs, held, node is None and last is not None and cands[last]["depth"] >= MAX_CHAIN_DEPTH


def continuation_values(qs: list[float], prices: dict[int, float], rho: float, d: float) -> list[float]:
    """G[k]: what a round that starts at the spine's node k is worth, in tokens net of its time at
    rate rho (0: an average round), counting what it leaves to the rounds after it. It verifies m
    of the nodes (m + 1 rows, an offered width): 1 + their expected accepted - rho (D + T(m + 1));
    if all m are accepted and the target's next token is node k + m, the round after starts at
    node k + m + 1. A round is worth at least an average one: G >= 0, G[len(qs)] = 0."""
    n = len(qs)
    # Prefix products and their sums along the spine: the chance that nodes k .. k+m-1 are all
    # accepted is P[k+m] / P[k], their expected accepted (A[k+m] - A[k]) / P[k] (the spine's q
    # are > 0, so is P). Each start then costs one step per offered width, not one per node.
    big_p, big_a = [1.0], [0.0]
    for q in qs:
        big_p.append(big_p[-1] * q)
        big_a.append(big_a[-1] + big_p[-1])
    steps = [(w - 1, rho * (d + t)) for w, t in sorted(prices.items())]
    g = [0.0] * (n + 1)
    # nxt[j] = q_j G[j + 1], what a round that verified up to node j passes on (0 past the spine),
    # kept as G fills from the end: the inner loop runs n x widths times a round (host time).
    nxt = [0.0] * (n + 1)
    for k in range(n - 1, -1, -1):
        best = 0.0
        pk, ak = big_p[k], big_a[k]
        for m, cost in steps:
            j = k + m
            if j > n:
                break
            value = 1.0 + (big_a[j] - ak) / pk - cost + big_p[j] / pk * nxt[j]
            if value > best:
                best = value
        g[k] = best
        if k:
            nxt[k - 1] = qs[k - 1] * best
    return g


class Lookahead:
    """L(n): what the spine nodes a verify of n rows leaves unverified are worth to the next
    rounds: if every spine node inside the prefix is accepted and the target's next token is the
    following spine node, the next round starts there (worth G, ``continuation_values``).

    The next round is taken to see the rest of the spine with the q it has now, and the offered
    widths at today's prices; a round whose chain breaks, or that the spine does not reach, is an
    average round (worth 0 at rate rho).

    A spine cut at the chain depth limit goes on: the chain is re-read from every new anchor, so
    its end is where this round stopped looking, not where the copy ends. It is valued as if it
    went on for as many nodes again at its last node's q. (Taken as ended, the end's distance
    shapes every choice: a long, likely chain is verified one row a round, because a round that
    starts one node later fits the width ladder better, and every round sees the same end one
    node further on; ARCHITECTURE.md, section 5.)"""

    def __init__(self, cands: list[dict], order: list[int], prices: dict[int, float], rho: float, d: float):
        self.qs, self.held, cut = spine(cands, order)
        qs = self.qs + self.qs[-1:] * len(self.qs) if cut else self.qs
        self.g = continuation_values(qs, prices, rho, d) if qs else [0.0]
        # L for every count m of spine nodes a prefix can hold: P(first m accepted) q_m G[m + 1].
        self.by_held, p = [], 1.0
        for m, q in enumerate(self.qs):
            self.by_held.append(p * q * self.g[m + 1])
            p *= q
        # The whole spine verified leaves a later round only the chain's going on, if it was cut.
        n = len(self.qs)
        self.by_held.append(p * qs[n] * self.g[n + 1] if cut else 0.0)

    def __call__(self, n: int) -> float:
        return self.by_held[at(self.held, n)]


def at(xs: list, n: int):
    """xs[n - 1], or the last value when the tree has fewer candidates than n - 1."""
    return xs[min(n, len(xs)) - 1]


class Chooser:
    """Eq. 7 with band rates, the lookahead and hysteresis (paper 3.4)."""

    VERSION = 1  # of its section (state)

    def __init__(self, params: ChooserParams | None = None):
        self.p = params or ChooserParams()
        self.bands: dict[int, Decayed] = {}
        self.incumbent: int | None = None
        self.held = 0  # rounds the incumbent has been held

    def rate(self, c: int) -> float | None:
        b = self.bands.get(band_of(c))
        return b.ratio if b is not None and b.count >= self.p.band_min_rounds else None

    def charged_rate(self, c: int, prices: dict[int, float], d: float, floor: float = 0.0) -> float | None:
        """The rate V charges time at: the band's, but never less than plain decoding's,
        1 / (D + T(1)), where width 1 is priced. The band's rate is what the policy earned; a
        policy that bets at a loss earns less than plain decoding would, and charged at its own
        rate its bets look cheaper still, so it goes on (measured on Qwen2.5-Coder 1.5B: cold wide
        verifies and 4-deep drafts held the band's rate 25% under plain decoding's). No width
        earns less than plain decoding is worth: that is its time's cost. None until the band has
        a rate."""
        rho = self.rate(c)
        if rho is None:
            return None
        if 1 in prices:
            floor = max(floor, 1.0 / (d + prices[1]))
        return max(rho, floor)

    def scores(self, prices: dict[int, float], s: list[float], d: float, c: int,
               ahead: Lookahead | None = None, rho_floor: float = 0.0) -> tuple[dict[int, float], bool]:
        """Each priced width's score, and whether it is V(n) (else, until the band's rate is
        known, the per-round ratio (1 + S(n)) / (D + T(n))). ``ahead``: the round's L (none: 0).
        ``rho_floor``: a least rate to charge time at beyond ``charged_rate``'s."""
        rho = self.charged_rate(c, prices, d, rho_floor)
        if rho is None:
            return {n: (1.0 + at(s, n)) / (d + t) for n, t in prices.items()}, False
        return {n: 1.0 + at(s, n) + (ahead(n) if ahead else 0.0) - rho * (d + t) for n, t in prices.items()}, True

    def lookahead(self, cands: list[dict], order: list[int], prices: dict[int, float], d: float,
                  c: int) -> Lookahead | None:
        """The round's L, once the band's rate is known."""
        rho = self.charged_rate(c, prices, d)
        return Lookahead(cands, order, prices, rho, d) if rho is not None and prices else None

    def choose(self, prices: dict[int, float], s: list[float], d: float, c: int,
               ahead: Lookahead | None = None) -> tuple[int, int]:
        """The width to verify among the priced widths, and the chooser's favourite: the best
        scoring width before the margin and dominance (what regret.py's "holding" compares with)."""
        widths = list(prices)
        if self.incumbent not in prices:
            self.incumbent = widths[-1]  # the first incumbent is the widest offered width
            self.held = 0
        inc = self.incumbent
        vals, is_value = self.scores(prices, s, d, c, ahead)
        best = max(widths, key=vals.__getitem__)
        if is_value:
            switch = vals[best] > vals[inc] + self.p.margin * (1.0 + at(s, inc))
        else:
            switch = vals[best] > (1.0 + self.p.ratio_margin) * vals[inc]
        # A wider width priced no higher than the incumbent dominates it (Proposition 2: it
        # verifies now, at no cost, what the incumbent leaves to a later round), so the margin,
        # which guards trades of tokens against time from flipping on noise, does not hold it back.
        dominant = [n for n in widths if n > inc and prices[n] <= prices[inc]]
        favourite = best
        if dominant and not (switch and best != inc):
            best, switch = dominant[-1], True
        if switch and best != inc:
            self.incumbent, self.held = best, 0
        else:
            self.held += 1
        return self.incumbent, favourite

    def split_test(self, prices: dict[int, float], cost_price, s: list[float], d: float, c: int,
                   ahead: Lookahead | None = None):
        """passes(a, b): could a width inside (a, b) beat the incumbent? A width inside costs at
        least T(a) and accepts at most what b - 1 rows accept (and leaves the next rounds what
        b - 1 rows leave)."""
        inc = self.incumbent

        def passes(a: int, b: int) -> bool:
            vals, is_value = self.scores({b - 1: cost_price(a), inc: prices[inc]}, s, d, c, ahead)
            inside, here = vals[b - 1], vals[inc]
            if not is_value:
                return inside > (1.0 + self.p.ratio_margin) * here
            return inside > here + self.p.margin * (1.0 + at(s, inc))

        return passes

    def learn(self, rec) -> None:
        """The band's rate from the round's committed tokens and time."""
        self.bands.setdefault(band_of(rec.context), Decayed(self.p.half_life)).add(len(rec.path) + 1, rec.times.total)

    def state(self) -> dict:
        return {VERSION_FIELD: self.VERSION, "bands": {str(b): d.state() for b, d in self.bands.items()},
                "incumbent": self.incumbent, "held": self.held}

    @classmethod
    def from_state(cls, st: dict, params: ChooserParams | None = None, path: str = "chooser") -> "Chooser":
        """Restore a ``state()``, checked (checks.py): bands are context bands (cost.band_of), the
        incumbent null or a width the cost model can offer."""
        # A store written before the lookahead also holds the gains ("gains"): not read.
        section(st, path, cls.VERSION, ("bands", "incumbent", "held"), legacy=("gains",))
        ch = cls(params)
        ch.bands = {int_key(b, f"{path}.bands", 0, MAX_BAND): Decayed(ch.p.half_life).load(d, f"{path}.bands.{b}")
                    for b, d in mapping(st["bands"], f"{path}.bands").items()}
        inc = st["incumbent"]
        ch.incumbent = None if inc is None else count(inc, f"{path}.incumbent", 1, MAX_WIDTH)
        ch.held = count(st["held"], f"{path}.held")
        return ch


@dataclass
class WidthParams:
    cost: CostParams = field(default_factory=CostParams)
    chooser: ChooserParams = field(default_factory=ChooserParams)


class AdaptiveWidth:
    """The cost model and the chooser together: one decision and one learning step per round."""

    VERSION = 1  # of its section (state); the cost model and the chooser version their own

    def __init__(self, cost: CostModel | None = None, chooser: Chooser | None = None):
        self.cost = cost or CostModel()
        self.chooser = chooser or Chooser()

    def decide(self, cands: list[dict], order: list[int], context: int, d_ms: float, max_rows: int,
               big_q: list[float] | None = None) -> WidthDecision:
        """The width to verify this round. ``big_q``: the candidates' path products, when the
        caller has them (the scheduler does; replay recomputes them from the record)."""
        offered = [w for w in self.cost.widths if w <= max_rows] or [1]
        if not cands:
            # Nothing was proposed: the round is plain decoding whatever the width (and measures
            # width 1 if the table has it), and it says nothing about which width to hold, so the
            # incumbent, its hold count and the split test are left as they are.
            return WidthDecision.unpriced(1, offered)
        prices = {w: t for w, t in self.cost.prices(context).items() if w <= max_rows}
        s = expected_sums(cands, order, big_q)
        ahead = self.chooser.lookahead(cands, order, prices, d_ms, context)
        measure = self._worth_measuring(prices, s, ahead, len(cands) + 1, d_ms, context, max_rows)
        if measure is not None:
            return WidthDecision.unpriced(measure, offered, measure)
        if not prices:
            return WidthDecision.unpriced(1, offered)
        width, favourite = self.chooser.choose(prices, s, d_ms, context, ahead)
        if self.chooser.held >= self.chooser.p.hold_before_split:
            passes = self.chooser.split_test(prices, lambda w: self.cost.class_price(w, context), s, d_ms, context, ahead)
            if self.cost.split(width, context, passes) is not None:
                self.chooser.held = 0
        return WidthDecision(width, dict(prices), None, favourite)

    def decide_step(self, rounds: list[tuple[list[int], list[float]]], cells: int, d_ms: float,
                    max_rows: list[int]) -> list[WidthDecision]:
        """The widths of the requests of one step, verified together (decode/batch.py), from each
        request's (best-first order, path products Q) and its most rows.

        Every request gets its anchor row. A row beyond adds its candidate's Q to the step's
        expected tokens (Proposition 1 over the union of the trees), so the rows beyond go to the
        highest Q across all requests, and the step's total is the measured class width with the
        most expected tokens per millisecond of the whole step, D + T(rows, cells): T is the cost
        model's price at the step's cells, since every row attends every request's cells. So a
        request's rows cost what they add to the step, and widths shrink as the step fills. A
        class width not measured yet is measured as a lone round's is (the narrowest the step
        can fill while nothing is priced, else one that could win at the price of the widest
        measured narrower class). No hysteresis, no lookahead: the step's mix changes every step.

        Unlike a lone round, a step prices an unmeasured class at ``CostModel.price_floor``, not
        at the narrower class's price: a step's rows are many, and priced at the narrower price
        every class the candidates fill looks like a win (ARCHITECTURE.md, section 2, has what
        that cost)."""
        n = len(rounds)
        gains = sorted(((big_q[j], i, k) for i, (order, big_q) in enumerate(rounds)
                        for k, j in enumerate(order[: max(max_rows[i] - 1, 0)])),
                       key=lambda g: (-g[0], g[1], g[2]))
        fill = n + len(gains)
        prices = {w: t for w, t in self.cost.prices(cells).items() if w >= n}
        offered = [w for w in self.cost.widths if w >= n]

        def value(total: int, price: float) -> float:
            return (n + sum(g[0] for g in gains[: max(min(total, fill) - n, 0)])) / (d_ms + price)

        best = max(prices, key=lambda w: value(w, prices[w]), default=None)
        measure = None
        for m in self.cost.unmeasured():
            if m < n:
                continue
            if m > fill:
                break
            below = [w for w in prices if w < m]
            if best is None or (below and value(m, self.cost.price_floor(m, cells)) > value(best, prices[best])):
                measure = m
                break
        total = measure if measure is not None else (min(best, fill) if best is not None else n)
        widths = [1] * n
        for _, i, _ in gains[: total - n]:
            widths[i] += 1
        if measure is not None or best is None:
            return [WidthDecision.unpriced(w, offered, measure) for w in widths]
        return [WidthDecision(w, dict(prices)) for w in widths]

    def _worth_measuring(self, prices: dict[int, float], s: list[float], ahead: Lookahead | None, fill: int,
                         d_ms: float, context: int, max_rows: int) -> int | None:
        """The width this round measures, if any (cold start or a new split, narrowest first).

        Unlike the paper, which measures every new width in the next rounds whatever they hold, a
        width is measured only in a round whose candidates fill it and that could win there even
        at an optimistic price: ``CostModel.price_floor``, what the widest measured narrower width
        costs plus half its row price for each row beyond (a width costs at least that much on
        every kernel we know). On a CPU a wide verify costs several narrow ones, so measuring the
        ladder in whatever rounds come next wastes a cold run's verify time on trees of junk
        (ARCHITECTURE.md, section 5); priced at the narrower width alone, every wider width a
        draft model's 32 candidates fill looked like a win, and a cold Qwen2.5-Coder 1.5B measured
        16 and 32 rows (0.4-0.7 s each) three times apiece. A width no round makes plausible is
        never measured and never offered. With nothing measured yet the narrowest fillable width
        is measured."""
        for m in self.cost.unmeasured():
            if m > min(max_rows, fill):
                return None
            below = [w for w in prices if w < m]
            if not below:
                return m if not prices else None
            optimistic = {**prices, m: self.cost.price_floor(m, context)}
            vals, _ = self.chooser.scores(optimistic, s, d_ms, context, ahead)
            if vals[m] > max(v for w, v in vals.items() if w != m):
                return m
        return None

    def learn(self, rec) -> None:
        """The cost model learns a lone round, or a step from its lead record (RoundRecord.as_step:
        all its rows over all its cells, once; not a step that also carried prompt tokens); the
        chooser each request's own rate."""
        if rec.step is None:
            self.cost.learn(rec)
        elif rec.step.lead and not rec.step.prefill:  # a prompt's chunk is not a verify's cost
            self.cost.learn(rec.as_step())
        self.chooser.learn(rec)

    def state(self) -> dict:
        return {VERSION_FIELD: self.VERSION, "cost": self.cost.state(), "chooser": self.chooser.state()}

    @classmethod
    def from_state(cls, st: dict, params: WidthParams | None = None, path: str = "width") -> "AdaptiveWidth":
        """Restore a ``state()``, checked: each part by its own ``from_state``."""
        p = params or WidthParams()
        section(st, path, cls.VERSION, ("cost", "chooser"))
        return cls(CostModel.from_state(st["cost"], p.cost, f"{path}.cost"),
                   Chooser.from_state(st["chooser"], p.chooser, f"{path}.chooser"))
