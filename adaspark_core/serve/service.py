"""One request served on a Runtime, the part ``serve-stdin`` and ``serve`` (HTTP) share: decode,
cut the reply at a stop string, stop early when asked, and keep what the learners learned.

    reply = serve_request(rt, prompt, max_tokens=64, name="req-1", stops=["\\n\\n"],
                          on_text=send, cancelled=lambda: client_gone)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from adaspark_core.base.errors import OutputError
from adaspark_core.base.sampling import Sampling
from adaspark_core.decode.runtime import Runtime
from adaspark_core.decode.scheduler import INTERRUPTED, STOP, Stats


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
                  on_warning: Callable[[str], None] | None = None) -> Reply:
    """Decode one request (InputError before the first round if it cannot be served). Text goes
    to ``on_text`` as it is settled; ``cancelled()`` is asked after every round and ends the reply
    with finish ``interrupted``. The learned state is saved when the reply ends, however it ends
    (a store that cannot be written goes to ``on_warning`` and the learning stays in memory)."""
    gen = rt.generation(prompt, max_tokens, request_id=name, sampling=sampling)
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
            keep(rt, gen.stats.rounds, 1, on_warning)
    rest = scan.flush()
    if rest and on_text is not None:
        on_text(rest)
    return Reply(scan.text, gen.finish, len(prompt), rt.target.reused, gen.stats, rt.arm.name, sampling, gen.seed)


def keep(rt: Runtime, rounds: int, requests: int, on_warning: Callable[[str], None] | None) -> None:
    """Save the learned state; a store that cannot be written (a full disk) is reported through
    ``on_warning`` and serving goes on, the learning kept in memory for the next save."""
    try:
        rt.save(rounds, requests=requests)
    except OutputError as e:
        if on_warning is not None:
            on_warning(str(e))
