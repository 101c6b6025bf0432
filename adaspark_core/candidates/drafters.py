"""Model drafters (paper 2.1-2.2): what proposes the drafter's candidates of a round.

``--drafter`` specs: ``none`` (n-gram candidates only, the default on a CPU); ``dspark:FILE``, a
DSpark block drafter GGUF (``dflash`` architecture with Markov and confidence heads) made for the
target, all B positions from one forward pass over the target's hidden states; and
``model:FILE``, any GGUF whose vocabulary is identical to the target's (e.g. a small model of the
same family), run B steps along its own picks, top-K candidates per step.

The block has the shape of paper 2.2: the picks form the spine, each pick's K-1 siblings hang
from the pick's parent and are leaves. Features per candidate: a pick's ``h`` is DSpark's
confidence head (a draft model's: the pick's probability), ``share`` = sigma its share of the
top-K softmax mass; a sibling's ``share`` = r its share of the siblings' total, ``sigma`` and ``h``
those of its position's pick.
"""

from __future__ import annotations

import time

import numpy as np

from adaspark_core.base.errors import InputError
from adaspark_core.base.tree import ANCHOR, PICK, SIBLING, Candidate, append_proposal, child_of
from adaspark_core.engine.bindings import check_gguf
from adaspark_core.engine.dspark import DSparkContext
from adaspark_core.engine.llama import LlamaModel
from adaspark_core.engine.llama_sequence import LlamaSequence
from adaspark_core.engine.llama_target import LlamaTarget
from adaspark_core.engine.models import resolve_model


def top_k(logits: np.ndarray, k: int) -> tuple[list[int], list[float], float]:
    """(tokens, probabilities, pick probability) of the k most likely tokens, most likely first;
    probabilities under the full softmax. Ties to the lower token id (as the target's argmax)."""
    k = min(k, logits.shape[0])
    idx = np.argpartition(-logits, k - 1)[:k]
    idx = idx[np.lexsort((idx, -logits[idx]))]
    m = float(logits.max())
    z = float(np.exp(logits - m).sum())
    probs = np.exp(logits[idx] - m) / z
    return idx.tolist(), probs.tolist(), float(probs[0])


def block(steps: list[tuple[list[int], list[float]]], confidence=None) -> list[Candidate]:
    """The candidates of one block from each step's top-K (tokens, probabilities): the picks form
    the spine, each position's siblings hang from the pick's parent. ``confidence``: h per
    position from a confidence head; without one, h is the pick's probability."""
    cands: list[Candidate] = []
    parent = ANCHOR
    for i, (toks, probs) in enumerate(steps):
        mass = sum(probs)
        sigma = probs[0] / mass if mass > 0 else 1.0
        sib_mass = mass - probs[0]
        h = probs[0] if confidence is None else min(max(float(confidence[i]), 0.0), 1.0)
        pick = len(cands)
        cands.append(child_of(cands, parent, toks[0], PICK, h=h, share=sigma, sigma=sigma))
        for t, p in zip(toks[1:], probs[1:]):
            r = p / sib_mass if sib_mass > 0 else 0.0
            cands.append(child_of(cands, parent, t, SIBLING, h=h, share=r, sigma=sigma))
        parent = pick
    return cands


