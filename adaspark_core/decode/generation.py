"""One request decoded round by round (``Generation``): the proposers (candidates/base.py) propose,
``round.decide_round`` prices, orders and picks the width, the target verifies, ``tree.accept_walk``
returns what was accepted, and the generation does the bookkeeping (stopping, commit, the
proposers told, statistics, the record; learning and the log once the round's tokens are out).
A round is five steps, driven alike by ``Generation.__iter__`` (a round verified alone) and by a
batched step (decode/batch.py, several requests' rounds in one verify): ``learn_previous_round``,
``propose``, ``decide`` (batched: ``batch.decide_step``, then ``decided``), the target's verify,
and ``complete``."""

from __future__ import annotations

import functools
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np

from adaspark_core.base import tree
from adaspark_core.base.errors import InputError
from adaspark_core.base.sampling import Sampling, draw
from adaspark_core.base.tree import Candidate
from adaspark_core.candidates.base import PicksOnly, Proposer, propose_round
from adaspark_core.candidates.memory import NgramMemory
from adaspark_core.candidates.ngram import KeptIndexes, NgramSource
from adaspark_core.decode.arms import Arm, Speculation
from adaspark_core.decode.grammar import Grammar, LazyGrammar
from adaspark_core.decode.round import (
    CONTEXT,
    INTERRUPTED,
    STOP,
    Draws,
    RoundDecision,
    decide_round,
    draft_rule,
    stop_cut,
)
from adaspark_core.engine.base import Target, Verified
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import Drafting, RoundLog, RoundRecord, Timing


@dataclass(slots=True)
class RoundPlan:
    """A round before its verify: what ``Generation.propose`` proposed and ``decide`` decided, and
    what ``Generation.complete`` needs after the verify."""

    rnd: int
    t0: float  # the round's start (clock)
    t_proposed: float  # proposing and deciding done: the drafter's and the tree's time, D
    anchor: int
    context: int  # committed tokens, the anchor included
    cands: list[Candidate]
    cand_dicts: list[dict]  # the record's candidates, priced (q set by decide_round)
    p_src: float | None
    max_rows: int  # the most rows this round may verify (the arm, the target, the context)
    drafting: Drafting | None = None  # a draft model's forwards
    constrained: bool = False  # decoded under a grammar (decode/grammar.py)
    decision: RoundDecision | None = None
    layout: tree.Layout | None = None  # the rows to verify, depth first


@dataclass(slots=True)
class Stats:
    """A reply's statistics. Decode speed is on the client clock: tokens emitted after the first
    delta over the time from the first delta to the last (the first delta's time includes the
    prefill, so it is the interval's start, not a token of it: the paper's rule, under which a
    reply that came as one delta has no speed).

    ``trace`` also keeps where the decode began (the first round's start, after the prefill), so
    the first-N ratio (evaluate/stats.py) can time a reply from there and count one that the
    first round emitted whole."""

    rounds: int = 0
    widths: Counter = field(default_factory=Counter)  # verified rows -> rounds
    accepted: Counter = field(default_factory=Counter)  # accepted draft tokens -> rounds
    t_decode: float | None = None  # the first round's start
    verify_ms: float = 0.0
    draft_ms: float = 0.0
    host_ms: float = 0.0
    deltas: list = field(default_factory=list)  # (tokens so far, clock) per delta

    def delta(self, n: int, now: float) -> None:
        if n > 0:
            self.deltas.append((self.generated + n, now))

    @property
    def generated(self) -> int:
        return self.deltas[-1][0] if self.deltas else 0

    @property
    def t_first(self) -> float | None:
        return self.deltas[0][1] if self.deltas else None

    def trace(self) -> list[tuple[int, float]]:
        """(tokens so far, seconds since the first delta) per delta, led by the decode's start,
        (0, its time before the first delta), where it is known."""
        if not self.deltas:
            return []
        t0 = self.t_first
        start = [(0, self.t_decode - t0)] if self.t_decode is not None else []
        return start + [(n, t - t0) for n, t in self.deltas]

    @property
    def decode_seconds(self) -> float:
        return self.deltas[-1][1] - self.deltas[0][1] if self.deltas else 0.0

    @property
    def decode_tps(self) -> float | None:
        span = self.decode_seconds
        return (self.generated - self.deltas[0][0]) / span if span > 0 else None

    @property
    def tokens_per_round(self) -> float:
        return self.generated / self.rounds if self.rounds else 0.0

    def to_json(self) -> dict:
        return {
            "generated_tokens": self.generated,
            "rounds": self.rounds,
            "decode_tok_s": self.decode_tps,
            "decode_seconds": self.decode_seconds,
            "tokens_per_round": self.tokens_per_round,
            "widths": {str(k): v for k, v in sorted(self.widths.items())},
            "accepted": {str(k): v for k, v in sorted(self.accepted.items())},
            "verify_ms": self.verify_ms,
            "draft_ms": self.draft_ms,
            "host_ms_per_round": self.host_ms / self.rounds if self.rounds else 0.0,
        }


