"""Trace simulation: the real scheduler, n-gram fill and learners decode recorded greedy replies on
a virtual clock whose verify times are measured ones (``adaspark simulate``).

A trace is one reply of a real run: its prompt tokens and the tokens the target produced
(``compare --traces FILE`` writes the baseline's). Under greedy decoding every arm emits the same
tokens (up to near ties), so a trace is the target's greedy text at every position the arm can
reach: the simulated target answers a verify row with the trace's next token when the row's path
follows the trace, and with a token no candidate can hold otherwise. A verify costs what real
verifies of that width cost at that context, from round logs (``regret.CostTable``: medians per
width and context band), times a seeded one-sided interference. So an arm's speed on the traces is
what its choices earn on the machine the logs came from, without the machine: a bench workload
simulates in seconds, which makes it an instrument for learner changes, next to ``replay
--regret`` (which accounts for one run's own choices, but cannot say what other choices would
have led to: a round that commits more moves every later round's anchor).

Host time (Python between verifies) is not on the virtual clock: the simulated speeds are verify
speeds. Compare them with ``compare``'s measured speeds for the host time's share.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import orjson

from adaspark_core.base.errors import InputError
from adaspark_core.base.files import open_regular
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.engine.sim import Interference, SimTarget, VirtualClock
from adaspark_core.evaluate.regret import CostTable
from adaspark_core.evaluate.testset import first_halves
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import RoundLog, read_log

TRACE_SCHEMA = 1
# A trace line holds one reply's prompt and tokens, which fit a context: 16 MB is over two million
# tokens at 7 bytes each (a six-digit id and a comma). A file holds a workload's replies, every
# one of which simulate keeps as Python lists (some five times the text): 256 MB, some 36 million
# tokens, is a file to simulate in a few GB of RAM; a larger one is refused, not swapped.
MAX_TRACE_LINE = 16 << 20
MAX_TRACE_BYTES = 256 << 20
END = -2  # the target's token after a reply that stopped, where the trace did not keep the model's own
OFF = -3  # the target's token where the trace says nothing (past a capped reply, off its path)


@dataclass(frozen=True, slots=True)
class Trace:
    request: str
    source: str
    conversation: str
    turn: int
    reply: int  # 0, or 1 for the reply after a tool result (compare's pairing key)
    prompt: list[int]
    tokens: list[int]  # the emitted tokens, the end token excluded
    finish: str  # stop, length or context
    # The model's end-of-generation token a stopped reply ended on, and the reply's cap
    # (max_tokens); None in traces written before they were kept. Without them the simulated
    # reply ends on a token no candidate can hold (END), capped at its own length plus the end,
    # so no round can verify rows past the end as the real decode did.
    end: int | None = None
    max_tokens: int | None = None

    def to_json(self) -> dict:
        d = {"schema": TRACE_SCHEMA, "request": self.request, "source": self.source,
             "conversation": self.conversation, "turn": self.turn, "reply": self.reply,
             "prompt": self.prompt, "tokens": self.tokens, "finish": self.finish}
        for k in ("end", "max_tokens"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        return d


def write_trace(path: str | os.PathLike, trace: Trace) -> None:
    """Append one trace line (the file is created if absent)."""
    with open(path, "ab") as f:
        f.write(orjson.dumps(trace.to_json()) + b"\n")


def read_traces(paths: Iterable[str | os.PathLike]) -> list[Trace]:
    """The traces of the files, in order; InputError naming the file (and line) for one that is
    not a regular file of trace lines within the bounds."""
    out = []
    for path in paths:
        p = Path(path)
        try:
            lines = open_regular(p, "the trace file", MAX_TRACE_BYTES, MAX_TRACE_LINE)
        except FileNotFoundError as e:
            raise InputError(f"cannot read the trace file {p}: {e.strerror}") from None
        with lines:
            for i, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                try:
                    d = orjson.loads(line)
                    if d.get("schema") != TRACE_SCHEMA:
                        raise ValueError(f"schema {d.get('schema')!r}, this version reads {TRACE_SCHEMA}")
                    t = Trace(str(d["request"]), str(d["source"]), str(d["conversation"]), int(d["turn"]),
                              int(d["reply"]), [int(x) for x in d["prompt"]], [int(x) for x in d["tokens"]],
                              str(d["finish"]), *(None if d.get(k) is None else int(d[k]) for k in ("end", "max_tokens")))
                    if not t.prompt:
                        raise ValueError("the prompt is empty")
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
                    raise InputError(f"{p}:{i}: not a trace line ({e})") from None
                out.append(t)
    if not out:
        raise InputError("the trace files hold no trace")
    return out


class MeasuredCosts:
    """Verify times by width and context from round logs. Widths wider than any measured one are
    priced by the widest measured width's time per row."""

    def __init__(self, logs: Iterable[str | os.PathLike]):
        try:
            self.table = CostTable(rec for log in logs for rec in read_log(log))
        except OSError as e:
            raise InputError(f"cannot read the cost log {e.filename}: {e.strerror}") from None
        except ValueError as e:  # read_log names the file and line
            raise InputError(str(e)) from None
        if not self.table.widths:
            raise InputError("the cost logs measure no width three times: give logs of real runs (--costs)")
        self.widest = max(self.table.widths)

    def ms(self, width: int, context: int) -> float:
        if width > self.widest:
            return self.table.ms(self.widest, context) * width / self.widest
        return self.table.ms(width, context)

    true_ms = ms  # what SimTarget asks of its cost curve