class ModelDrafter:
    """A same-vocabulary draft model on its own context (a Proposer, candidates/base.py).

    It reads the prompt when the request begins (beside the target's prefill, as llama.cpp's
    server does), then follows the committed text lazily: ``accept`` keeps the cells of the
    anchor and the picks the round committed, drops the rest, and holds what is missing as
    ``pending``; the next draft's first forward decodes it with the anchor, in one batch. So a
    round that drafts nothing (a depth of 0, learn/depth.py) costs the draft model nothing, and the
    stretch it skipped is caught up at the price of a prefill, not of one forward a round.

    ``propose`` drafts position by position, one forward each, while ``go_on`` (the depth
    learner's, given the picks' h so far) says to, up to the block; each forward's time and the
    first one's rows are ``last_draft`` (the round record's ``drafting``)."""

    name = "model"
    sequential = True  # one forward a position (Generation asks the depth learner before each)

    def __init__(self, target: LlamaModel, draft: LlamaModel, n_ctx: int, threads: int | None = None,
                 block: int = 4, top_k: int = 8, clock=time.perf_counter):
        if block < 1 or top_k < 1:
            raise InputError("--block and --draft-top-k must be at least 1")
        check_same_vocab(target, draft)
        self.model = draft
        self.B, self.K = block, top_k
        self.seq = LlamaSequence(draft, n_ctx, threads)
        self.clock = clock
        self.anchor: int | None = None
        self.pending: list[int] = []  # committed tokens (the anchor excluded) not in the cache yet
        self.spec: list[int] = []  # tokens decoded past the committed cells by the last propose
        self.last_draft: dict | None = None  # the last propose's forwards (ms) and first forward's rows

    @property
    def n_past(self) -> int:
        """Committed tokens it holds (the anchor excluded), in cells or pending: the target's."""
        return self.seq.n_past - len(self.spec) + len(self.pending)

    def close(self) -> None:
        self.seq.close()

    def begin(self, tokens: list[int]) -> None:
        self.seq.clear()
        self.seq.append(tokens[:-1])
        self.pending = []
        self.anchor = tokens[-1]
        self.spec = []

    def propose(self, cands: list[Candidate], depth_limit: int, go_on=None) -> None:
        append_proposal(cands, self.block(depth_limit, go_on))

    def block(self, depth_limit: int, go_on=None) -> list[Candidate]:
        """This round's block: at most min(B, ``depth_limit``) positions, top-K each, indexed
        from 0, as many as ``go_on(hs, limit)`` allows before each (None: all). The scheduler's depth
        limit keeps the anchor and the picks inside the context."""
        n = min(self.B, depth_limit)
        steps: list[tuple[list[int], list[float]]] = []
        hs: list[float] = []
        forwards: list[float] = []
        rows = 0
        while len(steps) < n and (go_on is None or go_on(hs, n)):
            t0 = self.clock()
            if not steps:  # the anchor, after what the cache has not seen
                rows = len(self.pending) + 1
                logits = self.seq.append([*self.pending, self.anchor], logits=True)
                self.pending = []
                self.spec = [self.anchor]
            else:
                logits = self.seq.append([steps[-1][0][0]], logits=True)
                self.spec.append(steps[-1][0][0])
            toks, probs, pick = top_k(logits, self.K)
            steps.append((toks, probs))
            hs.append(pick)
            forwards.append((self.clock() - t0) * 1e3)
        self.last_draft = {"forwards": forwards, "rows": rows, "limit": n}
        return block(steps)

    def accept(self, committed: list[int], verified=(), accepted=()) -> None:
        """``committed`` by the round (the last is the new anchor): the old anchor and all but the
        last join the committed text; the cells of those the draft decoded are kept."""
        new = [self.anchor, *committed[:-1]]
        keep = 0
        while keep < min(len(new), len(self.spec)) and new[keep] == self.spec[keep]:
            keep += 1
        if self.spec:
            self.seq.truncate(self.seq.n_past - len(self.spec) + keep)
        self.pending += new[keep:]
        self.spec = []
        self.anchor = committed[-1]

    def end(self, reply: list[int]) -> None:
        pass


