"""A hindsight account of batched steps (``adaspark replay LOG --regret`` on a log of
``serve --parallel N``): what the steps' widths gave against every fixed per-request width and
against the per-step oracle, with the steps' boundaries and requests held as they ran.

What each round would have accepted at every width, a(n), is regret.py's (greedy decoding: a
candidate is accepted iff its path is the target's continuation). What a step costs is not a
round's: one llama_decode holds every request's rows, and under the unified cache every row
attends every request's cells. So the step's decode time is fitted over the log's own steps
(those without prompt tokens) by least squares on

    T(r, c) = t0 + t1 r + t2 c + t3 r c

for its total rows r and cells c: the row price t1 + t3 c grows with the cells. Each step's host
time (the step's measured time beyond its decode) is the same whatever its widths. With
A_s = sum over its rounds of 1 + a_i(w_i) and C_s = H_s + T(sum w_i, c_s), the account reports

- the measured rate (tokens over the steps' measured time) and the same steps priced by the fit;
- every fixed per-request width k (each request verifies min(k, its tree) rows: pinned:k with
  this run's trees), and the best of them;
- the per-step oracle: each step's widths maximising A - rho C at the rate rho they achieve
  (Dinkelbach). T is linear in the rows at a step's cells, so each request's best width is its
  own: the one maximising a_i(w) - rho (t1 + t3 c) w;
- with the steps that carried prompt tokens added as they ran, the run's measured rate and its
  rate had every other step run at the oracle's: a bound on what any width rule could give the
  run, prompts and all.

By load (requests per step) it gives the realised, the best fixed and the oracle's mean rows per
request, which is where a batch rule's widths are too wide or too narrow. Like regret.py it cannot
credit a narrow verify with the later rounds it makes possible, and only greedy steps have a
hindsight (a step with a sampled round is left out and counted).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import numpy as np

from adaspark_core.base.tree import hindsight_path
from adaspark_core.evaluate.regret import accepted_by_width, continuations
from adaspark_core.store.record import RoundRecord

MIN_STEPS = 8  # steps without prompt tokens before the step cost is fitted


@dataclass
class StepView:
    rounds: list[tuple[list[int], int, int]]  # per request: a(n), its rows cap, its realised width
    cells: int
    rows: int
    decode: float  # ms, measured
    host: float  # ms: the step's time beyond its decode
    prefill: bool
    committed: int  # tokens the step's rounds committed

    def tokens(self, widths: list[int]) -> int:
        return sum(1 + a[min(w, len(a)) - 1] for (a, _, _), w in zip(self.rounds, widths))

    def rows_of(self, widths: list[int]) -> int:
        return sum(min(w, len(a), cap) for (a, cap, _), w in zip(self.rounds, widths))


@dataclass
class StepAccount:
    arm: str
    steps: int = 0
    rounds: int = 0
    tokens: int = 0
    measured_ms: float = 0.0
    left_out: int = 0  # steps with a sampled round, or with prompt tokens riding
    prefill_tokens: int = 0  # committed in the greedy steps that carried prompt tokens
    prefill_ms: float = 0.0  # those steps' measured time
    fit: list[float] | None = None  # t0, t1, t2, t3 (ms)
    fit_error: float | None = None  # median relative error of the fit over the fitted steps
    modelled_rate: float | None = None
    width_rates: dict = field(default_factory=dict)  # k -> tok/s
    best_width: int | None = None
    best_rate: float | None = None
    oracle_rate: float | None = None
    by_load: dict = field(default_factory=dict)  # requests -> {steps, realised, best, oracle}: rows per request

    def to_json(self) -> dict:
        def ratio(a, b):
            return a / b if a is not None and b else None

        return {"arm": self.arm, "steps": self.steps, "rounds": self.rounds, "tokens": self.tokens,
                "measured_rate": self.tokens / self.measured_ms * 1e3 if self.measured_ms else None,
                "left_out_steps": self.left_out, "fit": self.fit, "fit_error": self.fit_error,
                "modelled_rate": self.modelled_rate,
                "width_rates": {str(k): r for k, r in sorted(self.width_rates.items())},
                "best_width": self.best_width, "best_width_rate": self.best_rate,
                "oracle_rate": self.oracle_rate,
                "realised_over_best": ratio(self.modelled_rate, self.best_rate),
                "realised_over_oracle": ratio(self.modelled_rate, self.oracle_rate),
                "by_load": {str(n): v for n, v in sorted(self.by_load.items())},
                # every greedy step, those with prompt tokens as they ran: the run's rate, and its
                # rate had the other steps run at the oracle's (the most any width rule can give it)
                "with_prompts": {"measured": ratio(1e3 * (self.tokens + self.prefill_tokens),
                                                   self.measured_ms + self.prefill_ms),
                                 "oracle": ratio(1e3 * (self.tokens + self.prefill_tokens),
                                                 self.prefill_ms + self.tokens / self.oracle_rate * 1e3)
                                 if self.oracle_rate else None}}


def step_views(records: list[RoundRecord]) -> tuple[list[StepView], int]:
    """The batched steps of one arm's log (greedy ones), and how many steps had a sampled round."""
    by_req: dict[str, list[RoundRecord]] = defaultdict(list)
    for rec in records:
        by_req[rec.request].append(rec)
    accepted = {}
    for reqs in by_req.values():
        for rec, cont in zip(reqs, continuations(reqs)):
            accepted[id(rec)] = accepted_by_width(rec.order, hindsight_path(rec.candidates, cont))
    groups: dict[tuple, list[RoundRecord]] = defaultdict(list)
    for rec in records:
        if rec.step is not None:
            groups[(rec.step.batch, rec.step.id)].append(rec)
    views, sampled = [], 0
    for group in groups.values():
        if any(r.sampling is not None for r in group):
            sampled += 1
            continue
        lead = next((r for r in group if r.step.lead), group[0])
        s = lead.step
        host = s.draft + (lead.times.verify - lead.times.decode) + sum(r.times.commit + r.times.learn for r in group)
        views.append(StepView([(accepted[id(r)], r.step.max_rows, r.width) for r in group],
                              s.cells, s.rows, lead.times.decode, host, bool(s.prefill),
                              sum(len(r.path) + 1 for r in group)))
    return views, sampled


