"""The Target protocol: what the scheduler needs from an engine. (What a source of candidates
implements is the Proposer contract, candidates/base.py.)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from adaspark_core.base.tree import Layout


@dataclass(slots=True)
class Verified:
    """The outcome of one verify: the target's argmax per row and its timings (milliseconds)."""

    argmax: list[int]
    verify_ms: float  # batch build + llama_decode + argmax read
    decode_ms: float  # llama_decode alone
    host_ms: float  # the engine's own Python/KV work inside the verify (verify_ms - decode_ms)


class Target(Protocol):
    n_ctx: int
    n_vocab: int
    supports_trees: bool  # False for recurrent/hybrid models: chains only
    supports_chains: bool  # False for a recurrent model that cannot roll back: one row a round
    n_past: int  # committed tokens in the KV cache; the anchor sits at this position
    anchor: int | None  # the last committed token, row 0 of the next verify

    def tokenize(self, text: str, special: bool = True) -> list[int]: ...
    def piece(self, token: int) -> bytes: ...
    def is_eog(self, token: int) -> bool: ...
    def start(self, tokens: list[int]) -> None:
        """Reset the KV cache and prefill every token but the last (the first anchor)."""

    def verify(self, lay: Layout) -> Verified:
        """Run the layout's rows in one forward pass; the anchor sits at the next position."""

    def room(self) -> int:
        """How many more tokens the context can take after the anchor."""

    def commit(self, lay: Layout, keep_rows: list[int], next_anchor: int) -> float:
        """Keep the anchor and ``keep_rows`` (a path from it) in the KV cache, drop every other
        row, and make ``next_anchor`` the new anchor. Returns the milliseconds it took."""

    # A target whose verifies hold fewer rows than MAX_WIDTH (a slot of a LlamaBatch, which
    # shares llama.cpp's sequences among its slots) says so in ``max_width``.
    # A target that can serve sampled requests also has ``row_logits()``: the last verify's
    # logits, one row per verified row (engine/llama_target.py).
