"""Drive fresh learners through a round log and measure them (DESIGN.md: replay must reproduce the
live state; paper Table 2, Figure 10 and Table 7).

A learning arm's rounds are replayed in order, each exactly as the live run did it: the round is
decided again from the record's own inputs by the live round's code (scheduler.decide_round: the
acceptance model prices the candidates from their features, they are ordered, the width policy
chooses), then the learners learn from the record (Learners.learn). So the learners' final state
equals the live one, and a re-priced q, a re-ordered tree or a re-decided width that differs from
the log means the log and the learners disagree: replay says so.

The report is computed on the way, from what replay observes:

- Table 2 (acceptance prediction): per request the log loss per labelled node of the head-based
  estimate and of the fitted model, each scored on a round's labels before either learned from
  them; the requests the fitted model wins (every request after the first that did not reach the
  token cap); the share of rounds with candidates the fitted model priced.
- Figure 10 (calibration): over the rounds whose width the chooser set from S, realised accepted
  nodes over the expected S at the chosen width, overall and in ten equal-count bins of S.
- Table 7 (what the n-gram fill adds): verified rows and accepted draft tokens by source
  (drafter-only, both sources, n-gram-only from the request's own text, n-gram memory of earlier
  requests), acceptance rates by source, the rounds with n-gram
  candidates and those whose verify the n-gram widened (the chooser takes a wider width than it
  does with the n-gram candidates priced at zero).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from adaspark_core.base import tree
from adaspark_core.base.tree import NGRAM
from adaspark_core.candidates.ngram import MEMORY
from adaspark_core.decode.batch import decide_step
from adaspark_core.decode.scheduler import Arm, RoundDecision, RoundPlan, decide_round, parse_arm
from adaspark_core.learn.acceptance import FITTED
from adaspark_core.learn.chooser import expected_sums
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import RoundRecord

BINS = 10


class ReplayMismatch(ValueError):
    pass


@dataclass
class RequestStats:
    request: str
    nodes: int = 0
    head_loss: float = 0.0
    fitted_loss: float = 0.0
    rounds: int = 0
    tree_rounds: int = 0  # rounds with candidates
    fitted_rounds: int = 0  # of those, priced by the fitted model
    finish: str | None = None
    sampled: bool = False  # a sampled request (its rounds teach the sampled regime)


@dataclass
class Report:
    requests: list[RequestStats] = field(default_factory=list)
    calibration: list[tuple[float, int]] = field(default_factory=list)  # (S at the width, accepted)
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NODE_CLASSES, 0))
    accepted: dict[str, int] = field(default_factory=lambda: dict.fromkeys(NODE_CLASSES, 0))
    ngram_rounds: int = 0
    widened: int = 0
    # (request, round) -> the chooser's own argmax without the margin, on its state before the
    # round (adaptive rounds it priced): what the regret account's "holding" is measured against.
    model_choices: dict = field(default_factory=dict)
    # requests in a batched step -> widths of its learning rounds -> rounds (decode/batch.py)
    batched: dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))
    # requests in a batched step -> where its time went, summed over its steps (those that
    # carried prompt tokens only counted: their decode is mostly the prompt's)
    step_times: dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))

    def to_json(self) -> dict:
        """Every quantity of the report as plain JSON."""
        reqs = [{"request": r.request, "sampled": r.sampled, "nodes": r.nodes, "finish": r.finish, "rounds": r.rounds,
                 "tree_rounds": r.tree_rounds, "fitted_rounds": r.fitted_rounds,
                 "head_loss": _per(r.head_loss, r.nodes), "fitted_loss": _per(r.fitted_loss, r.nodes),
                 "change": _change(r)} for r in self.requests]
        scored = self.scored()
        nodes = sum(r.nodes for r in scored)
        tree_rounds = sum(r.tree_rounds for r in self.requests)
        first = self.requests[0] if self.requests else None
        return {
            "acceptance": {
                "requests": reqs,
                "scored_requests": len(scored),
                "nodes": nodes,
                "head_loss": _per(sum(r.head_loss for r in scored), nodes),
                "fitted_loss": _per(sum(r.fitted_loss for r in scored), nodes),
                # a win is a lower loss beyond float noise: with every weight still at its prior
                # the two estimates can agree to the last bits
                "requests_won": sum(1 for r in scored if r.nodes and r.fitted_loss < r.head_loss * (1 - 1e-9)),
                "priced_share": _per(sum(r.fitted_rounds for r in self.requests), tree_rounds),
                "first_request": {"fitted_rounds": first.fitted_rounds, "tree_rounds": first.tree_rounds} if first else None,
            },
            "calibration": self.calibration_json(),
            "ngram": self.ngram_json(),
            "batched": {str(n): {"rounds": sum(c.values()), "mean_width": sum(w * k for w, k in c.items()) / sum(c.values()),
                                 "widths": {str(w): k for w, k in sorted(c.items())}}
                        for n, c in sorted(self.batched.items())},
            "step_times": {str(n): _step_means(c) for n, c in sorted(self.step_times.items())},
        }

    def scored(self) -> list[RequestStats]:
        """Table 2's requests: every request after the first that did not reach the token cap."""
        return [r for r in self.requests[1:] if r.finish != "length"]

    def calibration_json(self) -> dict:
        pts = sorted(self.calibration)
        expected = sum(s for s, _ in pts)
        realised = sum(a for _, a in pts)
        bins = []
        for i in range(min(BINS, len(pts))):
            part = pts[i * len(pts) // min(BINS, len(pts)) : (i + 1) * len(pts) // min(BINS, len(pts))]
            e, a = sum(s for s, _ in part), sum(x for _, x in part)
            bins.append({"rounds": len(part), "mean_expected": e / len(part), "mean_accepted": a / len(part),
                         "ratio": _per(a, e)})
        return {"rounds": len(pts), "expected": expected, "accepted": realised,
                "ratio": _per(realised, expected), "bins": bins}

    def ngram_json(self) -> dict:
        rows, acc = self.rows, self.accepted
        total_rows, total_acc = sum(rows.values()), sum(acc.values())
        return {
            "rows": dict(rows), "accepted": dict(acc),
            "rows_share_ngram": _per(rows["ngram"], total_rows),
            "accepted_share_ngram": _per(acc["ngram"], total_acc),
            "accepted_share_both": _per(acc["both"], total_acc),
            "rows_share_memory": _per(rows["memory"], total_rows),
            "accepted_share_memory": _per(acc["memory"], total_acc),
            "acceptance_rate": {k: _per(acc[k], rows[k]) for k in rows},
            "rounds_with_ngram": self.ngram_rounds,
            "rounds_widened": self.widened,
            "widened_share": _per(self.widened, self.ngram_rounds),
        }


def _per(a: float, b: float) -> float | None:
    return a / b if b else None


def _change(r: RequestStats) -> float | None:
    """1 - fitted / head-based log loss (Figure 4: above 0, the fitted model predicted better)."""
    return 1.0 - r.fitted_loss / r.head_loss if r.nodes and r.head_loss > 0 else None


NODE_CLASSES = ("drafter", "both", "ngram", "memory")


def node_class(c: dict) -> str:
    """Table 7's class of a node: a drafter's alone, one both sources proposed, an n-gram node
    from the request's own text, or one from the n-gram memory of earlier requests."""
    if c["source"] == NGRAM:
        return "memory" if c["kind"] == MEMORY else "ngram"
    return "both" if c["agreed"] else "drafter"


def replay(records: Iterable[RoundRecord], learners: Learners | None = None,
           check: bool = True) -> tuple[Learners, Report]:
    """Feed the records of learning arms to ``learners`` (fresh by default), a sampled request's
    to their sampled regime (``Learners.regime``, made at the first as the live run made it);
    return them and the report. ``check``: raise ReplayMismatch where replay and the log
    disagree."""
    learners = learners or Learners()
    report = Report()
    req: RequestStats | None = None
    open_reqs: dict[str, RequestStats] = {}  # requests decoded together, by id
    for group in _decided_together(records):
        if group[0].step is not None:
            _time_step(group, report)
            _replay_step(group, learners, report, open_reqs, check)
            continue
        rec = group[0]
        arm = parse_arm(rec.arm)
        if not arm.learns:
            continue
        regime = learners.regime(rec.sampling is not None)  # as the live request chose it
        if rec.first or req is None or rec.request != req.request:
            regime.start_request()
            req = RequestStats(rec.request, sampled=rec.sampling is not None)
            report.requests.append(req)
        req.rounds += 1
        chooser_before = copy.copy(regime.policy.chooser)  # choose() rebinds its two fields only
        d_ms = regime.policy.cost.d_now()
        # The decision prices copies of the candidates: the record keeps the q the run logged.
        priced = [dict(c) for c in rec.candidates]
        dec = decide_round(priced, rec.context, rec.p_src, arm, _max_rows(rec, arm), regime)
        if check:
            _check(rec, priced, dec)
        if priced:
            req.tree_rounds += 1
            req.fitted_rounds += dec.priced == FITTED
        if dec.favourite is not None:
            report.model_choices[(rec.request, rec.round)] = dec.favourite
        # Learned from the priced copies: the acceptance model reuses the estimate it just made for
        # exactly these dicts (as the live round does) instead of pricing the round again.
        score = regime.learn(dataclasses.replace(rec, candidates=priced))
        req.nodes += score.nodes
        req.head_loss += score.head_loss
        req.fitted_loss += score.fitted_loss
        if rec.last:
            req.finish = rec.finish
        _observe(report, rec, arm, chooser_before, d_ms)
    return learners, report


def _decided_together(records: Iterable[RoundRecord]) -> Iterator[list[RoundRecord]]:
    """The records in the groups the live run decided them in: a round verified alone by itself,
    a batched step's rounds together (consecutive in the log: a step's rounds are all learned and
    logged before the next step decides)."""
    group: list[RoundRecord] = []
    for rec in records:
        if group and (rec.step is None or group[0].step is None or _step_key(rec) != _step_key(group[0])):
            yield group
            group = []
        group.append(rec)
    if group:
        yield group


def _step_key(rec: RoundRecord) -> tuple:
    return rec.step.get("batch"), rec.step["id"]


def _time_step(group: list[RoundRecord], report: Report) -> None:
    """Add a batched step's times to its load's sums: llama_decode, and the host's share (every
    request's proposing and deciding, the engine's batch build and argmax read, the commits, the
    learning of its rounds, which runs at the next step). A step that carried prompt tokens is
    only counted: its decode is mostly the prompt's."""
    lead = next((r for r in group if r.step.get("lead")), group[0])
    c = report.step_times[lead.step["requests"]]
    if lead.step.get("prefill"):
        c["prefill_steps"] += 1
        return
    c["steps"] += 1
    c["decode"] += lead.times.decode
    c["plan"] += lead.step["draft"]
    c["engine"] += lead.times.verify - lead.times.decode
    c["commit"] += sum(r.times.commit for r in group)
    c["learn"] += sum(r.times.learn for r in group)


def _step_means(c: Counter) -> dict:
    """Milliseconds per step of each part (``ms``, in the step's order), and the host's share of
    the step, over the steps without prompt tokens (``prefill_steps`` counts the others)."""
    n = c["steps"]
    parts = ("decode", "plan", "engine", "commit", "learn")
    total = sum(c[p] for p in parts)
    return {"steps": n, "prefill_steps": c["prefill_steps"], "ms": {p: c[p] / n if n else None for p in parts},
            "host_share": (total - c["decode"]) / total if total else None}


def _replay_step(group: list[RoundRecord], learners: Learners, report: Report,
                 open_reqs: dict[str, RequestStats], check: bool) -> None:
    """A batched step: every learning round decided as the step decided them (``decide_step``, in
    the requests' order, each regime's apart), then learned from in the log's order."""
    group = [rec for rec in group if parse_arm(rec.arm).learns]
    if not group:
        return
    # Requests that began since the last step begin before this one decides, as they did live
    # (step["began"]; a log older than chunked prefill began each at its first round's step).
    began = group[0].step.get("began")
    if began is None:
        began = [[rec.request, rec.sampling is not None] for rec in group if rec.first]
    for request, sampled in began:
        learners.regime(sampled).start_request(request, alone=False)
    for rec in group:
        if rec.first:
            open_reqs[rec.request] = RequestStats(rec.request, sampled=rec.sampling is not None)
            report.requests.append(open_reqs[rec.request])
    ordered = sorted(group, key=lambda r: r.step["index"])
    priced_of: dict[int, list[dict]] = {}
    for sampled in (False, True):
        recs = [r for r in ordered if (r.sampling is not None) == sampled]
        if not recs:
            continue
        regime = learners.regime(sampled)
        plans = [RoundPlan(r.round, 0.0, 0.0, r.anchor, r.context, [], [dict(c) for c in r.candidates], r.p_src,
                           r.step["max_rows"]) for r in recs]
        decisions = decide_step(plans, [parse_arm(r.arm) for r in recs], regime, recs[0].step["cells"],
                                lambda k, recs=recs, regime=regime: regime.use(recs[k].request))
        for r, plan, dec in zip(recs, plans, decisions):
            if check:
                _check(r, plan.cand_dicts, dec)
            priced_of[id(r)] = plan.cand_dicts
    for rec in group:
        regime = learners.regime(rec.sampling is not None)
        regime.use(rec.request)
        req = open_reqs[rec.request]
        req.rounds += 1
        req.tree_rounds += bool(rec.candidates)
        req.fitted_rounds += bool(rec.candidates) and rec.priced == FITTED
        chooser_before = copy.copy(regime.policy.chooser)
        d_ms = regime.policy.cost.d_now()
        score = regime.learn(dataclasses.replace(rec, candidates=priced_of[id(rec)]))
        req.nodes += score.nodes
        req.head_loss += score.head_loss
        req.fitted_loss += score.fitted_loss
        if rec.last:
            req.finish = rec.finish
            open_reqs.pop(rec.request, None)
        report.batched[rec.step["requests"]][rec.width] += 1
        _observe(report, rec, parse_arm(rec.arm), chooser_before, d_ms)


def _max_rows(rec: RoundRecord, arm: Arm) -> int:
    """The most rows the live round could verify, as far as its record tells: an adaptive arm's
    widest offered width (the widths it offers are every table width within the bound, or the
    priced ones among them, so a bound anywhere up to the next width decides alike); a fixed
    arm's verified width (the record does not say whether the context capped it, so its width is
    not checked, only its order)."""
    if arm.adaptive:
        return max(rec.offered) if rec.offered else 1
    return rec.width


def _check(rec: RoundRecord, priced: list[dict], dec: RoundDecision) -> None:
    """ReplayMismatch unless replay decided the round as the log says the run did."""
    where = f"request {rec.request} round {rec.round}"
    if dec.priced != rec.priced or any(not math.isclose(p["q"], c["q"], rel_tol=1e-12, abs_tol=1e-15)
                                       for p, c in zip(priced, rec.candidates)):
        raise ReplayMismatch(f"{where}: replay priced the candidates differently ({dec.priced}; the log has {rec.priced})")
    if dec.order != rec.order:
        raise ReplayMismatch(f"{where}: replay ordered the candidates differently")
    if dec.width != rec.width or dec.measure != rec.measure:
        raise ReplayMismatch(f"{where}: replay chose width {dec.width} (measuring {dec.measure}); the log has "
                             f"{rec.width} (measuring {rec.measure})")


def expected_accepted(rec: RoundRecord) -> float | None:
    """S of the verified tree under the round's q (Eq. 1), for a round whose width the chooser set
    from S (an adaptive arm past cold start); None for any other round (Figure 10's rule)."""
    if not rec.candidates or rec.prices is None or rec.measure is not None or not parse_arm(rec.arm).adaptive:
        return None
    cands = rec.candidates
    big_q = tree.products([c["parent"] for c in cands], [c["q"] for c in cands])
    return sum(big_q[j] for j in rec.rows[1:])


def _observe(report: Report, rec: RoundRecord, arm, chooser, d_ms: float) -> None:
    """Figure 10 and Table 7 quantities of one round."""
    cands = rec.candidates
    if not cands:
        return
    for j in rec.rows[1:]:
        report.rows[node_class(cands[j])] += 1
    for j in rec.path:
        report.accepted[node_class(cands[j])] += 1
    has_ngram = any(c["source"] == NGRAM for c in cands)
    report.ngram_rounds += has_ngram
    s = expected_accepted(rec)
    if s is None:
        return
    report.calibration.append((s, len(rec.path)))
    if has_ngram and rec.step is None:  # a batched round's prices are its step's
        # The same decision with the n-gram candidates priced at zero (they and every node below
        # them drop to the end of the order), on the chooser as it was before this round.
        zq = [0.0 if c["source"] == NGRAM else c["q"] for c in cands]
        zeroed = [{**c, "q": q} for c, q in zip(cands, zq)]
        zbig = tree.products([c["parent"] for c in cands], zq)
        zorder = tree.best_first(zbig)
        prices = dict(zip(rec.offered, rec.prices))
        ahead = chooser.lookahead(zeroed, zorder, prices, d_ms, rec.context)
        without, _ = chooser.choose(prices, expected_sums(zeroed, zorder, zbig), d_ms, rec.context, ahead)
        report.widened += rec.width > without
