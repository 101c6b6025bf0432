"""Requests decoded together: each step, one verify holds every active request's tree.

llama-server's continuous batching, with trees and widths chosen for the whole step. A step
drives every request's round through the steps a lone round takes (decode/generation.py): each
learns from its previous round (in the requests' order) and proposes; ``decide_step`` decides them
together; one verify holds all their rows on the engine's slots (``LlamaBatch.verify``: one
llama_decode); each completes its own round (accept, commit, record); the caller streams what each
emitted. Requests join (``add``) and
leave (finished, or ``drop``) between steps. A joining request's prompt goes into the next steps'
decodes in chunks, beside the running requests' rows (``LlamaTarget.start(defer=True)``), so it
never stalls them for its whole length; the request plans its first round once its slot has no
prompt left pending.

A request's failure is its own: one whose part of a step raises (logging its previous round on a
full disk, proposing, finishing its round, closing) leaves the batch (``fail``) and the others go
on; where the step's shared part raises (deciding a group's widths together, the verify), every
request that part held fails. Either way the failed request's uncommitted rows are taken off its
slot and it is closed as far as it can be, and it waits in ``failed`` for the caller to answer.

Exactness holds per request: a row's sequence ids are its own slot's, so it sees only its own
request's committed cells and its own ancestors, and each reply is the one its request decodes
alone, up to the kernels' near ties (paper 3.5).

Widths: a fixed arm takes its own. Requests of a learning arm are priced each by the acceptance
model with its own per-request state (``Learners.use``), and their widths are chosen together by
the width policy (``AdaptiveWidth.decide_step``): each row goes where it adds the most expected
tokens, and the step's rows are as many as maximise its expected tokens per millisecond, priced
by the cost model at all the step's cells. Each record carries its ``step``; the step's lead
record teaches the cost model what the step cost, and replay decides a step's requests together
before it learns from any of them, as the step did.
"""

from __future__ import annotations

import secrets
from dataclasses import replace
from typing import Callable

from adaspark_core.base.errors import InputError
from adaspark_core.base.tree import Layout
from adaspark_core.decode.generation import Generation, RoundPlan
from adaspark_core.decode.round import RoundDecision, decide_round, fitted_to, price_round
from adaspark_core.engine.base import Target, Verified
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import Step

# (slot, layout) of every request that verifies, and the slots whose prompts are still pending.
VerifyTogether = Callable[[list[tuple[Target, Layout]], list[Target]], list[Verified]]


def decide_step(plans: list[RoundPlan], arms, learners: Learners | None, cells: int,
                select: Callable[[int], None] = lambda i: None) -> list[RoundDecision]:
    """The decisions of one step's rounds, in the requests' order (the live step and replay both
    decide through here). ``cells``: every request's context in the step (each row attends all
    of them). ``select(i)``: make request i's per-request learner state current.
    Fixed arms decide alone; learning ones (one arm, one set of learners) are priced each and
    given widths together."""
    if learners is None or not arms[0].adaptive:
        out = []
        for i, (plan, arm) in enumerate(zip(plans, arms)):
            select(i)
            out.append(decide_round(plan.cand_dicts, plan.context, plan.p_src, arm, plan.max_rows, learners,
                                    plan.constrained))
        return out
    priced = []
    for i, (plan, arm) in enumerate(zip(plans, arms)):
        select(i)
        priced.append(price_round(plan.cand_dicts, plan.context, plan.p_src, arm, learners, plan.constrained))
    policy = learners.policy
    widths = policy.decide_step([(order, big_q) for _, order, big_q in priced], cells, policy.cost.d_now(),
                                [plan.max_rows for plan in plans])
    return [RoundDecision(p, order, fitted_to(w, len(plan.cand_dicts)))
            for (p, order, _), w, plan in zip(priced, widths, plans)]


