"""One request served on a Runtime, the part ``serve-stdin`` and ``serve`` (HTTP) share: decode,
cut the reply at a stop string, stop early when asked, and keep what the learners learned.

    reply = serve_request(rt, prompt, max_tokens=64, name="req-1", stops=["\\n\\n"],
                          on_text=send, cancelled=lambda: client_gone)
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from typing import Callable, Iterable

from adaspark_core.base.errors import OutputError
from adaspark_core.base.sampling import Sampling
from adaspark_core.decode.batch import Batch
from adaspark_core.decode.generation import Generation, Stats
from adaspark_core.decode.grammar import Grammar, LazyGrammar
from adaspark_core.decode.round import INTERRUPTED, STOP
from adaspark_core.decode.runtime import Runtime


class StopStrings:
    """A reply cut at the first occurrence of any stop string. Text that might be the start of a
    stop string is held back until the next piece settles it, so a streamed reply never shows
    part of a stop string and then takes it back (as llama-cpp-python and llama-server do)."""

    def __init__(self, stops: Iterable[str] = ()):
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0  # text[:sent] was handed out
        self.hit = False

    def feed(self, piece: str) -> str:
        """Add a piece of the reply; the text that is now safe to hand out."""
        if self.hit:
            return ""
        self.text += piece
        # A stop string cannot begin before ``sent``: its start would have been held back.
        cuts = [i for s in self.stops if (i := self.text.find(s, self.sent)) >= 0]
        if cuts:
            self.hit = True
            self.text = self.text[: min(cuts)]
            return self._take(len(self.text))
        return self._take(len(self.text) - self._held())

    def flush(self) -> str:
        """The held-back text, once the reply has ended without a stop string."""
        return self._take(len(self.text))

    def _held(self) -> int:
        """The longest tail of the text that begins some stop string."""
        tail = self.text[self.sent:]
        return max((k for s in self.stops for k in range(min(len(s) - 1, len(tail)), 0, -1)
                    if tail.endswith(s[:k])), default=0)

    def _take(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out


@dataclass
class Reply:
    text: str
    finish: str  # stop (end token or stop string), length, context or interrupted
    prompt_tokens: int
    prompt_reused: int  # prompt tokens taken from the previous request's KV instead of prefilled
    stats: Stats
    arm: str
    sampling: Sampling | None
    seed: int | None = None  # a sampled reply's seed (the request's, or the one drawn for it)

    def stats_json(self) -> dict:
        """AdaSpark's own account of the reply: how it was decoded and what speculation gave."""
        how = ("greedy, speculative" if self.sampling is None else
               f"sampled ({self.sampling.describe()}), speculative: draws keyed by seed and position, "
               "so the sample is the one plain decoding with this seed gives")
        out = {"arm": self.arm, "decoding": how, "prompt_reused": self.prompt_reused, **self.stats.to_json()}
        if self.seed is not None:
            out["seed"] = self.seed
        return out


def serve_request(rt: Runtime, prompt: list[int], max_tokens: int, name: str, *,
                  stops: Iterable[str] = (), sampling: Sampling | None = None,
                  on_text: Callable[[str], None] | None = None,
                  cancelled: Callable[[], bool] | None = None,
                  on_warning: Callable[[str], None] | None = None, grammar: Grammar | LazyGrammar | None = None) -> Reply:
    """Decode one request (InputError before the first round if it cannot be served). Text goes
    to ``on_text`` as it is settled; ``cancelled()`` is asked after every round and ends the reply
    with finish ``interrupted``. The learned state is saved when the reply ends, however it ends
    (a store that cannot be written goes to ``on_warning`` and the learning stays in memory)."""
    gen = rt.generation(prompt, max_tokens, request_id=name, sampling=sampling, grammar=grammar)
    scan = StopStrings(stops)

    def settled(text: str) -> None:
        out = scan.feed(text)
        if out and on_text is not None:
            on_text(out)

    def stop() -> str | None:
        if scan.hit:
            return STOP
        return INTERRUPTED if cancelled is not None and cancelled() else None

    try:
        rt.run(gen, on_text=settled, stop=stop)
    finally:
        if gen.stats.rounds:
            keep(rt, gen.stats.rounds, 1, on_warning, between_replies=True)
    rest = scan.flush()
    if rest and on_text is not None:
        on_text(rest)
    return Reply(scan.text, gen.finish, len(prompt), rt.target.reused, gen.stats, rt.arm.name, sampling, gen.seed)


def keep(rt: Runtime, rounds: int, requests: int, on_warning: Callable[[str], None] | None,
         between_replies: bool = False) -> None:
    """Save the learned state (``between_replies``: after a reply, Runtime.save); a store that
    cannot be written (a full disk) is reported through ``on_warning`` and serving goes on, the
    learning kept in memory for the next save."""
    try:
        rt.save(rounds, requests=requests, between_replies=between_replies)
    except OutputError as e:
        if on_warning is not None:
            on_warning(str(e))


