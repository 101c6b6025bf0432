"""A scriptable fake target: its greedy next token is a pure function of the prefix, so the
scheduler's bookkeeping can be tested without a model. It checks the same KV invariants as the
real engine (row 0 is the anchor, the tree fits the context)."""

from __future__ import annotations

from typing import Callable

import orjson

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


# --- a scripted text with recurring phrases, and a target whose rows cost (replay, compare) ---

PHRASES = [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 3, 4, 15, 16], [17, 18, 19, 20, 21, 22]]


def markov(prefix: list[int]) -> int:
    """A deterministic text of recurring phrases in a scrambled order, so an earlier occurrence
    of the context often continues differently (the n-gram fill offers sibling chains)."""
    n = len(prefix)
    k = n // 6
    return PHRASES[(k * k * 7 + k * 3 + k // 5) % 4][n % 6]


class CostlyTarget(FakeTarget):
    """Each row costs: the chooser keeps trees narrow, so exploration has n-gram nodes to place."""

    def verify(self, lay):
        v = super().verify(lay)
        v.verify_ms = v.decode_ms = 1.0 + 3.0 * lay.width
        return v


def canonical(state: dict) -> dict:
    return orjson.loads(orjson.dumps(state))
