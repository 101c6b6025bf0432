"""Drive fresh learners through a round log and measure them (DESIGN.md: replay must reproduce the
live state; paper Table 2, Figure 10 and Table 7).

A learning arm's rounds are replayed in order, each exactly as the live run did it: the round is
decided again from the record's own inputs by the live round's code (round.decide_round: the
acceptance model prices the candidates from their features, they are ordered, the width policy
chooses), then the learners learn from the record (Learners.learn). So the learners' final state
equals the live one, and a re-priced q, a re-ordered tree or a re-decided width that differs from
the log means the log and the learners disagree: replay says so.

Replay feeds the learners only what they can learn exactly (``_Whole``): a request's rounds from
its beginning on, a batched step whole. A log that starts mid-request (``tail``), lacks a
request's rounds or a step's, or names a request that never began is replayed from where it is
whole again, and the report counts what was left out (``Report.skipped``); learners that did not
see it cannot be the run's, which a check or a comparison with the run's store then says.

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
import functools
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from adaspark_core.base import tree
from adaspark_core.base.errors import InputError
from adaspark_core.base.tree import NGRAM, PICK
from adaspark_core.candidates.ngram import MEMORY
from adaspark_core.decode.arms import Arm, parse_arm
from adaspark_core.decode.batch import decide_step
from adaspark_core.decode.generation import RoundPlan
from adaspark_core.decode.round import RoundDecision, decide_round, draft_rule
from adaspark_core.learn.acceptance import FITTED
from adaspark_core.learn.chooser import expected_sums
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import RoundRecord

BINS = 10


class ReplayMismatch(ValueError):
    pass


class ReplayRefused(ValueError):
    """A log replay cannot go through (an arm this version does not know): the message says why."""


@dataclass
class Skipped:
    """The rounds replay left out (``_Whole``): how many, of which requests, the first and why."""

    rounds: int = 0
    requests: set = field(default_factory=set)
    first: str = ""

    def add(self, recs: list[RoundRecord], why: str) -> None:
        if not self.rounds:
            self.first = why
        self.rounds += len(recs)
        self.requests.update(r.request for r in recs)

    def __bool__(self) -> bool:
        return self.rounds > 0

    def __str__(self) -> str:
        n, m = self.rounds, len(self.requests)
        return (f"skipped {n} round{'s' * (n != 1)} of {m} request{'s' * (m != 1)} that the log does not hold "
                f"whole (the first, {self.first})")


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
    skipped: Skipped = field(default_factory=Skipped)  # rounds not replayed: the log lacks what they need

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
    return them and the report. Rounds the log does not hold whole are left out and counted
    (``Report.skipped``). ``check``: raise ReplayMismatch where replay and the log disagree."""
    learners = learners or Learners()
    report = Report()
    whole = _Whole()
    try:
        _replay(records, learners, report, whole, check)
    except ReplayMismatch as e:
        if not whole.skipped:
            raise
        raise ReplayMismatch(f"{e}; before it, replay {whole.skipped}, which the run's learners learned from") from None
    report.skipped = whole.skipped
    return learners, report


