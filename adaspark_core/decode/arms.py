"""The arms: how a round's width is set (``ar``, ``chain:N``, ``tree:N``, ``pinned:N``, ``cost``,
``adaspark``, ``block-chain``), and ``Speculation``, the one config that carries an arm and its
settings from the command line to every Generation. ``tree:1`` and ``chain:0`` are plain decoding:
width 1 is a first-class width (one row, no candidates)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from adaspark_core.base import tree
from adaspark_core.base.errors import InputError
from adaspark_core.candidates.memory import DEFAULT_CAP_MB
from adaspark_core.learn.learned import LearnerParams

# Sibling n-gram chains per round where earlier occurrences continue differently: one, as more
# cost host time every candidate round and gain nothing (ARCHITECTURE.md, section 5).
MAX_ALTS = 1


@dataclass(frozen=True, slots=True)
class Arm:
    """How a round's width is set.

    ``ar``: one row. ``chain:N``: the candidate chain, at most N draft tokens (N + 1 rows).
    ``tree:N``: the best-first prefix of N rows, no learned models. ``pinned:N``: N rows with the
    rest of the adaptive scheduler running (its learners learn; they do not choose). ``cost``: the
    cost model's width over the drafter's candidates only (no n-gram). ``adaspark``: the cost
    model's width over the drafter's and the n-gram's candidates.
    """

    kind: str
    n: int = 1

    @property
    def name(self) -> str:
        if self.kind == "block":
            return "block-chain"
        return self.kind if self.kind in ("ar", "cost", "adaspark") else f"{self.kind}:{self.n}"

    @property
    def max_width(self) -> int:
        # block-chain: as many rows as the drafter's block has picks
        return {"ar": 1, "chain": self.n + 1, "tree": self.n, "pinned": self.n}.get(self.kind, tree.MAX_WIDTH)

    @property
    def adaptive(self) -> bool:
        """The cost model and chooser set the width."""
        return self.kind in ("cost", "adaspark")

    @property
    def learns(self) -> bool:
        """The online learners see this arm's rounds."""
        return self.kind in ("cost", "adaspark", "pinned")

    @property
    def fitted(self) -> bool:
        """The fitted acceptance model may price the tree (guarded); ``cost`` prices with the
        head-based estimate (paper 4.1)."""
        return self.kind in ("adaspark", "pinned")

    @property
    def uses_ngram(self) -> bool:
        """The n-gram source proposes. Not for ``ar``, whose one row holds no candidate: its index
        of the request's text cost every token 0.05 ms and the prompt its indexing, for nothing."""
        return self.kind not in ("ar", "cost", "block")

    @property
    def picks_only(self) -> bool:
        """The drafter's picks alone, as a chain (``block-chain``: the whole block, no siblings)."""
        return self.kind == "block"

    @property
    def needs_tree(self) -> bool:
        return self.max_width > 2 and self.kind not in ("chain", "block")


@dataclass(frozen=True, kw_only=True)
class Speculation:
    """How requests speculate: one config carried from the command line through the Runtime to
    every Generation. The arm (its widths), the sibling n-gram chains a round may add, the n-gram
    memory's cap (0: none) and the learners' parameters (Table 14's values by default)."""

    arm: Arm
    sibling_chains: int = MAX_ALTS
    memory_mb: float = DEFAULT_CAP_MB
    learners: LearnerParams = field(default_factory=LearnerParams)

    @classmethod
    def of(cls, arm: "str | Arm | Speculation", **kw) -> "Speculation":
        """A Speculation from an arm spec (``"chain:3"``) or an Arm, other fields by name."""
        if isinstance(arm, Speculation):
            return arm
        return cls(arm=parse_arm(arm) if isinstance(arm, str) else arm, **kw)

    @property
    def alternatives(self) -> int:
        """Sibling n-gram chains a round adds: none for a chain arm (its tree is a chain)."""
        return 0 if self.arm.kind == "chain" else self.sibling_chains

_ARM = re.compile(r"^(?:(ar|cost|adaspark|block-chain)|(chain|tree|pinned):(\d+))$")


def parse_arm(spec: str, max_width: int = tree.MAX_WIDTH) -> Arm:
    m = _ARM.match(spec.strip())
    if not m:
        raise InputError(f"unknown arm {spec!r}: use ar, chain:N, tree:N, pinned:N, cost, adaspark or block-chain")
    if m.group(1) == "block-chain":
        return Arm("block")
    if m.group(1):
        return Arm(m.group(1))
    arm = Arm(m.group(2), int(m.group(3)))
    if arm.max_width < 1:
        raise InputError(f"arm {spec!r}: a verify has at least one row")
    if arm.max_width > max_width:
        raise InputError(f"arm {spec!r} verifies {arm.max_width} rows; the most is {max_width}")
    if arm.max_width == 1 and arm.kind != "pinned":
        return Arm("ar")
    return arm