class Batch:
    """The active requests of a set of slots and the steps that advance them all."""

    def __init__(self, verify: VerifyTogether):
        self.verify = verify
        self.active: list[Generation] = []
        self.steps = 0
        # The requests that began since the last step with rounds: the step's records name them
        # (``began``), and their learners' per-request state starts there in replay too (a
        # request begins steps before its first round while its prompt goes in). One that leaves
        # before any step names it is forgotten by the learners (Generation.announced).
        self._began: list[Generation] = []
        self.id = secrets.token_hex(4)  # tells this batch's steps from another run's in one log
        # Requests that left on a failure, with what raised, until the caller takes them
        # (``take_failed``); a request whose clean-up also raised is in it once more.
        self.failed: list[tuple[Generation, Exception]] = []

    def learn_previous_rounds(self) -> None:
        """Every active request's previous round learns and is logged (each step begins so).
        Call it before making a joining request's Generation: a first sampled request copies its
        regime from the learners as they are then (Learners.regime), and replay copies it once
        the previous step's rounds have all been learned. A request whose round cannot be learned
        or logged fails alone (``fail``)."""
        for gen in list(self.active):
            try:
                gen.learn_previous_round()
            except Exception as e:
                self.fail(gen, e)

    def add(self, gen: Generation) -> None:
        """``gen`` joins at the next step (its target a free slot of the engine): its prompt goes in
        with the next steps' decodes. A batch holds fixed arms, or requests of one learning arm on one set of
        learners (their regimes apart: a sampled request's are its own)."""
        if any(g.target is gen.target for g in self.active):
            raise ValueError("a slot serves one request at a time")
        if any(g.request_id == gen.request_id for g in self.active):
            raise ValueError(f"request id {gen.request_id} is already active")
        mine = [g for g in self.active if g.arm.learns or gen.arm.learns]
        if mine and any(g.arm != gen.arm for g in mine):
            raise InputError(f"arm {gen.arm.name} cannot join a batch of arm {mine[0].arm.name}: "
                             "requests decoded together learn with one arm")
        gen.begin(batched=True)
        self.active.append(gen)
        self._began.append(gen)

    def drop(self, gen: Generation, finish: str | None = None) -> None:
        """``gen`` leaves before its reply ended (its client went, a stop string cut it): its
        last round is marked with ``finish`` (Generation.end) and it is closed. What closing
        raises (the last round's log write) is raised, ``gen`` out of the batch all the same."""
        if finish is not None:
            gen.end(finish)
        self.active.remove(gen)
        self._leave(gen)
        gen.close()

    def fail(self, gen: Generation, error: Exception, layout: Layout | None = None) -> None:
        """``gen`` leaves on ``error`` and waits in ``failed``. ``layout``: the rows of a verify it
        may not have committed, taken off its slot, so that the slot's next request, which keeps
        the committed prefix (``reuse_prefix``), finds no stray tree cells past it. It is closed
        as far as it can be (Generation.close takes each record once: a round it already learned
        from is not learned again). A clean-up that raises is one more entry in ``failed``, never
        an exception: one request's failure must not keep the others from going on."""
        if gen in self.active:
            self.active.remove(gen)
        self._leave(gen)
        self.failed.append((gen, error))
        undo = [gen.close] if layout is None else [lambda: gen.target.discard(layout), gen.close]
        for part in undo:
            try:
                part()
            except Exception as e:
                self.failed.append((gen, e))

    def _leave(self, gen: Generation) -> None:
        """``gen`` leaves: if no step's records named it yet, none will (Generation.close forgets it)."""
        self._began = [g for g in self._began if g is not gen]

    def take_failed(self) -> list[tuple[Generation, Exception]]:
        """The requests that failed since the last call, each with what raised."""
        out, self.failed = self.failed, []
        return out

    def step(self) -> list[tuple[Generation, list[int]]]:
        """One round of every active request whose prompt is in, verified together, with the next
        chunks of the others' prompts in the same decode: (request, tokens it emitted), in the
        requests' order. A request whose reply ended is closed and leaves; one that failed is in
        ``failed`` instead (whose failure is whose: the module's docstring)."""
        if not self.active:
            return []
        self.learn_previous_rounds()  # every previous round learns before any request decides
        ready = [g for g in self.active if not g.target.pending]
        filling = [g for g in self.active if g.target.pending]
        t0 = ready[0].clock() if ready else 0.0
        plans = self._propose(ready)
        # Every row attends every cell in use: the verifying requests' contexts and the prompts
        # already in for the slots still filling.
        cells = sum(plan.context for plan in plans.values()) + sum(g.target.n_past for g in filling)
        self._decide(plans, cells)
        active = [g for g in plans if g in self.active]
        if not active and not filling:
            return []
        draft_ms = (active[0].clock() - t0) * 1e3 if active else 0.0
        waiting = sum(len(g.target.pending) for g in filling)
        try:
            verified = self.verify([(gen.target, plans[gen].layout) for gen in active], [g.target for g in filling])
        except Exception as e:  # one decode held them all: no request's part of it can be told apart
            for gen in active:
                self.fail(gen, e, plans[gen].layout)
            for gen in filling:
                self.fail(gen, e)
            return []
        if not active:
            return []
        out = []
        for i, (gen, ver) in enumerate(zip(active, verified)):
            try:
                out.append((i, gen, gen.complete(plans[gen], ver)))
            except Exception as e:
                self.fail(gen, e, plans[gen].layout)
        prefill = waiting - sum(len(g.target.pending) for g in filling)
        self._name_step(out, Step(self.id, self.steps, len(active), sum(plans[g].layout.width for g in active),
                                  cells, draft_ms, any(gen.finish is not None for _, gen, _ in out), index=0,
                                  lead=True, max_rows=1, prefill=prefill or None), plans)
        self.steps += 1
        for _, gen, _ in out:
            if gen.finish is not None:
                self.active.remove(gen)
                try:
                    gen.close()
                except Exception as e:  # its last round was not logged: the reply is not whole
                    self.fail(gen, e)
        failed = {gen for gen, _ in self.failed}
        return [(gen, emitted) for _, gen, emitted in out if gen not in failed]

    def _propose(self, ready: list[Generation]) -> dict[Generation, RoundPlan]:
        """Every ready request's candidates, in the requests' order (one that raises fails)."""
        plans: dict[Generation, RoundPlan] = {}
        for gen in ready:
            try:
                plans[gen] = gen.propose()
            except Exception as e:
                self.fail(gen, e)
        return plans

    def _decide(self, plans: dict[Generation, RoundPlan], cells: int) -> None:
        """Each group of requests that learn together (greedy and sampled apart: Learners.regime)
        decided together (``decide_step``); each plan gets its decision and layout."""
        groups: dict[int, list[Generation]] = {}
        for gen in plans:
            groups.setdefault(id(gen.learners), []).append(gen)
        for gens in groups.values():
            try:
                decisions = decide_step([plans[g] for g in gens], [g.arm for g in gens], gens[0].learners, cells,
                                        lambda k: gens[k].use_learners())
            except Exception as e:  # the group's widths were chosen together: none of them stands
                for gen in gens:
                    self.fail(gen, e)
                continue
            for gen, dec in zip(gens, decisions):
                try:
                    plans[gen] = gen.decided(plans[gen], dec)
                except Exception as e:
                    self.fail(gen, e)

    def _name_step(self, out: list[tuple[int, Generation, list[int]]], step: Step,
                   plans: dict[Generation, RoundPlan]) -> None:
        """Each completed round's record gets the step (``step``: its shared fields), with its own
        place in it; the records name the requests that began since the last step with rounds."""
        if not out:  # no record to name them (every round failed): the next step's will
            return
        step.began = [[g.request_id, g.sampling is not None] for g in self._began]
        for g in self._began:
            g.announced = True
        self._began = []
        for i, gen, _ in out:  # ``index``: the place in the step's verify, a request that failed there counted
            gen.last_record.step = replace(step, index=i, lead=i == 0, max_rows=plans[gen].max_rows)