def _replay(records: Iterable[RoundRecord], learners: Learners, report: Report, whole: "_Whole", check: bool) -> None:
    req: RequestStats | None = None
    open_reqs: dict[str, RequestStats] = {}  # requests decoded together, by id
    for group in _decided_together(records):
        if group[0].step is not None:
            # Requests that began since the last step begin before this one decides, as they did
            # live (its step's ``began``), also where the step itself is left out: their state starts there.
            began, replayed = whole.step(group)
            for request, sampled in began:
                learners.regime(sampled).start_request(request, alone=False)
            if replayed:
                _time_step(group, report)
                _replay_step(group, learners, report, open_reqs, check)
            continue
        rec = group[0]
        if not whole.lone(rec):
            continue
        arm = _arm(rec)
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
        if check and arm.adaptive:
            _check_depth(rec, regime)
        # The decision prices copies of the candidates: the record keeps the q the run logged.
        priced = [dict(c) for c in rec.candidates]
        dec = decide_round(priced, rec.context, rec.p_src, arm, _max_rows(rec, arm), regime, rec.constrained)
        if check:
            _check(rec, priced, dec)
        if priced:
            req.tree_rounds += 1
            req.fitted_rounds += dec.priced == FITTED
        if dec.choice.favourite is not None:
            report.model_choices[(rec.request, rec.round)] = dec.choice.favourite
        # Learned from the priced copies: the acceptance model reuses the estimate it just made for
        # exactly these dicts (as the live round does) instead of pricing the round again.
        score = regime.learn(dataclasses.replace(rec, candidates=priced))
        req.nodes += score.nodes
        req.head_loss += score.head_loss
        req.fitted_loss += score.fitted_loss
        if rec.last:
            req.finish = rec.finish
        _observe(report, rec, arm, chooser_before, d_ms)


def whole_rounds(records: Iterable[RoundRecord]) -> tuple[list[RoundRecord], Skipped]:
    """The records replay would replay, every arm's (``_Whole``), and what it would leave out: the
    rounds a hindsight account can take as the run had them."""
    whole = _Whole()
    kept: list[RoundRecord] = []
    for group in _decided_together(records):
        if (whole.step(group)[1] if group[0].step is not None else whole.lone(group[0])):
            kept += group
    return kept, whole.skipped


class _Absent:
    """A field one side of a comparison lacks (``state_differences``)."""

    def __repr__(self) -> str:
        return "(absent)"


ABSENT = _Absent()


def state_differences(a, b, where: str = "") -> Iterator[tuple[str, object, object]]:
    """(dotted path, a's value, b's) wherever two JSON values differ, in ``a``'s order, then
    ``b``'s fields ``a`` lacks (ABSENT on the side that lacks one). Exact: replay reproduces the
    run's learners bit for bit, so a float off in its last bit is a difference, and so is 1 for 1.0."""
    if type(a) is dict and type(b) is dict:
        for k in [*a, *(k for k in b if k not in a)]:
            yield from state_differences(a.get(k, ABSENT), b.get(k, ABSENT), f"{where}.{k}" if where else str(k))
    elif type(a) is list and type(b) is list and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            yield from state_differences(x, y, f"{where}.{i}")
    elif type(a) is not type(b) or a != b:
        yield where, a, b


@functools.lru_cache(maxsize=256)
def _parse_arm(name: str) -> Arm:
    return parse_arm(name)


def _arm(rec: RoundRecord) -> Arm:
    """The record's arm; ReplayRefused, naming the round, for a name this version does not know."""
    try:
        return _parse_arm(rec.arm)
    except InputError as e:
        raise ReplayRefused(f"request {rec.request} round {rec.round}: {e}") from None


@dataclass(frozen=True, slots=True)
class _Held:
    """A request all of whose rounds so far were replayed: what its next round must be to follow."""

    round: int
    arm: str | bool  # its arm; before its first round (admitted in a step), whether the step's arm learns
    sampled: bool
    batched: bool

    def gap(self, rec: RoundRecord) -> str | None:
        """Why ``rec`` cannot be its next round; None if it can."""
        if self.round != rec.round:
            return f"its round {self.round} is not in the log"
        if self.round == 0 and not rec.first:  # (admitted in a step: its round 0 is its first)
            return "its round 0 is not marked as its first"
        if self.batched != (rec.step is not None):
            return "its earlier rounds were verified " + ("together with other requests'" if self.batched else "alone")
        if self.sampled != (rec.sampling is not None) or (
                self.arm != rec.arm if isinstance(self.arm, str) else self.arm != _arm(rec).learns):
            return "its arm or its sampling differs from its earlier rounds'"
        return None