class TraceTarget(SimTarget):
    """A simulated target whose greedy text is one trace and whose verify times are measured."""

    def __init__(self, trace: Trace, costs: MeasuredCosts, clock: VirtualClock, n_ctx: int, noise: Interference):
        text = _TraceText(trace)
        super().__init__(costs, text, clock, n_ctx=n_ctx, noise=noise)
        self.end = text.end

    def is_eog(self, token: int) -> bool:
        # The model's own end token, where the trace kept it: a copy of an earlier turn proposes
        # it, and the end cut (tree.cut_below_ends) drops what hangs below it, as on the model.
        return token == self.end


class _TraceText:
    def __init__(self, trace: Trace):
        self.tokens = trace.prompt + trace.tokens
        self.end = END if trace.end is None else trace.end
        self.after = self.end if trace.finish == "stop" else OFF

    def truth(self, pos: int) -> int:
        if pos < len(self.tokens):
            return self.tokens[pos]
        return self.after if pos == len(self.tokens) else OFF


def first_half_conversations(traces: list[Trace]) -> set[str]:
    """The conversations of the first half of each source's, in trace order (compare's
    ``--warm-on first-half`` rule)."""
    convs = list(dict.fromkeys((t.source, t.conversation) for t in traces))
    return {name for _, name in first_halves(convs, source=lambda c: c[0])}


def simulate(traces: list[Trace], arms: list[str], costs: MeasuredCosts, warm: int = 0,
             log_dir: Path | None = None, seed: int = 0, progress=None,
             warm_on: set[str] | None = None) -> list[dict]:
    """Every arm over every trace, in trace order (the learning arms carry their learners from
    one trace to the next, as a serving process does), after ``warm`` untimed passes of the
    learning arms over the traces of the ``warm_on`` conversations (None: all). Returns one reply
    record per (arm, trace) in ``stats``'s format, the speed on the virtual clock, with whether
    the warm passes saw its conversation (``warmed``)."""
    specs = [parse_arm(a) for a in arms]
    learners = {a.name: Learners() for a in specs if a.learns}
    n_ctx = max(len(t.prompt) + len(t.tokens) for t in traces) + 64
    logs = {}
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        for a in specs:
            for tag in (["warm-"] if warm and a.learns else []) + [""]:
                p = log_dir / f"{tag}{a.name.replace(':', '_')}.jsonl"
                # fresh: a log of an earlier simulation would replay as this one's
                logs[tag + a.name] = RoundLog(p, fresh=True)
    try:
        for k in range(warm):
            for i, t in enumerate(traces):
                if warm_on is not None and t.conversation not in warm_on:
                    continue
                for a in (s for s in specs if s.learns):
                    _decode(t, a, costs, n_ctx, learners, logs.get("warm-" + a.name), seed, i, f"warm{k + 1}:")
        replies = []
        for i, t in enumerate(traces):
            for a in specs:
                rec = _decode(t, a, costs, n_ctx, learners, logs.get(a.name), seed, i, "")
                rec["warmed"] = warm > 0 and (warm_on is None or t.conversation in warm_on)
                replies.append(rec)
                if progress:
                    progress()
        return replies
    finally:
        for log in logs.values():
            log.close()


def _decode(t: Trace, arm, costs: MeasuredCosts, n_ctx: int, learners: dict, log, seed: int, i: int,
            tag: str) -> dict:
    clock = VirtualClock()
    target = TraceTarget(t, costs, clock, n_ctx, Interference(seed=seed * 1_000_003 + i))
    # A stopped reply stops on its own (the end token) under the cap it was decoded with; a capped
    # one at its length.
    cap = len(t.tokens) if t.finish != "stop" else t.max_tokens or len(t.tokens) + 1
    gen = Generation(target, t.prompt, arm, max(cap, 1), request_id=tag + t.request, log=log, clock=clock,
                     learners=learners.get(arm.name))
    for _ in gen:
        pass
    if gen.tokens != t.tokens[: len(gen.tokens)]:
        raise AssertionError(f"{arm.name} left the trace of {t.request}: the simulated target is not greedy")
    st = gen.stats
    return {"arm": arm.name, "source": t.source, "conversation": t.conversation, "turn": t.turn, "reply": t.reply,
            "tok_s": st.decode_tps, "tokens": len(gen.tokens), "capped": gen.finish == "length",
            "context": len(t.prompt), "finish": gen.finish, "widths": {str(w): n for w, n in st.widths.items()},
            "trace": [[n, round(secs, 9)] for n, secs in st.trace()], "same_text_as_baseline": None}
