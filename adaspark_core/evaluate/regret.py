"""A hindsight account of a logged run (``adaspark replay LOG --regret``): where the width choice
lost, from the round log alone.

Under greedy decoding the tokens committed after a round's anchor (its own accepted path and bonus,
then every later round's) are the target's own continuation, so whether any candidate of the
round, placed or not, would have been accepted is known afterwards: it is accepted iff the tokens
on its path equal the continuation's first tokens. By Proposition 1 every prefix of the round's
best-first order is a tree, and by width invariance (paper 3.5) a verify of n rows accepts exactly
the true path's nodes inside the first n - 1 of the order. So for every width n the round would
have committed ``1 + a(n)`` tokens, where ``a(n)`` counts the true path's nodes ranked below n - 1.

What a width costs comes from measured verify times, pooled over every log given (a bench writes
one log per arm, so a chain:3 log measures width 4): the median per (width, context band) with at
least three samples, else the width's median over all bands. A width measured fewer than three
times in all the logs is not priced and takes no part. A round's host time (everything but the
verify: drafting and planning, the commit, the learners, and the untimed rest of the round's wall
time) is the same whatever its width.

With ``A_r(n) = 1 + a_r(n)`` and ``C_r(n) = H_r + T(n, c_r)`` the account reports

- the realised rate (tokens over the rounds' measured wall time) and the same rounds priced by the
  cost table (``modelled``: the verify noise left out, so it compares with the next two);
- the best single width in hindsight: the n maximising sum A_r(n) / sum C_r(n) (a pinned arm
  with this run's candidates and order), and the rate of every width;
- the per-round oracle: each round's own best width, at the rate it achieves (Dinkelbach: choose
  per round argmax A - rho C, set rho to the achieved rate, repeat).

The loss to the best single width W* (time the run took beyond what its tokens take at W*'s rate
R*) is a sum over rounds of ``delta_r = [C_r(w_r) - C_r(W*)] - [A_r(w_r) - A_r(W*)] / R*`` (host
time cancels: W* pays it too), and each round's delta is split by counterfactual choices:

- cold start: the whole delta of a round that measured a width;
- exploration: the tokens an exploring round gave up against the plain prefix of its width;
- holding (hysteresis): chosen width w against the chooser's own argmax w' (its Eq. 7 or ratio
  without the margin, from the chooser's state before the round, which replay rebuilds);
- acceptance mispricing: w' against w'', the best offered width at the round's own prices with the
  true accepted counts (at rate R*);
- cost mispricing: w'' against w''', the best width at the measured costs (the round's oracle);
- adaptivity: w''' against W*, never positive: what choosing per round earns over one width.

Host time is reported beside the loss (every arm pays it, so it is not part of the loss to W*),
split into its parts, with the learners' part, which a fixed arm does not pay, as its own line.

The account holds the run's round boundaries fixed: every counterfactual width is priced on the
same rounds. It cannot credit a narrow verify with the later rounds it makes possible (a chain whose
first nodes were right is still there next round), which is what the chooser's lookahead weighs; such
choices show up here as acceptance mispricing. ``adaspark simulate`` (tracesim.py) re-decodes with
other choices, boundaries and all.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import median
from typing import Iterable

from adaspark_core.base.tree import hindsight_path
from adaspark_core.learn.cost import band_of
from adaspark_core.store.record import RoundRecord

MIN_SAMPLES = 3  # measured verifies before a width (or a width in a band) is priced
CATEGORIES = ("cold_start", "exploration", "holding", "acceptance", "cost", "adaptivity")


# --- hindsight acceptance -----------------------------------------------------------------------


def committed_tokens(rec: RoundRecord) -> list[int]:
    """The tokens a round committed: its accepted path and the bonus."""
    return [rec.candidates[j]["token"] for j in rec.path] + [rec.bonus]


def continuations(records: list[RoundRecord]) -> list[list[int]]:
    """For each round of one request (in order), the tokens committed from its anchor on."""
    out: list[list[int]] = []
    tail: list[int] = []
    for rec in reversed(records):
        tail = committed_tokens(rec) + tail
        out.append(tail)
    out.reverse()
    return out


def accepted_by_width(order: list[int], path: list[int]) -> list[int]:
    """a(n) for n = 1 .. len(order) + 1 (index n - 1): the true path's nodes among the first n - 1
    of the order. A child ranks after its parent (Proposition 1), so these are a start of it."""
    a = [0] * (len(order) + 1)
    rank = {j: i for i, j in enumerate(order)}
    for j in path:
        a[rank[j] + 1] += 1
    for i in range(1, len(a)):
        a[i] += a[i - 1]
    return a


# --- measured costs -----------------------------------------------------------------------------


class CostTable:
    """Measured verify times by width and context band, from round logs (a request's first round
    is left out: it runs cold, paper 3.2).

    A width measured at three samples or more in a band is priced there at their median. Rarely
    run widths are measured at whatever contexts they happened to run at, so elsewhere a width is
    priced relative to the most measured width: the median of its samples' ratios to that width's
    time in the sample's band, times that width's time in the band asked for (verify time grows
    with context at about the same relative rate across nearby widths; taking a rare width's raw
    median would price it at the context it ran at). A width never measured (a tree that came out
    narrower than its width) is interpolated between the nearest measured widths."""

    def __init__(self, records: Iterable[RoundRecord] = ()):
        self._samples: dict[int, list[tuple[int, float]]] = defaultdict(list)  # width -> (band, ms)
        self._memo: dict[tuple[int, int], float | None] = {}
        for rec in records:
            self.add(rec)

    def add(self, rec: RoundRecord) -> None:
        if rec.first or rec.times.verify <= 0 or rec.step is not None:  # a batched round's verify is its step's
            return
        self._memo.clear()
        self._samples[rec.width].append((band_of(rec.context), rec.times.verify))

    @property
    def widths(self) -> list[int]:
        return sorted(w for w, v in self._samples.items() if len(v) >= MIN_SAMPLES)

    def samples(self, width: int) -> int:
        return len(self._samples.get(width, ()))

    def _band_median(self, width: int, band: int) -> float | None:
        v = [ms for b, ms in self._samples.get(width, ()) if b == band]
        return median(v) if len(v) >= MIN_SAMPLES else None

    def _reference(self, band: int) -> float | None:
        """The most measured width's time in ``band``, or in the nearest band it was measured in."""
        key = (0, band)  # no width is 0: the memo's slot for the reference
        if key not in self._memo:
            self._memo[key] = self._reference_time(band)
        return self._memo[key]

    def _reference_time(self, band: int) -> float | None:
        ref = max(self._samples, key=lambda w: len(self._samples[w]))
        bands = sorted({b for b, _ in self._samples[ref]}, key=lambda b: (abs(b - band), b))
        for b in bands:
            t = self._band_median(ref, b)
            if t is not None:
                return t
        return median(ms for _, ms in self._samples[ref])

    def _measured(self, width: int, band: int) -> float | None:
        own = self._band_median(width, band)
        if own is not None:
            return own
        v = self._samples.get(width, ())
        if len(v) < MIN_SAMPLES:
            return None
        ratios = [ms / self._reference(b) for b, ms in v]
        return median(ratios) * self._reference(band)

    def ms(self, width: int, context: int) -> float | None:
        """The verify time of ``width`` rows at ``context``; None only when nothing was measured."""
        key = (width, band_of(context))
        if key not in self._memo:
            t = self._measured(width, key[1])
            if t is None:
                ws = self.widths
                lo = max((w for w in ws if w < width), default=None)
                hi = min((w for w in ws if w > width), default=None)
                if lo is not None and hi is not None:
                    tl, th = self._measured(lo, key[1]), self._measured(hi, key[1])
                    t = tl + (th - tl) * (width - lo) / (hi - lo)
                elif lo is not None or hi is not None:
                    t = self._measured(lo if lo is not None else hi, key[1])
            self._memo[key] = t
        return self._memo[key]


