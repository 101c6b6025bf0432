"""Candidate trees: best-first order, prefixes, depth-first layout and the accept walk.

Paper sections 2.2 (tree verification) and 3.1 (Proposition 1). Everything here is a pure
function of its arguments; nothing touches llama.cpp.

Conventions used throughout the package:

- A round's candidates are a list in which every parent precedes its children. ``parent`` is the
  index of the parent candidate, or ``ANCHOR`` (-1) for a child of the anchor.
- A verify of width ``n`` has ``n`` rows: row 0 is the anchor (the last committed token, not yet
  in the KV cache), rows 1..n-1 are candidates.
- ``q`` is P(candidate accepted | parent accepted); ``Q`` is the product of ``q`` along the path
  from the anchor, i.e. the probability that the candidate lies on the accepted path (Eq. 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

ANCHOR = -1
# n-gram chains stop this many tokens below the anchor (Table 14): a chain this deep was cut, not
# ended, and goes on past what the round proposed (chooser.Lookahead)
MAX_CHAIN_DEPTH = 32
# The widest verify, in rows: the top of the cost model's ladder (the paper's, Figure 3), an
# adaptive arm's bound, a fixed arm's limit and the rows a target is built for. llama.cpp allows
# 256 sequences: a lone target uses 64, batched slots share the 256 (engine/llama_batch.py LlamaBatch).
MAX_WIDTH = 64
FOLLOWER_CONTEXT = 3  # n-gram follower context when no earlier passage continues (Table 14)
COPY_MIN = FOLLOWER_CONTEXT + 1  # an n-gram copy needs a longer matching context than a follower

PICK = "pick"
SIBLING = "sibling"
NGRAM = "ngram"
FORCED = "forced"  # the only token a request's grammar allows there (decode/grammar.py): certain


@dataclass(slots=True)
class Candidate:
    """One proposed token. Features are what the acceptance models read (section 3.3)."""

    token: int
    parent: int  # index of the parent candidate in the round's list, or ANCHOR
    source: str  # PICK, SIBLING, NGRAM or FORCED
    depth: int  # 1 for a child of the anchor
    q: float = 0.0  # P(accepted | parent accepted): a round sets it on the record's dicts (decide_round)
    h: float | None = None  # drafter confidence head at this position
    share: float | None = None  # sigma for a pick, r (share of the siblings' total) for a sibling
    sigma: float | None = None  # the position's pick share sigma (a pick's own share; a sibling's pick's)
    # N-gram features (ngram.py). For an n-gram node they describe the node itself; for a drafter
    # candidate that is agreed or contradicted, the n-gram proposal that agreed or contradicted it.
    kind: str | None = None  # copy, copy-start, follow, copy-alt, follow-alt or memory
    evidence: int = 0  # length of the copy it continues, or follower count
    above: int = 0  # n-gram nodes above it on its path (n-gram nodes only)
    bucket: str | None = None  # ngram.bucket(kind, evidence, above)
    agreed: bool = False  # a drafter candidate the n-gram source also proposed
    contradicted: bool = False  # a drafter candidate whose parent has another n-gram proposal

    def to_dict(self) -> dict:
        return dict(zip(_FIELDS, _GET_FIELDS(self)))


_FIELDS = Candidate.__slots__
_GET_FIELDS = attrgetter(*_FIELDS)  # one C call per candidate: this runs for every candidate of every round


def append_proposal(cands: list[Candidate], new: list[Candidate]) -> None:
    """Append a proposal indexed from 0 (its parents point into itself) to ``cands``, moving its
    parent indices past the candidates already there (a Proposer's ``propose``)."""
    at = len(cands)
    for c in new:
        if c.parent != ANCHOR:
            c.parent += at
    cands.extend(new)


def child_of(cands: list[Candidate], parent: int, token: int, source: str, **features) -> Candidate:
    """A candidate hanging below ``parent`` (an index into ``cands`` or ANCHOR)."""
    depth = 1 if parent == ANCHOR else cands[parent].depth + 1
    return Candidate(token=token, parent=parent, source=source, depth=depth, **features)


def cut_below_ends(cands: list[Candidate], is_end: Callable[[int], bool]) -> list[Candidate]:
    """The candidates that are not below an end-of-generation token, parents re-indexed (in
    place). Nothing after the end token is emitted, so a row below it is lost whatever the target
    says there: a copy of an earlier turn runs on through its end into the next turn's template
    (ARCHITECTURE.md, section 5). The end token itself stays: accepted, it ends the reply a
    round sooner."""
    if not any(is_end(c.token) for c in cands):
        return cands
    kept: list[Candidate] = []
    index: dict[int, int] = {}  # old index -> new
    for j, c in enumerate(cands):
        if c.parent != ANCHOR:
            if c.parent not in index or is_end(cands[c.parent].token):
                continue
            c.parent = index[c.parent]
        index[j] = len(kept)
        kept.append(c)
    return kept


def check_topological(cands: list[Candidate]) -> None:
    """Raise ValueError unless every parent precedes its child and depths agree (what a drafter
    must guarantee; tests check drafters with it)."""
    for j, c in enumerate(cands):
        if c.parent == ANCHOR:
            if c.depth != 1:
                raise ValueError(f"candidate {j}: child of the anchor must have depth 1")
        elif not 0 <= c.parent < j:
            raise ValueError(f"candidate {j}: parent {c.parent} does not precede it")
        elif c.depth != cands[c.parent].depth + 1:
            raise ValueError(f"candidate {j}: depth {c.depth} is not its parent's + 1")


def path_products(cands: list[Candidate]) -> list[float]:
    """Q_j = product of q along the path from the anchor to j (Eq. 1)."""
    return products([c.parent for c in cands], [c.q for c in cands])


def products(parents: list[int], qs: list[float]) -> list[float]:
    """Path products from parallel lists (parents precede children; ANCHOR for the anchor's)."""
    big_q: list[float] = []
    for parent, q in zip(parents, qs):
        big_q.append(q if parent == ANCHOR else big_q[parent] * q)
    return big_q


def best_first(big_q: list[float]) -> list[int]:
    """Candidate indices by decreasing Q, ties to the lower index (Proposition 1).

    With q <= 1 and parents indexed before children, every prefix of this order is a tree.
    """
    return sorted(range(len(big_q)), key=lambda j: (-big_q[j], j))


def prefix(order: list[int], width: int) -> list[int]:
    """The candidates verified at ``width`` rows: the first width - 1 of the order."""
    if width < 1:
        raise ValueError("a verify has at least one row (the anchor)")
    return order[: width - 1]


@dataclass(slots=True)
class Layout:
    """A tree laid out as verify rows, depth first. Row 0 is the anchor.

    Leaves get sequence ids 1..n_leaves in depth-first order, so the leaves below any row form the
    contiguous range ``seq_lo[row] .. seq_hi[row]`` (inclusive); that range is the row's KV
    sequence-id set. A tree with at most one leaf is a chain (``is_chain``).
    """

    cand: list[int]  # candidate index per row; ANCHOR for row 0
    token: list[int]  # token per row
    parent_row: list[int]  # row of the parent; -1 for the anchor
    depth: list[int]  # 0 for the anchor
    children: list[list[int]] = field(repr=False)  # child rows per row
    seq_lo: list[int] = field(repr=False)
    seq_hi: list[int] = field(repr=False)
    n_leaves: int = 0

    @property
    def width(self) -> int:
        return len(self.cand)

    @property
    def is_chain(self) -> bool:
        return all(len(ch) <= 1 for ch in self.children)

    @property
    def max_depth(self) -> int:
        return max(self.depth)


def layout(anchor_token: int, cands: list[Candidate], chosen: list[int]) -> Layout:
    """Lay out the anchor and the ``chosen`` candidates (a tree) depth first.

    Siblings are visited in the order they appear in ``chosen`` (best first when ``chosen`` is a
    prefix of the best-first order), so the most likely branch comes first. Raises ValueError if
    ``chosen`` is not closed under taking parents.
    """
    if not chosen:  # the anchor alone, most rounds' layout: no tree to walk
        return Layout([ANCHOR], [anchor_token], [-1], [0], [[]], [0], [0], 0)
    chosen_set = set(chosen)
    kids: dict[int, list[int]] = {ANCHOR: []}
    for j in chosen:
        p = cands[j].parent
        if p != ANCHOR and p not in chosen_set:
            raise ValueError(f"candidate {j} is chosen without its parent {p}")
        kids.setdefault(p, []).append(j)

    cand_of_row: list[int] = []
    parent_row: list[int] = []
    depth: list[int] = []
    children: list[list[int]] = []
    seq_lo: list[int] = []
    seq_hi: list[int] = []
    n_leaves = 0

    # Iterative DFS; leaf ranges are filled when a row's subtree is closed.
    stack: list[tuple[int, int]] = [(ANCHOR, -1)]
    while stack:
        j, prow = stack.pop()
        row = len(cand_of_row)
        cand_of_row.append(j)
        parent_row.append(prow)
        depth.append(0 if j == ANCHOR else cands[j].depth)
        children.append([])
        seq_lo.append(0)
        seq_hi.append(0)
        if prow >= 0:
            children[prow].append(row)
        below = kids.get(j, [])
        if not below:
            n_leaves += 1
            seq_lo[row] = seq_hi[row] = n_leaves
        for k in reversed(below):
            stack.append((k, row))
    # Fill internal ranges bottom-up: rows are in DFS preorder, so children come after parents.
    for row in range(len(cand_of_row) - 1, -1, -1):
        ch = children[row]
        if ch:
            seq_lo[row] = seq_lo[ch[0]]
            seq_hi[row] = seq_hi[ch[-1]]
    if len(cand_of_row) == 1:
        n_leaves = 0  # the anchor alone is not a leaf sequence: it decodes on sequence 0
        seq_lo[0] = seq_hi[0] = 0
    tokens = [anchor_token] + [cands[j].token for j in cand_of_row[1:]]
    return Layout(cand_of_row, tokens, parent_row, depth, children, seq_lo, seq_hi, n_leaves)


def hindsight_path(cands: list[dict], continuation: list[int]) -> list[int]:
    """The candidates, from the anchor down, whose tokens follow ``continuation`` (the tokens the
    target committed after the round's anchor, in this round and later ones): under greedy
    decoding, the path a verify of every candidate, placed or not, would have accepted."""
    kids: dict[tuple[int, int], int] = {}
    for j, c in enumerate(cands):
        kids.setdefault((c["parent"], c["token"]), j)
    path: list[int] = []
    parent = ANCHOR
    for t in continuation:
        j = kids.get((parent, t))
        if j is None:
            break
        path.append(j)
        parent = j
    return path


def accept_walk(lay: Layout, argmax: list[int]) -> tuple[list[int], int]:
    """Greedy acceptance: from the anchor, follow the child whose token is the target's argmax at
    its parent's row. Returns (accepted candidate rows, anchor excluded; the bonus token, i.e. the
    target's argmax at the deepest accepted row)."""
    path: list[int] = []
    row = 0
    while True:
        want = argmax[row]
        nxt = next((c for c in lay.children[row] if lay.token[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        row = nxt


# --- the head-based estimate (paper 3.3): what a candidate's own features say of its acceptance ---

P_CLIP = 1e-4  # probabilities are clipped to [1e-4, 1 - 1e-4] before a logit (|logit| <= 9.2)


def logit(p: float) -> float:
    p = min(max(p, P_CLIP), 1.0 - P_CLIP)
    return math.log(p / (1.0 - p))


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def head_q(c: dict, p_src: float, offset: float = 0.0) -> float:
    """The head-based estimate of one candidate, shifted by the per-request logit ``offset``."""
    src = c["source"]
    if src == FORCED:
        return 1.0
    if src == NGRAM:
        base = p_src
    elif src == PICK:
        base = c["h"] if c["h"] is not None else (c["share"] if c["share"] is not None else 0.5)
    elif src == SIBLING:
        r = c["share"] if c["share"] is not None else 0.0
        sigma = c.get("sigma")
        base = r * (1.0 - sigma) if sigma is not None else r * (1.0 - (c["h"] if c["h"] is not None else 0.5))
    else:
        raise ValueError(f"unknown source {src!r}")
    if offset == 0.0:
        return min(max(base, 0.0), 1.0)
    return sigmoid(logit(base) + offset)
