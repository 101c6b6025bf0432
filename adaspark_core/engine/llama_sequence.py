"""One sequence on a llama.cpp context of its own, no trees: a draft model's cache
(``LlamaSequence``, candidates/drafters.py) and the reference re-score a decode is checked against
(``score``, ``rescore``).
"""

from __future__ import annotations

import llama_cpp as L
import numpy as np

from adaspark_core.base.errors import InputError
from adaspark_core.engine.bindings import FreedWithObject, thread_count
from adaspark_core.engine.llama import LlamaModel


class LlamaSequence(FreedWithObject):
    """One KV sequence on its own context, for a drafter: append tokens at the end, read the
    logits of the last one, drop a tail. (The draft model's cache; the target is LlamaTarget.)"""

    def __init__(self, model: LlamaModel, n_ctx: int, threads: int | None = None, n_batch: int = 512):
        self.model = model
        self.n_vocab = model.n_vocab
        self.n_ctx = n_ctx
        threads = thread_count(threads)
        cp = L.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = n_batch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        cp.flash_attn_type = 0  # as the target (FLASH_ATTN_NOTE)
        self.ctx = L.llama_init_from_model(model.ptr, cp)
        if not self.ctx:
            raise InputError(f"llama.cpp could not create a draft context of {n_ctx} tokens for {model.path.name}")
        self.mem = L.llama_get_memory(self.ctx)
        self._cap = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, 1)
        self.n_past = 0  # cells held = the next position

    def close(self) -> None:
        if getattr(self, "ctx", None):
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            self.ctx = None

    def clear(self) -> None:
        L.llama_memory_clear(self.mem, True)
        self.n_past = 0

    def append(self, tokens: list[int], logits: bool = False) -> np.ndarray | None:
        """Decode ``tokens`` at the next positions; the last one's logits (a copy) if asked."""
        b = self.batch
        for i in range(0, len(tokens), self._cap):
            chunk = tokens[i : i + self._cap]
            for r, t in enumerate(chunk):
                b.token[r] = t
                b.pos[r] = self.n_past + r
                b.n_seq_id[r] = 1
                b.seq_id[r][0] = 0
                b.logits[r] = 0
            last = i + len(chunk) == len(tokens)
            if logits and last:
                b.logits[len(chunk) - 1] = 1
            b.n_tokens = len(chunk)
            rc = L.llama_decode(self.ctx, b)
            if rc != 0:
                raise RuntimeError(f"draft llama_decode failed with code {rc} at position {self.n_past}")
            self.n_past += len(chunk)
        if not logits or not tokens:
            return None
        return np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, -1), (self.n_vocab,)).copy()

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` cells."""
        if n < self.n_past:
            L.llama_memory_seq_rm(self.mem, 0, n, -1)
            self.n_past = n


def score(model: LlamaModel, tokens: list[int], threads: int | None = None, flash_attn: bool = False) -> np.ndarray:
    """Logits after every position of ``tokens``, from one llama_decode on a fresh context:
    the reference a decode is checked against. Shape (len(tokens), n_vocab)."""
    n = len(tokens)
    threads = thread_count(threads)
    cp = L.llama_context_default_params()
    cp.n_ctx = max(n + 8, 64)
    cp.n_batch = cp.n_ubatch = n
    cp.n_outputs_max = n
    cp.n_threads = cp.n_threads_batch = threads
    cp.no_perf = True
    cp.flash_attn_type = 1 if flash_attn else 0
    ctx = L.llama_init_from_model(model.ptr, cp)
    batch = L.llama_batch_init(n, 0, 1)
    try:
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 1
        batch.n_tokens = n
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"score: llama_decode failed ({rc})")
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), (n, model.n_vocab)).copy()
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)


def rescore(model: LlamaModel, tokens: list[int], **kw) -> tuple[list[int], list[float]]:
    """The argmax after every position of a one-batch re-score, and its top-2 logit gap."""
    logits = score(model, tokens, **kw)
    top2 = np.partition(logits, -2, axis=1)[:, -2:]
    return logits.argmax(axis=1).tolist(), (top2[:, 1] - top2[:, 0]).tolist()