class DSparkDrafter:
    """A DSpark block drafter (a Proposer, candidates/base.py): every round one forward pass of the anchor and
    B - 1 mask tokens over the target's hidden states gives B positions' top-K, the Markov head
    chaining each position to the previous one's pick (paper 2.1-2.2).

    Its KV cache mirrors the target's committed tokens but the anchor: after every target prefill
    chunk and every commit it takes the target's captured layer inputs of the committed rows
    (``LlamaTarget.take_hidden``) and injects them at the same positions."""

    name = "dspark"
    sequential = False  # one forward a block

    def __init__(self, target: LlamaTarget, draft: LlamaModel, threads: int | None = None,
                 block: int | None = None, top_k: int = 8):
        self.ctx = DSparkContext(draft, target, threads)
        if block is not None and not 1 <= block <= self.ctx.block_size:
            raise InputError(f"--block {block}: the DSpark drafter {draft.path.name} proposes at most "
                             f"{self.ctx.block_size} positions (its block size)")
        if top_k < 1:
            raise InputError("--draft-top-k must be at least 1")
        self.model = draft
        self.target = target
        self.B, self.K = block or self.ctx.block_size, top_k
        self.anchor: int | None = None
        self.n_past = 0  # committed cells (the anchor excluded): the anchor's position

    def close(self) -> None:
        """Free the draft context (before its target's: it reads the target's)."""
        self.ctx.close()

    def begin(self, tokens: list[int]) -> None:
        self.ctx.clear()
        self.n_past = 0
        self._take()
        self.anchor = tokens[-1]

    def _take(self) -> None:
        for pos0, rows in self.target.take_hidden():
            if pos0 != self.n_past:
                raise RuntimeError(f"DSpark cache out of step: rows for position {pos0}, cache ends at {self.n_past}")
            self.ctx.inject(pos0, rows)
            self.n_past = pos0 + len(rows)

    def propose(self, cands: list[Candidate], depth_limit: int, go_on=None) -> None:
        """The whole block, whatever ``go_on`` says: one forward drafts every position."""
        append_proposal(cands, self.block(depth_limit))

    def block(self, depth_limit: int) -> list[Candidate]:
        """This round's block: min(B, ``depth_limit``) positions, top-K each, indexed from 0."""
        n = min(self.B, depth_limit)
        if n <= 0:
            return []
        logits, conf = self.ctx.draft(self.anchor, self.n_past, n)
        steps = [top_k(row, self.K)[:2] for row in logits]
        return block(steps, conf)

    def accept(self, committed: list[int], verified=(), accepted=()) -> None:
        self._take()
        self.anchor = committed[-1]

    def end(self, reply: list[int]) -> None:
        pass


def check_same_vocab(target: LlamaModel, draft: LlamaModel) -> None:
    """InputError unless the two vocabularies are identical: same size, same token texts."""
    if target.n_vocab != draft.n_vocab:
        raise InputError(f"draft model {draft.path.name} has {draft.n_vocab} tokens; the target "
                         f"{target.path.name} has {target.n_vocab}: a draft model needs the target's vocabulary")
    for t in range(target.n_vocab):
        if target.piece_special(t) != draft.piece_special(t):
            raise InputError(f"draft model {draft.path.name} has another vocabulary than {target.path.name} "
                             f"(token {t} differs)")


MODEL_BLOCK = 4  # positions a draft model proposes per round unless --block says otherwise


def make_drafter(spec: str | None, target: LlamaTarget, threads: int | None = None,
                 block: int | None = None, top_k: int = 8) -> ModelDrafter | DSparkDrafter | None:
    """The drafter a ``--drafter`` spec names for ``target``; None for n-gram candidates only.
    ``block``: B, by default the DSpark file's block size or 4 for a draft model. Call it before
    the target's first request: a DSpark drafter sets up the target's hidden-state capture."""
    if spec in (None, "", "none"):
        return None
    kind, _, path = spec.partition(":")
    if kind == "model" and path:
        draft = LlamaModel(check_gguf(resolve_model(path)))
        return ModelDrafter(target.model, draft, target.n_ctx, threads, block or MODEL_BLOCK, top_k)
    if kind == "dspark" and path:
        return DSparkDrafter(target, LlamaModel(check_gguf(path)), threads, block, top_k)
    raise InputError(f"unknown drafter {spec!r}: use none, dspark:FILE or model:FILE")
