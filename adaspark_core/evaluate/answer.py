"""What an arm of ``compare`` answers for one reply, and the client-clock points of its trace:
shared by the in-process arms (compare.py) and the llama-server peers (peer.py)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Answer:
    tokens: list[int]
    text: str
    tok_s: float | None
    finish: str
    widths: dict[str, int] = field(default_factory=dict)
    # [[tokens so far, seconds since the first delta], ...], one entry per streamed delta (client
    # clock), led for our arms by the decode's start, [0, seconds before the first delta]
    # (generation.Stats.trace); None for an arm that cannot tell, whose replies then stay out of
    # the first-N ratio.
    trace: list[list] | None = None
    # The end-of-generation token a stopped reply ended on, where the arm can tell (our arms).
    end: int | None = None


TRACE_DIGITS = 6  # seconds rounded to a microsecond: far below a delta's spacing, and compact


def trace_point(tokens: int, seconds: float) -> list:
    return [int(tokens), round(float(seconds), TRACE_DIGITS)]