class _Whole:
    """Which of a log's rounds replay can feed the learners as the run did, in the log's order.

    A request's learner state (the acceptance model's intercept, offset and rounds waiting for
    their hindsight labels) is built from every round since it began: its first round, or, in a
    batched log, its admission (``step.began``, steps before its first round). So a round is
    replayed only if every earlier round of its request was, alike (arm, regime, alone or not).
    A batched step's rounds were decided together (``decide_step``), so a step is replayed whole
    or not at all: one that lacks a round (a line cut, a request's lines taken out, a request
    renamed) is left out, and with it every later round of its requests, whose state then lacks
    one. A request whose beginning is not in the log is left out until it ends. Requests
    alone and requests together do not share the per-request state: one alone that begins ends
    every open batched one's (AcceptanceModel.start_request), one admitted to a step moves the
    current state off an open lone one. What is left out is counted in ``skipped``."""

    def __init__(self):
        self.held: dict[str, _Held] = {}
        self.skipped = Skipped()

    def lone(self, rec: RoundRecord) -> bool:
        """Whether a round verified alone is replayed."""
        held = self.held.pop(rec.request, None)
        why = None if rec.first else "the log does not hold its earlier rounds" if held is None else held.gap(rec)
        if why is not None:
            self.skipped.add([rec], f"request {rec.request} round {rec.round}: {why}")
            return False
        if _arm(rec).learns:
            self._drop(batched=True)
        if not rec.last:
            self.held[rec.request] = _Held(rec.round + 1, rec.arm, rec.sampling is not None, False)
        return True

    def step(self, group: list[RoundRecord]) -> tuple[list[list], bool]:
        """A batched step: the [request, sampled] of the requests whose learner state begins at
        it (those of a learning arm), and whether the step is replayed."""
        s = group[0].step
        learning = any(_arm(r).learns for r in group)
        began = s.began
        if began is None:  # a log older than chunked prefill: each began at its first round's step
            began = [[r.request, r.sampling is not None] for r in group if r.first]
        if learning and began:
            self._drop(batched=False)
        for request, sampled in began:
            self.held[request] = _Held(0, learning, sampled, True)
        where = f"step {s.batch}/{s.id}"
        n = s.requests
        why = None
        if len(group) != n or {r.step.index for r in group} != set(range(n)):
            why = f"{where} has {len(group)} of its {n} rounds"
        elif learning and len({r.arm for r in group}) > 1:
            why = f"{where} mixes arms"
        for r in group if why is None else ():
            held = self.held.get(r.request)
            gap = "the log does not hold its earlier rounds" if held is None else held.gap(r)
            if gap is not None:
                why = f"{where}, request {r.request} round {r.round}: {gap}"
                break
        for r in group:
            if why is not None or r.last:
                self.held.pop(r.request, None)
            else:
                self.held[r.request] = _Held(r.round + 1, r.arm, r.sampling is not None, True)
        if why is not None:
            self.skipped.add(group, why)
        return (began if learning else []), why is None

    def _drop(self, batched: bool) -> None:
        for request in [k for k, h in self.held.items() if h.batched == batched]:
            del self.held[request]


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
    return rec.step.batch, rec.step.id


