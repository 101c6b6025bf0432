"""The round record and the JSON-lines round log (DESIGN.md, "Round record and round log").

A record holds everything any learner needs about one round, so learners can be trained and
replayed from a log without the model. One JSON object per line, written with orjson. Every line
carries ``schema``; reading a log upgrades older lines through ``UPGRADES``, an append-only list of
functions, the i-th of which turns a schema-(i+1) line into a schema-(i+2) line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Iterator

import orjson

from adaspark_core.base.errors import OutputError
from adaspark_core.base.files import open_log, open_regular
from adaspark_core.base.schema import apply_upgrades

SCHEMA = 6

# Append-only: UPGRADES[i] maps a dict of schema i+1 to schema i+2. Never edit an entry.
UPGRADES: list[Callable[[dict], dict]] = [
    # 1 -> 2: the acceptance model's inputs and choices (p_src, which estimate priced, exploration).
    lambda d: {**d, "p_src": None, "priced": None, "explored": False},
    # 2 -> 3: the learners' time and the round's start on the request's clock (regret account).
    lambda d: {**d, "times": {**d["times"], "learn": 0.0, "start": None}},
    # 3 -> 4: sampled rounds are logged, with their request's sampler settings and seed.
    lambda d: {**d, "sampling": None},
    # 4 -> 5: no ``reach`` (the most rows the round's sources could fill): no learner reads it (a
    # measuring round verifies the width it measures, so the cost model never moves a width to it).
    lambda d: {k: v for k, v in d.items() if k != "reach"},
    # 5 -> 6: rounds verified together with other requests' carry their ``step``.
    lambda d: {**d, "step": None},
]


@dataclass(slots=True)
class Timing:
    """Milliseconds. ``draft`` is D (drafter + tree build); ``verify`` is T (the target's verify,
    batch build and argmax read included); ``commit`` the KV commit; ``host`` the engine's own
    Python time outside llama_decode (batch build, KV sequence operations, argmax read);
    ``learn`` the learners' step on this round (after the record was built, before it was
    written); ``start`` when the round began, since the request's first round began. The gaps
    between consecutive starts are the rounds' wall times, which also hold what no field times
    (building the record, writing the log, the consumer of the emitted text)."""

    draft: float
    verify: float
    commit: float
    host: float
    decode: float  # llama_decode alone
    learn: float = 0.0
    start: float | None = None

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.commit


@dataclass(slots=True)
class RoundRecord:
    request: str
    round: int  # 0-based index within the request
    context: int  # committed tokens at the start of the round (the anchor included)
    arm: str
    anchor: int  # the anchor's token
    candidates: list[dict]  # Candidate.to_dict() of every proposed candidate, placed or not
    order: list[int]  # best-first order of candidate indices (Proposition 1)
    offered: list[int]  # widths the arm offered
    prices: list[float] | None  # the arm's price (ms) per offered width, when it has one
    width: int  # rows verified (the anchor included)
    rows: list[int]  # candidate index per verified row, -1 for the anchor, depth-first
    argmax: list[int]  # the target's argmax per verified row (sampled: its draw, -1 where not drawn)
    path: list[int]  # accepted candidate indices, from the anchor down
    bonus: int  # the target's argmax (sampled: draw) at the deepest accepted row
    emitted: list[int]  # tokens this round added to the reply (after stop truncation)
    times: Timing
    measure: int | None = None  # the width a cold-start round measures (adaptive arms)
    p_src: float | None = None  # the n-gram source's top-1 precision on the committed text
    priced: str | None = None  # which acceptance estimate priced the candidates: fitted or head
    explored: bool = False  # the last row went to an exploring n-gram node (logs before hindsight labels)
    first: bool = False  # the request's first round
    last: bool = False  # the request's last round
    finish: str | None = None  # on the last round: stop, length or context
    # A sampled request's settings (temperature, top_k, top_p, min_p) and its seed: the round
    # belongs to the sampled regime's learners (learned.Learners.regime); None: greedy.
    sampling: dict | None = None
    # A round verified together with other requests' rounds (decode/batch.py): the step's
    # ``id`` (a counter of its batch), ``requests`` in it, its ``rows`` and ``cells`` (every
    # request's context: each row attends them all), its ``draft`` time (every request's
    # proposing and pricing), ``max_rows`` (this request's bound), ``lead`` (the step's first
    # record, which carries the step's cost to the cost model), ``last`` (a request ended in
    # it) and, where a joining request's prompt tokens rode in its decode, ``prefill`` (how
    # many; such a step does not teach the cost model) and ``began`` ([request, sampled] of the
    # requests that joined since the previous step: their per-request learner state starts
    # there, before their prompts are in). None: verified alone.
    step: dict | None = None
    schema: int = field(default=SCHEMA)

    def as_step(self) -> "RoundRecord":
        """The step this record leads, as one round of all its rows over all its cells: what the
        verify-cost model learns from (its time is the step's)."""
        s = self.step
        return replace(self, width=s["rows"], context=s["cells"], first=False, last=s["last"],
                       times=replace(self.times, draft=s["draft"]))

    def to_json(self) -> dict:
        """A shallow dict for orjson: the record's own lists and dicts are shared, not copied
        (``dataclasses.asdict`` deep-copies every candidate, too slow per round: ARCHITECTURE.md,
        section 5)."""
        d = {f: getattr(self, f) for f in _RECORD_FIELDS}
        d["times"] = {**{f: getattr(self.times, f) for f in _TIMING_FIELDS}, "total": self.times.total}
        return d

    @staticmethod
    def from_json(d: dict) -> "RoundRecord":
        d = upgrade(dict(d))
        t = dict(d.pop("times"))
        t.pop("total", None)
        return RoundRecord(times=Timing(**t), **d)


_RECORD_FIELDS = [f.name for f in fields(RoundRecord)]
_TIMING_FIELDS = [f.name for f in fields(Timing)]


def upgrade(d: dict) -> dict:
    """Bring a parsed log line to the current schema."""
    return apply_upgrades(d, UPGRADES, SCHEMA)


class LogWriteError(OutputError):
    """A round could not be written to the log (a full disk, a closed pipe)."""


class RoundLog:
    """Appends records to a JSON-lines file (opened by files.open_log: a regular file, a FIFO or
    a character device; emptied first if ``fresh``). Each line goes out in whole ``os.write``
    calls, unbuffered, so a crash loses at most the round being written; a write that fails
    (LogWriteError) takes back what it wrote of its line in a regular file, so the log stays
    readable line by line."""

    def __init__(self, path: str | os.PathLike, *, fresh: bool = False):
        self.name = str(path)
        self._fd: int | None = open_log(path, fresh=fresh)

    def write(self, rec: RoundRecord) -> None:
        if self._fd is None:
            raise LogWriteError(f"the round log {self.name} is closed")
        line = orjson.dumps(rec.to_json()) + b"\n"
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            try:  # only a regular file has a size to go back to
                if os.fstat(self._fd).st_size > size:
                    os.ftruncate(self._fd, size)
            except OSError:
                pass
            raise LogWriteError(f"cannot write the round log {self.name}: {e.strerror or e}") from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RoundLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# A record holds one round: at most MAX_WIDTH rows and their candidates (the fixture log's largest
# line is 9 KB). A log is bounded only so that a device posing as one is refused.
MAX_RECORD_BYTES = 16 << 20
MAX_LOG_BYTES = 1 << 36


def read_log(path: str | os.PathLike, on_cut: Callable[[str], None] | None = None) -> Iterator[RoundRecord]:
    """Yield the records of a round log, upgraded to the current schema.

    A last line that is not a record and has no newline was cut by a crash while it was written
    (RoundLog writes each line whole, newline included, so nothing else leaves one): it is left out
    and ``on_cut`` is told so. Raises ValueError naming the line for any other line that is not a
    record.
    """
    with open_regular(path, "the round log", MAX_LOG_BYTES, MAX_RECORD_BYTES) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = RoundRecord.from_json(orjson.loads(line))
            except (orjson.JSONDecodeError, TypeError, ValueError, KeyError) as e:
                if not line.endswith(b"\n"):  # only the last line can lack one
                    if on_cut is not None:
                        on_cut(f"{path}:{lineno}: the last line is cut short (a crash while it was written?): left out")
                    return
                raise ValueError(f"{path}:{lineno}: not a round record ({e})") from None
            yield rec