class Generation:
    """One request decoded round by round, greedily, or with ``sampling`` by seeded draws that
    speculation cannot change (sampling.py; such rounds teach the sampled regime's learners,
    which the caller passes). Iterate it for the emitted tokens of each round (an empty list for a
    round that emitted nothing new, e.g. only the end token); after the loop ``finish``,
    ``stats`` and ``tokens`` describe the reply. Every round builds its
    RoundRecord (``last_record``), which the log and, later, the online learners consume."""

    def __init__(
        self,
        target: Target,
        prompt: list[int],
        spec: Speculation | Arm,
        max_tokens: int,
        request_id: str = "r0",
        log: RoundLog | None = None,
        clock: Callable[[], float] = time.perf_counter,
        drafter: Proposer | None = None,
        learners: Learners | None = None,
        sampling: Sampling | None = None,
        memory: NgramMemory | None = None,
        remember: bool = True,
        kept_indexes: KeptIndexes | None = None,
        grammar: Grammar | LazyGrammar | None = None,
    ):
        self.spec = Speculation.of(spec)
        arm = self.spec.arm
        _check_request(target, arm, prompt, max_tokens, drafter, sampling, grammar)
        self.target = target
        self._is_end = functools.lru_cache(maxsize=None)(target.is_eog)  # asked of every candidate's token
        self.arm = arm
        self.max_tokens = max_tokens
        self.request_id = request_id
        self.log = log
        self.clock = clock
        self.prompt = list(prompt)
        # A sampled request draws each row's token from the target's distribution with noise keyed
        # by (seed, position) (sampling.py), so speculation never changes the sample. Its rounds
        # record the settings and seed and teach the ``learners`` they are given, which must be
        # the sampled regime's (Learners.regime): sampled acceptance is not greedy acceptance.
        self.sampling = sampling
        # A reply under a ``grammar`` (structured output, decode/grammar.py) takes at each row the
        # target's best token among those the grammar allows; its rounds lead with the tokens the
        # grammar alone allows and verify no candidate it forbids. A ``LazyGrammar`` (tool calls
        # under ``tool_choice: auto``) holds the reply only from a call's opening to its end:
        # ``self.grammar`` is then the grammar of the round to come, None while the reply is free.
        self.lazy = grammar if isinstance(grammar, LazyGrammar) else None
        self.grammar = None if self.lazy is not None else grammar
        self.seed = (sampling.seed if sampling.seed is not None else secrets.randbits(63)) if sampling else None
        self._sampling_json = None if sampling is None else {
            "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "min_p": sampling.min_p, "seed": self.seed}
        # The candidate sources, in the order they propose (candidates/base.py): the model drafter
        # (its picks alone for block-chain), then the n-gram fill from the request's own text and
        # the ``memory`` of earlier requests, which gets this reply when it ends (unless not
        # ``remember``: a timing repeat of a reply must not read itself); with ``kept_indexes``,
        # its index goes on from the one the target's last request ended with, where it can.
        self.ngram = NgramSource(self.spec.alternatives, memory, remember, kept_indexes, target) if arm.uses_ngram else None
        model = PicksOnly(drafter) if drafter is not None and arm.picks_only else drafter
        self.proposers: list[Proposer] = [p for p in (model, self.ngram) if p is not None]
        # A drafter that drafts position by position (a draft model) logs its forwards, and in an
        # adaptive arm drafts as deep as the depth learner says (draft_rule).
        self.sequential = drafter if drafter is not None and drafter.sequential else None
        # The learners persist across requests: pass the same ones to every request.
        if learners is None and arm.learns:
            learners = Learners.fresh(self.spec.learners)
        self.learners = learners
        self.tokens: list[int] = []  # the reply, end token excluded
        self.finish: str | None = None
        self.end_token: int | None = None  # the end-of-generation token a stopped reply ended on
        self.last_record: RoundRecord | None = None
        self.stats = Stats()
        self._held: RoundRecord | None = None  # the latest round, until it has learned
        self._closed = False
        self.batched = False  # decoded together with other requests (``begin``)
        # The round log says the request began: its first record (alone) or a step's ``began``
        # (batched, decode/batch.py). Replay starts a request there, so one that closes before
        # is forgotten by the learners (close).
        self.announced = False

    def __iter__(self) -> Iterator[list[int]]:
        """Round by round, each verified alone. A round is the same five steps here and in a
        batched step (decode/batch.py, which verifies several requests' rounds in one decode):
        learn from the round before, propose, decide, verify, complete."""
        self.begin()
        try:
            while self.finish is None:
                self.learn_previous_round()
                plan = self.decide(self.propose())
                yield self.complete(plan, self.target.verify(plan.layout))
        finally:
            self.close()

    def begin(self, batched: bool = False) -> None:
        """The request starts: its prompt into the target, every proposer and the learners.
        ``batched``: it is decoded together with other requests (decode/batch.py): the target
        takes the prompt later, in chunks beside their verifies (a slot of a LlamaBatch), and the
        learners keep its per-request state beside theirs (``use_learners``)."""
        self.batched = batched
        if batched:
            self.target.start(self.prompt, defer=True)
        else:
            self.target.start(self.prompt)
        for source in self.proposers:
            source.begin(self.prompt)
        if self.learners is not None:
            self.learners.start_request(self.request_id, alone=not batched)

    def close(self) -> None:
        """The request ends, however it ends (also when the consumer stops iterating): every
        round of the reply is learned from and logged, in order, and the last one says it is (a
        reply ended early has its finish from ``end``, else "interrupted"); every proposer hears
        the reply. Once only."""
        if self._closed:
            return
        self._closed = True
        if self._held is not None:
            rec, self._held = self._held, None
            self.finish = self.finish or INTERRUPTED
            rec.last, rec.finish = True, self.finish
            self._learn_and_log(rec)
        for source in self.proposers:
            source.end(self.tokens)
        if self.learners is not None and not self.announced:
            self.learners.forget_request(self.request_id)

    def end(self, finish: str = INTERRUPTED) -> None:
        """End the reply with ``finish`` (e.g. "stop" where a stop string cut it, also in a round
        that ended it anyway): no round follows, and the last one decoded is recorded as the
        reply's last, with this finish."""
        self.finish = finish

    @property
    def last_width(self) -> int:
        return self.last_record.width if self.last_record else 0

    def learn_previous_round(self) -> None:
        """The previous round learns and is logged. It waits until now, after its tokens went out,
        so that no client waits for learning, and so that the reply's last round, which only the
        round after it (or ``close``) knows is last, is marked so before anyone learns from it."""
        if self._held is not None:
            rec, self._held = self._held, None
            self._learn_and_log(rec)

    def propose(self) -> RoundPlan:
        """The round's candidates from every source, in order, undecided."""
        target, arm = self.target, self.arm
        rnd, room = self.stats.rounds, target.room()  # (the prompt leaves room for one token: room >= 1)
        t0 = self.clock()
        if rnd == 0:
            self.stats.t_decode = t0  # the zero of the records' ``start``
        # No deeper than the context's room, the arm's width or the tokens the reply may still
        # emit less one (with b to go, a path of b - 1 and the target's own next token already
        # make b: a deeper row adds nothing whatever it holds), and nothing below an end token.
        budget = self.max_tokens - len(self.tokens)
        depth_limit = min(arm.max_width - 1, room - 1, budget - 1)
        # Cells: the committed prefix plus the verify's rows must fit the context.
        max_rows = max(1, min(arm.max_width, getattr(target, "max_width", tree.MAX_WIDTH), target.n_ctx - target.n_past))
        go_on, draft = None, self.sequential
        if draft is not None:
            draft.last_draft = None
            if arm.adaptive and self.learners is not None:
                go_on = draft_rule(self.learners, target.n_past + 1, max_rows)
        cands = tree.cut_below_ends(propose_round(self.proposers, depth_limit, go_on), self._is_end)
        if self.grammar is not None:
            cands = self.grammar.fit(cands, depth_limit)
        p_src = self.ngram.p_src if self.ngram is not None else None
        drafting = None
        if draft is not None:
            drafting = Drafting(**(draft.last_draft or {"forwards": [], "rows": 0, "limit": 0}), max_rows=max_rows)
        return RoundPlan(rnd, t0, t0, target.anchor, target.n_past + 1, cands, [c.to_dict() for c in cands],
                         p_src, max_rows, drafting, constrained=self.grammar is not None)

    def decide(self, plan: RoundPlan) -> RoundPlan:
        """Price, order and choose the width of a round verified alone (a batched step decides its
        requests together: batch.decide_step)."""
        self.use_learners()
        return self.decided(plan, decide_round(plan.cand_dicts, plan.context, plan.p_src, self.arm,
                                               plan.max_rows, self.learners, plan.constrained))

    def decided(self, plan: RoundPlan, decision: RoundDecision) -> RoundPlan:
        """``plan`` with its decision and the rows to verify, depth first."""
        plan.decision = decision
        plan.layout = tree.layout(plan.anchor, plan.cands, decision.chosen)
        plan.t_proposed = self.clock()
        return plan

    def use_learners(self) -> None:
        """Decoded together with other requests, the learners' per-request state is this one's."""
        if self.batched and self.learners is not None:
            self.learners.use(self.request_id)

    def complete(self, plan: RoundPlan, ver: Verified) -> list[int]:
        """After the verify: walk the rows the target agrees with, commit the accepted path and the
        target's own next token (up to the end token or the budget), tell every source, count, and
        build the round's record; the tokens go out as a delta of the reply (Stats.delta). Returns
        the tokens the round emitted."""
        target, lay = self.target, plan.layout
        if self.grammar is not None:
            path_rows, bonus = self._walk_under_grammar(lay, ver)
        elif self.sampling is None:
            path_rows, bonus = tree.accept_walk(lay, ver.argmax)
        else:  # each row's token drawn, lazily: the walk reads only the rows on its path
            drawn = Draws(target.row_logits(), self.sampling, self.seed, target.n_past, lay.depth)
            path_rows, bonus = tree.accept_walk(lay, drawn)
            ver.argmax = drawn.as_list()
        accepted = [lay.token[r] for r in path_rows] + [bonus]
        if self.lazy is not None:
            accepted = self.lazy.cut(accepted, self.grammar)
        n_commit, finish = stop_cut(accepted, target.is_eog, self.max_tokens - len(self.tokens))
        committed = accepted[:n_commit]
        if self.grammar is not None:
            self.grammar.commit(committed)
        if self.lazy is not None:
            self.grammar = self.lazy.after(committed, self.grammar)
        commit_ms = target.commit(lay, path_rows[: n_commit - 1], committed[-1])
        verified = [plan.cands[j] for j in lay.cand[1:]]
        on_path = [plan.cands[lay.cand[r]] for r in path_rows]
        for source in self.proposers:
            source.accept(committed, verified, on_path)
        emitted = committed[:-1] if finish == STOP else committed
        if finish == STOP:
            self.end_token = committed[-1]
        self.tokens.extend(emitted)
        if finish is None and target.room() <= 0:
            finish = CONTEXT
        self.finish = finish
        self._record(plan, ver, path_rows, bonus, emitted, commit_ms, finish)
        self.stats.delta(len(emitted), self.clock())
        return emitted

    def _walk_under_grammar(self, lay: tree.Layout, ver: Verified) -> tuple[list[int], int]:
        """The accept walk over the rows' tokens under the grammar (grammar.GrammarRows): greedy,
        the argmax over the allowed tokens; sampled, a draw from the allowed ones (the mask
        first, then the sampler chain). ``ver.argmax`` becomes those tokens, for the record."""
        logits = None

        def row(r: int) -> np.ndarray:
            nonlocal logits
            if logits is None:
                logits = self.target.row_logits()
            return logits[r]

        if self.sampling is None:
            def pick(r: int, allowed: np.ndarray) -> int:
                return int(np.argmax(np.where(allowed, row(r), -np.inf)))
            rows = self.grammar.rows(lay, pick, ver.argmax)
        else:
            pos0 = self.target.n_past

            def pick(r: int, allowed: np.ndarray) -> int:
                return draw(np.where(allowed, row(r), -np.inf), self.sampling, self.seed, pos0 + lay.depth[r])
            rows = self.grammar.rows(lay, pick, None)
        walked = tree.accept_walk(lay, rows)
        rows.release()
        ver.argmax = rows.as_list()
        return walked

    def _record(self, plan: RoundPlan, ver: Verified, path_rows: list[int], bonus: int, emitted: list[int],
                commit_ms: float, finish: str | None) -> None:
        """Count the round and build its record; it learns and is logged at the next round's
        ``learn_previous_round`` or at ``close``."""
        st, p, lay = self.stats, plan.decision, plan.layout
        draft_ms = (plan.t_proposed - plan.t0) * 1e3
        st.rounds += 1
        st.widths[p.choice.width] += 1
        st.accepted[len(path_rows)] += 1
        st.verify_ms += ver.verify_ms
        st.draft_ms += draft_ms
        st.host_ms += ver.host_ms + commit_ms
        rec = RoundRecord(
            request=self.request_id,
            round=plan.rnd,
            context=plan.context,
            arm=self.arm.name,
            anchor=plan.anchor,
            candidates=plan.cand_dicts,
            order=p.order,
            p_src=plan.p_src,
            priced=p.priced,
            decision=p.choice,
            rows=lay.cand,
            argmax=ver.argmax,
            path=[lay.cand[r] for r in path_rows],
            bonus=bonus,
            emitted=emitted,
            times=Timing(draft=draft_ms, verify=ver.verify_ms, commit=commit_ms,
                         host=ver.host_ms + commit_ms, decode=ver.decode_ms,
                         start=(plan.t0 - self.stats.t_decode) * 1e3),
            first=plan.rnd == 0,
            last=finish is not None,
            finish=finish,
            sampling=self._sampling_json,
            drafting=plan.drafting,
            constrained=plan.constrained,
        )
        self.last_record = rec
        self._held = rec  # learns at the next round or when the reply ends (learn_previous_round, close)

    def _learn_and_log(self, rec: RoundRecord) -> None:
        self.announced = True
        if self.arm.learns:
            self.use_learners()
            t0 = self.clock()
            self.learners.learn(rec)
            # No learner reads this field: it is filled after they learned, for the log's reader.
            rec.times.learn = (self.clock() - t0) * 1e3
        if self.log is not None:
            self.log.write(rec)


def _check_request(target: Target, arm: Arm, prompt: list[int], max_tokens: int, drafter: Proposer | None,
                   sampling: Sampling | None, grammar: Grammar | LazyGrammar | None) -> None:
    """InputError unless ``target`` can decode this request with ``arm``."""
    if sampling is not None and not hasattr(target, "row_logits"):
        raise InputError("this target gives no distribution to sample from: use temperature 0")
    if grammar is not None and not hasattr(target, "row_logits"):
        raise InputError("this target gives no distribution to constrain: no grammar on it")
    if arm.needs_tree and not target.supports_trees:
        raise InputError(f"arm {arm.name} needs tree verification, which recurrent/hybrid models cannot do; use chain:N or ar")
    if arm.max_width > 1 and not target.supports_chains:
        raise InputError(f"arm {arm.name} needs to roll back rejected drafts, which this recurrent model cannot do; use ar")
    if arm.picks_only and drafter is None:
        raise InputError("arm block-chain verifies a model drafter's block: give --drafter")
    if max_tokens < 1:
        raise InputError("max tokens must be at least 1")
    if not prompt:
        raise InputError("the prompt is empty after tokenisation")
    if len(prompt) >= target.n_ctx:
        raise InputError(f"the prompt has {len(prompt)} tokens; the context holds {target.n_ctx} (use --n-ctx)")


def run(target: Target, prompt: list[int], arm: Arm, max_tokens: int, **kw) -> Generation:
    """Decode a whole reply and return the finished Generation."""
    gen = Generation(target, prompt, arm, max_tokens, **kw)
    for _ in gen:
        pass
    return gen