@dataclass(eq=False)
class _Served:
    """A request of a BatchServer: its generation and the way its text goes out."""

    gen: Generation
    name: str
    prompt_tokens: int
    scan: StopStrings
    on_text: Callable[[str], None] | None
    cancelled: Callable[[], bool] | None
    utf8: codecs.IncrementalDecoder = field(default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace"))

    def out(self, text: str) -> None:
        settled = self.scan.feed(text)
        if settled and self.on_text is not None:
            self.on_text(settled)


class BatchServer:
    """Requests served together on a Runtime's slots (``EngineOptions(parallel=N)``): ``admit``
    puts a request in a free slot, ``step`` advances every admitted one a round in one verify
    (decode/batch.py) and returns the replies that ended, their learning saved. Stop strings,
    cancellation and the text of each reply as ``serve_request`` has them.

    A request that fails (decode/batch.py says whose failure is whose; here also its close, or
    saving after it) ends with its exception instead of a Reply, its slot free again and its
    learning saved as far as it got; the others go on."""

    def __init__(self, rt: Runtime, on_warning: Callable[[str], None] | None = None):
        self.rt = rt
        self.on_warning = on_warning
        self.batch = Batch(rt.engine.verify)
        self.free = list(rt.slots)
        self.served: dict[Generation, _Served] = {}

    @property
    def full(self) -> bool:
        return not self.free

    @property
    def active(self) -> int:
        return len(self.served)

    def admit(self, prompt: list[int], max_tokens: int, name: str, *, stops: Iterable[str] = (),
              sampling: Sampling | None = None, on_text: Callable[[str], None] | None = None,
              cancelled: Callable[[], bool] | None = None,
              grammar: Grammar | LazyGrammar | None = None) -> None:
        """Start a request in a free slot (its prompt goes in with the next steps); InputError if
        it cannot be served, the slot given back. A running request whose round cannot be logged
        meanwhile (Batch.learn_previous_rounds) fails, answered by the next ``step``."""
        self.batch.learn_previous_rounds()  # before the request's learners are chosen (Batch.learn_previous_rounds)
        slot = self.free.pop()
        try:
            gen = self.rt.generation(prompt, max_tokens, request_id=name, sampling=sampling, target=slot,
                                     grammar=grammar)
            self.batch.add(gen)
        except BaseException:
            self.free.append(slot)
            raise
        self.served[gen] = _Served(gen, name, len(prompt), StopStrings(stops), on_text, cancelled)

    def step(self) -> list[tuple[str, Reply | Exception]]:
        """One round of every request, verified together: (name, Reply) of each that ended and
        (name, what raised) of each that failed. A request may be named once more, after it was
        answered, with a failure of its clean-up or of saving what it learned."""
        done = self._failed()  # since the last step: while another request was admitted
        for s in [s for s in self.served.values() if s.gen.target.pending and s.cancelled is not None and s.cancelled()]:
            done += self._leave(s, INTERRUPTED)  # its client left while its prompt was going in
        for gen, emitted in self.batch.step():
            s = self.served[gen]
            s.out(s.utf8.decode(b"".join(map(self.rt.model.piece, emitted))))
            if gen.finish is not None:
                done += self._leave(s)
            elif finish := STOP if s.scan.hit else INTERRUPTED if s.cancelled is not None and s.cancelled() else None:
                done += self._leave(s, finish)
        return done + self._failed()

    def _failed(self) -> list[tuple[str, Exception]]:
        """The requests the batch failed, their slots given back."""
        out = []
        for gen, error in self.batch.take_failed():
            out.append((gen.request_id, error))  # the name it was admitted with
            if (s := self.served.get(gen)) is not None:
                out += self._release(s)
        return out

    def _leave(self, s: _Served, finish: str | None = None) -> list[tuple[str, Reply | Exception]]:
        """``s`` ends (``finish``: its reply is cut there, the request dropped from the batch
        first): its name with its Reply, or with what raised instead (its close); then its slot
        is given back (``_release``)."""
        try:
            if finish is not None:
                self.batch.drop(s.gen, finish)
            s.out(s.utf8.decode(b"", final=True))
            rest = s.scan.flush()
            if rest and s.on_text is not None:
                s.on_text(rest)
            ended = (s.name, Reply(s.scan.text, s.gen.finish, s.prompt_tokens, s.gen.target.reused, s.gen.stats,
                                   self.rt.arm.name, s.gen.sampling, s.gen.seed))
        except Exception as e:
            ended = (s.name, e)
        return [ended, *self._release(s)]

    def _release(self, s: _Served) -> list[tuple[str, Exception]]:
        """``s`` gives its slot back, and what the learners took from its rounds is saved (a store
        that cannot be written is a warning: ``keep``); anything else saving raised is returned.
        Once only."""
        if self.served.pop(s.gen, None) is None:
            return []
        self.free.append(s.gen.target)
        try:
            if s.gen.stats.rounds:
                keep(self.rt, s.gen.stats.rounds, 1, self.on_warning, between_replies=True)
        except Exception as e:
            return [(s.name, e)]
        return []