# --- the account --------------------------------------------------------------------------------


@dataclass
class RoundView:
    """What the account needs of one round."""

    rec: RoundRecord
    a: list[int]  # a(n), index n - 1, up to every candidate
    host: float  # ms: the round's time outside the verify
    wall: float  # ms: the round's measured time, host included
    model_choice: int | None = None  # the chooser's argmax without the margin (adaptive rounds)

    def accepted(self, n: int) -> int:
        return self.a[min(n, len(self.a)) - 1]

    def eff(self, n: int) -> int:
        """The rows a verify of width n has this round: a tree of fewer candidates is narrower."""
        return min(n, len(self.rec.candidates) + 1)


@dataclass
class Account:
    arm: str
    rounds: int = 0
    tokens: int = 0
    wall_ms: float = 0.0
    verify_ms: float = 0.0
    host: dict = field(default_factory=dict)  # part -> ms
    modelled_rate: float | None = None
    width_rates: dict = field(default_factory=dict)  # width -> tok/s with that width every round
    best_width: int | None = None
    best_rate: float | None = None
    oracle_rate: float | None = None
    oracle_widths: dict = field(default_factory=dict)  # width -> rounds
    realised_widths: dict = field(default_factory=dict)
    loss_ms: dict = field(default_factory=dict)  # category -> ms (positive: lost against W*)
    # Median ms per round outside llama_decode (Python and ctypes: fill, pricing, plan, the
    # engine's batch build and KV operations, commit, learners, record, log), rounds of <= 16 rows.
    host_median_ms: float | None = None
    unpriced_rounds: int = 0  # rounds whose width has no measured cost (left out)
    hindsight_mismatch: int = 0  # rounds whose accepted path differs from a(width): near ties

    @property
    def realised_rate(self) -> float | None:
        return self.tokens / self.wall_ms * 1e3 if self.wall_ms > 0 else None

    def to_json(self) -> dict:
        def ratio(a, b):
            return a / b if a is not None and b else None

        loss_total = sum(self.loss_ms.values())
        return {
            "arm": self.arm, "rounds": self.rounds, "tokens": self.tokens,
            "wall_ms": self.wall_ms, "verify_ms": self.verify_ms, "host_ms": self.host,
            "host_share": ratio(sum(self.host.values()), self.wall_ms),
            "host_median_ms": self.host_median_ms,
            "realised_rate": self.realised_rate, "modelled_rate": self.modelled_rate,
            "best_width": self.best_width, "best_width_rate": self.best_rate,
            "oracle_rate": self.oracle_rate,
            "realised_over_best": ratio(self.modelled_rate, self.best_rate),
            "realised_over_oracle": ratio(self.modelled_rate, self.oracle_rate),
            "best_over_oracle": ratio(self.best_rate, self.oracle_rate),
            "width_rates": {str(w): r for w, r in sorted(self.width_rates.items())},
            "realised_widths": {str(w): n for w, n in sorted(self.realised_widths.items())},
            "oracle_widths": {str(w): n for w, n in sorted(self.oracle_widths.items())},
            "loss_ms": self.loss_ms, "loss_total_ms": loss_total,
            "loss_share": {k: ratio(v, self.wall_ms) for k, v in self.loss_ms.items()},
            "unpriced_rounds": self.unpriced_rounds, "hindsight_mismatch": self.hindsight_mismatch,
        }