def _time_step(group: list[RoundRecord], report: Report) -> None:
    """Add a batched step's times to its load's sums: llama_decode, and the host's share (every
    request's proposing and deciding, the engine's batch build and argmax read, the commits, the
    learning of its rounds, which runs at the next step). A step that carried prompt tokens is
    only counted: its decode is mostly the prompt's."""
    lead = next((r for r in group if r.step.lead), group[0])
    c = report.step_times[lead.step.requests]
    if lead.step.prefill:
        c["prefill_steps"] += 1
        return
    c["steps"] += 1
    c["decode"] += lead.times.decode
    c["plan"] += lead.step.draft
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
    """A batched step, whole (``_Whole``; its requests begun): every learning round decided as the
    step decided them (``decide_step``, in the requests' order, each regime's apart), then
    learned from in the log's order."""
    if not _arm(group[0]).learns:  # a step's requests share their learning arm, or none learns
        return
    for rec in group:
        if rec.first:
            open_reqs[rec.request] = RequestStats(rec.request, sampled=rec.sampling is not None)
            report.requests.append(open_reqs[rec.request])
    ordered = sorted(group, key=lambda r: r.step.index)
    priced_of: dict[int, list[dict]] = {}
    for sampled in (False, True):
        recs = [r for r in ordered if (r.sampling is not None) == sampled]
        if not recs:
            continue
        regime = learners.regime(sampled)
        plans = [RoundPlan(r.round, 0.0, 0.0, r.anchor, r.context, [], [dict(c) for c in r.candidates], r.p_src,
                           r.step.max_rows, constrained=r.constrained) for r in recs]
        decisions = decide_step(plans, [_arm(r) for r in recs], regime, recs[0].step.cells,
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
        report.batched[rec.step.requests][rec.width] += 1
        _observe(report, rec, _arm(rec), chooser_before, d_ms)


def _max_rows(rec: RoundRecord, arm: Arm) -> int:
    """The most rows the live round could verify, as far as its record tells: an adaptive arm's
    widest offered width (the widths it offers are every table width within the bound, or the
    priced ones among them, so a bound anywhere up to the next width decides alike); a fixed
    arm's verified width (the record does not say whether the context capped it, so its width is
    not checked, only its order)."""
    if arm.adaptive:
        return max(rec.decision.offered, default=1)
    return rec.width


def _check(rec: RoundRecord, priced: list[dict], dec: RoundDecision) -> None:
    """ReplayMismatch unless replay decided the round as the log says the run did."""
    where = f"request {rec.request} round {rec.round}"
    if dec.priced != rec.priced or any(not math.isclose(p["q"], c["q"], rel_tol=1e-12, abs_tol=1e-15)
                                       for p, c in zip(priced, rec.candidates)):
        raise ReplayMismatch(f"{where}: replay priced the candidates differently ({dec.priced}; the log has {rec.priced})")
    if dec.order != rec.order:
        raise ReplayMismatch(f"{where}: replay ordered the candidates differently")
    ours, logged = dec.choice, rec.decision
    if ours.width != logged.width or ours.measure != logged.measure:
        raise ReplayMismatch(f"{where}: replay chose width {ours.width} (measuring {ours.measure}); the log has "
                             f"{logged.width} (measuring {logged.measure})")


def _check_depth(rec: RoundRecord, learners: Learners) -> None:
    """ReplayMismatch unless the depth learner, asked again before each forward of the round's
    draft (round.draft_rule, from the picks' h in the record), drafts as deep as the run did:
    on at every position it drafted, off at the one it stopped before (if the block's limit did
    not stop it). Where an end token cut the draft's last picks, only the positions before it."""
    dr = rec.drafting
    if dr is None or dr.limit == 0:
        return
    go_on = draft_rule(learners, rec.context, dr.max_rows)
    hs = [c["h"] for c in sorted((c for c in rec.candidates if c["source"] == PICK), key=lambda c: c["depth"])]
    depth = len(dr.forwards)
    for i in range(min(depth, len(hs)) + 1):
        if i == dr.limit:  # the block's limit stopped it: go_on was not asked
            break
        if go_on(hs[:i], dr.limit) != (i < depth):
            raise ReplayMismatch(f"request {rec.request} round {rec.round}: replay drafts {'past' if i == depth else 'only'} "
                                 f"{i} positions; the log has {depth}")


def expected_accepted(rec: RoundRecord) -> float | None:
    """S of the verified tree under the round's q (Eq. 1), for a round whose width the chooser set
    from S (an adaptive arm past cold start); None for any other round (Figure 10's rule)."""
    dec = rec.decision
    if not rec.candidates or dec.prices is None or dec.measure is not None or not _arm(rec).adaptive:
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
        prices = rec.decision.prices
        ahead = chooser.lookahead(zeroed, zorder, prices, d_ms, rec.context)
        without, _ = chooser.choose(prices, expected_sums(zeroed, zorder, zbig), d_ms, rec.context, ahead)
        report.widened += rec.width > without