def fit_step_cost(views: list[StepView]) -> tuple[np.ndarray, float] | None:
    """The least-squares T(r, c) over the steps without prompt tokens, and its median relative
    error; None with fewer than MIN_STEPS of them or rows that never varied."""
    fitted = [v for v in views if not v.prefill and v.decode > 0]
    if len(fitted) < MIN_STEPS or len({v.rows for v in fitted}) < 2:
        return None
    x = np.array([[1.0, v.rows, v.cells, v.rows * v.cells] for v in fitted])
    y = np.array([v.decode for v in fitted])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    err = float(np.median(np.abs(x @ coef - y) / y))
    return coef, err


def step_account(records: list[RoundRecord]) -> StepAccount:
    """The hindsight account of one arm's batched steps (module docstring)."""
    acc = StepAccount(records[0].arm if records else "-")
    views, sampled = step_views(records)
    fit = fit_step_cost(views)
    priced = [v for v in views if not v.prefill]
    acc.left_out = sampled + len(views) - len(priced)
    acc.steps = len(priced)
    acc.rounds = sum(len(v.rounds) for v in priced)
    acc.tokens = sum(v.committed for v in priced)
    acc.measured_ms = sum(v.decode + v.host for v in priced)
    acc.prefill_tokens = sum(v.committed for v in views if v.prefill)
    acc.prefill_ms = sum(v.decode + v.host for v in views if v.prefill)
    if fit is None or not priced:
        return acc
    coef, acc.fit_error = fit
    acc.fit = [float(t) for t in coef]
    t0, t1, t2, t3 = acc.fit

    def step_ms(v: StepView, rows: int) -> float:
        return v.host + max(t0 + t1 * rows + t2 * v.cells + t3 * rows * v.cells, 0.0)

    def rate(choice: list[list[int]]) -> float:
        tok = sum(v.tokens(w) for v, w in zip(priced, choice))
        ms = sum(step_ms(v, v.rows_of(w)) for v, w in zip(priced, choice))
        return tok / ms * 1e3

    realised = [[w for _, _, w in v.rounds] for v in priced]
    acc.modelled_rate = rate(realised)
    widest = max(len(a) for v in priced for a, _, _ in v.rounds)
    fixed = {k: [[k] * len(v.rounds) for v in priced] for k in range(1, widest + 1)}
    acc.width_rates = {k: rate(choice) for k, choice in fixed.items()}
    acc.best_width = max(acc.width_rates, key=lambda k: (acc.width_rates[k], -k))
    acc.best_rate = acc.width_rates[acc.best_width]

    acc.oracle_rate, oracle = _oracle(priced, acc.fit, rate, acc.best_rate)
    acc.by_load = _rows_by_load(priced, realised, fixed[acc.best_width], oracle)
    return acc


def _oracle(priced: list[StepView], fit: list[float], rate, start: float) -> tuple[float, list[list[int]]]:
    """The per-step oracle: at a rate rho (tokens per ms), each round of a step takes the width
    whose tokens beat the rows' price at the step's cells by the most; iterate rho to the rate those
    widths give (from ``start``, tokens/s). Returns its rate in tokens/s and its widths."""
    _, t1, _, t3 = fit

    def best_widths(v: StepView, rho: float) -> list[int]:
        price = rho * (t1 + t3 * v.cells)  # tokens a row must buy at this step's cells
        out = []
        for a, cap, _ in v.rounds:
            reach = min(len(a), cap)
            out.append(max(range(1, reach + 1), key=lambda w: (a[w - 1] - price * w, -w)))
        return out

    rho = start / 1e3
    for _ in range(50):
        oracle = [best_widths(v, rho) for v in priced]
        new = rate(oracle) / 1e3
        if abs(new - rho) <= 1e-12 * rho:
            break
        rho = new
    return rho * 1e3, oracle


def _rows_by_load(priced: list[StepView], realised, best, oracle) -> dict[int, dict]:
    """Rows per request, by the step's number of requests: realised, at the best fixed width, the oracle's."""
    loads: dict[int, list] = defaultdict(lambda: [0, 0, 0, 0, 0])  # steps, rounds, realised, best, oracle rows
    for v, r, b, o in zip(priced, realised, best, oracle):
        c = loads[len(v.rounds)]
        c[0] += 1
        c[1] += len(v.rounds)
        c[2] += v.rows_of(r)
        c[3] += v.rows_of(b)
        c[4] += v.rows_of(o)
    return {n: {"steps": c[0], "realised": c[2] / c[1], "best_width": c[3] / c[1], "oracle": c[4] / c[1]}
            for n, c in loads.items()}