def round_views(records: list[RoundRecord], model_choices: dict | None = None) -> list[RoundView]:
    """The rounds of one arm's log with their hindsight accepted counts and times."""
    by_req: dict[str, list[RoundRecord]] = {}
    for rec in records:
        by_req.setdefault(rec.request, []).append(rec)
    views = []
    for reqs in by_req.values():
        for i, (rec, cont) in enumerate(zip(reqs, continuations(reqs))):
            a = accepted_by_width(rec.order, hindsight_path(rec.candidates, cont))
            t = rec.times
            nxt = reqs[i + 1].times.start if i + 1 < len(reqs) else None
            own = t.draft + t.verify + t.commit + t.learn
            wall = nxt - t.start if nxt is not None and t.start is not None else own
            wall = max(wall, own)
            mc = (model_choices or {}).get((rec.request, rec.round))
            views.append(RoundView(rec, a, wall - t.verify, wall, mc))
    return views


def _rate(views: list[RoundView], widths: list[int], costs: CostTable) -> float | None:
    """Tokens over time with each round at its width ``widths[i]``; None if one has no cost."""
    tok = ms = 0.0
    for v, n in zip(views, widths):
        t = costs.ms(v.eff(n), v.rec.context)
        if t is None:
            return None
        tok += 1 + v.accepted(n)
        ms += v.host + t
    return tok / ms * 1e3 if ms > 0 else None


def _best_for(v: RoundView, widths: list[int], costs: CostTable, rho: float,
              price=None) -> int:
    """The width maximising A - rho C this round (rho in tokens per ms); ``price(n)``: the
    verify time to use instead of the measured one. Ties to the narrower width."""
    best, val = None, -math.inf
    for n in widths:
        t = price(n) if price is not None else costs.ms(v.eff(n), v.rec.context)
        if t is None:
            continue
        x = 1 + v.accepted(n) - rho * (v.host + t)
        if x > val + 1e-12:
            best, val = n, x
    return best if best is not None else 1


