"""A scriptable fake target: its greedy next token is a pure function of the prefix, so the
scheduler's bookkeeping can be tested without a model. It checks the same KV invariants as the
real engine (row 0 is the anchor, the tree fits the context)."""

from __future__ import annotations

from typing import Callable

from adaspark_core.base.tree import Layout
from adaspark_core.engine.base import Verified


class FakeTarget:
    supports_trees = True
    supports_chains = True

    def __init__(self, next_token: Callable[[list[int]], int], n_ctx: int = 4096, eog: int = 0, n_vocab: int = 1000):
        self.next_token = next_token
        self.n_ctx = n_ctx
        self.eog = eog
        self.n_vocab = n_vocab
        self.kv: list[int] = []  # committed tokens in the "cache" (all but the anchor)
        self.anchor: int | None = None
        self.verifies: list[Layout] = []

    @property
    def n_past(self) -> int:
        return len(self.kv)

    def is_eog(self, t: int) -> bool:
        return t == self.eog

    def piece(self, t: int) -> bytes:
        return f"<{t}>".encode()

    def start(self, tokens: list[int]) -> None:
        self.kv = list(tokens[:-1])
        self.anchor = tokens[-1]

    def room(self) -> int:
        return self.n_ctx - self.n_past - 1

    def verify(self, lay: Layout) -> Verified:
        assert lay.token[0] == self.anchor
        assert self.n_past + lay.width <= self.n_ctx
        assert self.n_past + lay.max_depth < self.n_ctx
        self.verifies.append(lay)
        argmax = []
        for r in range(lay.width):
            path = []
            x = r
            while x >= 0:
                path.append(lay.token[x])
                x = lay.parent_row[x]
            argmax.append(self.next_token(self.kv + path[::-1]))
        return Verified(argmax, 1.0, 0.9, 0.1)

    def commit(self, lay: Layout, keep_rows: list[int], next_anchor: int) -> float:
        self.kv = self.kv + [lay.token[0]] + [lay.token[r] for r in keep_rows]
        self.anchor = next_anchor
        return 0.0


def cyclic(seq: list[int]) -> Callable[[list[int]], int]:
    """A target that continues by repeating ``seq``: the next token follows the last one in seq."""
    nxt = {a: b for a, b in zip(seq, seq[1:] + seq[:1])}
    return lambda prefix: nxt.get(prefix[-1], seq[0])
