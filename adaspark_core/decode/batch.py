"""Requests decoded together: each step, one verify holds every active request's tree.

llama-server's continuous batching, with trees. A step settles every request's previous round
(learned and logged, in the requests' order), plans each request's round (propose, decide), runs
one verify of all their rows on the engine's slots (``LlamaBatch.verify``: one llama_decode), and
finishes each request's round on its own (accept, commit, record); the caller streams what each
emitted. Requests join (``add``) and leave (finished, or ``drop``) between steps; a joining
request's prompt is prefilled when it joins.

Exactness holds per request: a row's sequence ids are its own slot's, so it sees only its own
request's committed cells and its own ancestors, and each reply is the one its request decodes
alone, up to the kernels' near ties (paper 3.5; tests/decode/test_batch.py).

Learning arms do not batch yet: their learners keep per-request state (the acceptance model's
intercept and offset, its pending hindsight labels, the chooser's incumbent) that one request at a
time shares, and replay would have to decide a step's requests before learning any of them.
"""

from __future__ import annotations

from typing import Callable

from adaspark_core.base.errors import InputError
from adaspark_core.base.tree import Layout
from adaspark_core.decode.scheduler import Generation
from adaspark_core.engine.base import Target, Verified

VerifyTogether = Callable[[list[tuple[Target, Layout]]], list[Verified]]


class Batch:
    """The active requests of a set of slots and the steps that advance them all."""

    def __init__(self, verify: VerifyTogether):
        self.verify = verify
        self.active: list[Generation] = []
        self.steps = 0

    def add(self, gen: Generation) -> None:
        """``gen`` joins at the next step (its target a free slot of the engine): its prompt is
        prefilled now."""
        if gen.arm.learns:
            raise InputError(f"arm {gen.arm.name} learns while it decodes, which batched requests cannot do yet: "
                             "use a fixed arm (ar, chain:N, tree:N) or one request at a time")
        if any(g.target is gen.target for g in self.active):
            raise ValueError("a slot serves one request at a time")
        gen.begin()
        self.active.append(gen)

    def drop(self, gen: Generation, finish: str | None = None) -> None:
        """``gen`` leaves before its reply ended (its client went, a stop string cut it): its
        last round is marked with ``finish`` (Generation.end) and it is closed."""
        if finish is not None:
            gen.end(finish)
        self.active.remove(gen)
        gen.close()

    def step(self) -> list[tuple[Generation, list[int]]]:
        """One round of every active request, verified together: (request, tokens it emitted),
        in the requests' order. A request whose reply ended is closed and leaves."""
        if not self.active:
            return []
        for gen in self.active:  # every previous round learns before any request decides
            gen.settle()
        plans = [gen.next_plan() for gen in self.active]
        verified = self.verify([(gen.target, plan.layout) for gen, plan in zip(self.active, plans)])
        out = [(gen, gen.finish_round(plan, ver)) for gen, plan, ver in zip(self.active, plans, verified)]
        self.steps += 1
        for gen in [g for g in self.active if g.finish is not None]:
            self.active.remove(gen)
            gen.close()
        return out

    def close(self) -> None:
        """Every request still active ends, interrupted."""
        for gen in list(self.active):
            self.drop(gen)