def account(records: list[RoundRecord], costs: CostTable, model_choices: dict | None = None) -> Account:
    """The hindsight account of one arm's rounds (module docstring)."""
    views = round_views(records, model_choices)
    acc = Account(records[0].arm if records else "-")
    host = defaultdict(float)
    for v in views:
        t = v.rec.times
        acc.rounds += 1
        acc.tokens += len(v.rec.path) + 1
        acc.wall_ms += v.wall
        acc.verify_ms += t.verify
        host["draft_plan"] += t.draft
        host["commit"] += t.commit
        host["learn"] += t.learn
        host["untimed"] += v.wall - (t.draft + t.verify + t.commit + t.learn)
        acc.realised_widths[v.rec.width] = acc.realised_widths.get(v.rec.width, 0) + 1
        if not v.rec.explored and v.accepted(v.rec.width) != len(v.rec.path):
            acc.hindsight_mismatch += 1
    acc.host = dict(host)
    outside = [v.wall - v.rec.times.decode for v in views if v.rec.width <= 16]
    acc.host_median_ms = median(outside) if outside else None
    # Rounds whose own width was never measured (often enough) cannot be priced: left out, counted.
    priced = [v for v in views if costs.ms(v.eff(v.rec.width), v.rec.context) is not None]
    acc.unpriced_rounds = len(views) - len(priced)
    widths = costs.widths
    if not priced or not widths:
        return acc
    acc.modelled_rate = _rate(priced, [v.rec.width for v in priced], costs)
    for n in widths:
        r = _rate(priced, [n] * len(priced), costs)
        if r is not None:
            acc.width_rates[n] = r
    if not acc.width_rates:
        return acc
    w_star = max(acc.width_rates, key=lambda n: (acc.width_rates[n], -n))
    acc.best_width, acc.best_rate = w_star, acc.width_rates[w_star]
    # Per-round oracle by Dinkelbach's iteration, from W*'s rate.
    rho = acc.best_rate / 1e3
    for _ in range(50):
        choice = [_best_for(v, widths, costs, rho) for v in priced]
        new = _rate(priced, choice, costs) / 1e3
        if abs(new - rho) <= 1e-12 * rho:
            break
        rho = new
    acc.oracle_rate = rho * 1e3
    for n in choice:
        acc.oracle_widths[n] = acc.oracle_widths.get(n, 0) + 1
    acc.loss_ms = _losses(priced, widths, costs, w_star, acc.best_rate / 1e3)
    return acc


def _losses(views: list[RoundView], widths: list[int], costs: CostTable, w_star: int, r_star: float) -> dict:
    """Each round's delta against W* (ms at rate ``r_star``, tokens per ms), split by category."""
    loss = dict.fromkeys(CATEGORIES, 0.0)

    def delta(v: RoundView, n: int, accepted: int | None = None) -> float:
        a = v.accepted(n) if accepted is None else accepted
        c = costs.ms(v.eff(n), v.rec.context)
        return (c - costs.ms(v.eff(w_star), v.rec.context)) - (a - v.accepted(w_star)) / r_star

    for v in views:
        rec = v.rec
        w = rec.width
        actual = delta(v, w, len(rec.path))
        if rec.decision.measure is not None:
            loss["cold_start"] += actual
            continue
        loss["exploration"] += actual - delta(v, w)
        oracle = _best_for(v, widths, costs, r_star)
        if not rec.candidates or rec.decision.prices is None or v.model_choice is None:
            # A fixed arm's round (or plain decoding): its whole choice against the oracle's.
            loss["holding" if rec.decision.prices is not None else "cost"] += delta(v, w) - delta(v, oracle)
            loss["adaptivity"] += delta(v, oracle)
            continue
        prices = rec.decision.prices
        with_truth = _best_for(v, list(prices), costs, r_star, price=prices.get)
        loss["holding"] += delta(v, w) - delta(v, v.model_choice)
        loss["acceptance"] += delta(v, v.model_choice) - delta(v, with_truth)
        loss["cost"] += delta(v, with_truth) - delta(v, oracle)
        loss["adaptivity"] += delta(v, oracle)
    return loss
