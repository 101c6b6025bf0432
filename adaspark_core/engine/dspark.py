"""A DSpark drafter's llama.cpp context, reading the target's hidden states (paper 2.2, DESIGN.md)."""

from __future__ import annotations

import ctypes

import llama_cpp as L
import numpy as np

from adaspark_core.base.errors import InputError
from adaspark_core.engine.bindings import FreedWithObject, ext, thread_count
from adaspark_core.engine.llama import LlamaModel
from adaspark_core.engine.llama_target import LlamaTarget


class DSparkContext(FreedWithObject):
    """A DSpark block drafter (the ``dflash`` architecture with a Markov head) on its own context,
    reading a target's hidden states, as vendored common/speculative.cpp runs it.

    The drafter has no embeddings or output head of its own: llama.cpp lends it the target's
    (``ctx_other``). Its KV cache holds, at every committed position but the anchor's, the
    target's captured layer inputs projected by the drafter (``inject``). A block is the anchor
    followed by mask tokens, decoded in one non-causal pass; slot i's logits (the Markov head's
    bias for the previous slot's argmax already added) propose the token at depth i + 1, and its
    confidence head the chance that slot is accepted given the slots before it are."""

    def __init__(self, model: LlamaModel, target: LlamaTarget, threads: int | None = None):
        if model.arch != "dflash":
            raise InputError(f"{model.path.name} is not a DSpark drafter (its architecture is {model.arch!r}, "
                             "not 'dflash')")
        if ext("dflash_selector_top_k")(model.ptr) > 0:
            raise InputError(f"{model.path.name} is a DFlash2 selector drafter, not DSpark: its selector "
                             "replaces the confidence head AdaSpark prices with")
        if model.meta("dflash.sample_from_anchor") == "false":
            raise InputError(f"{model.path.name} does not sample from the anchor; AdaSpark runs anchor-first "
                             "DSpark blocks")
        block = model.meta("dflash.block_size")
        self.mask = L.llama_vocab_mask(model.vocab)
        if not block or self.mask < 0:
            raise InputError(f"{model.path.name} has no {'block size' if not block else 'mask token'}")
        tm = target.model
        if model.n_embd != tm.n_embd or model.n_vocab != tm.n_vocab:
            raise InputError(f"DSpark drafter {model.path.name} (width {model.n_embd}, {model.n_vocab} tokens) "
                             f"was not made for {tm.path.name} (width {tm.n_embd}, {tm.n_vocab} tokens)")
        self.model = model
        self.block_size = int(block)
        self.has_confidence = model.meta("dflash.has_confidence_head") == "true"
        n_ids = ext("target_layer_ids_n")(model.ptr)
        ids = ext("target_layer_ids")(model.ptr)
        self.layer_ids = [int(ids[i]) for i in range(n_ids)]
        target.capture_hidden(self.layer_ids)
        threads = thread_count(threads)
        cp = L.llama_context_default_params()
        cp.n_ctx = target.n_ctx
        cp.n_batch = cp.n_ubatch = max(target.batch_rows, self.block_size)  # a prefill chunk of rows at once
        cp.n_seq_max = 1
        cp.n_outputs_max = self.block_size
        cp.n_threads = cp.n_threads_batch = threads
        cp.no_perf = True
        cp.flash_attn_type = 0  # as the target (FLASH_ATTN_NOTE)
        cp.ctx_other = target.ctx
        self.ctx = L.llama_init_from_model(model.ptr, cp)
        if not self.ctx:
            raise InputError(f"llama.cpp could not create a DSpark context for {model.path.name}")
        ext("set_embeddings_nextn")(self.ctx, True, True)  # the confidence, one row per output
        L.llama_set_causal_attn(self.ctx, False)  # a block attends both ways
        self.mem = L.llama_get_memory(self.ctx)
        self.n_vocab = model.n_vocab
        self._pos = (L.llama_pos * 4)()

    def close(self) -> None:
        if getattr(self, "ctx", None):
            L.llama_free(self.ctx)
            self.ctx = None

    def clear(self) -> None:
        L.llama_memory_clear(self.mem, True)

    def truncate(self, n: int) -> None:
        """Keep the cells of positions below ``n``."""
        L.llama_memory_seq_rm(self.mem, 0, n, -1)

    def pos_range(self) -> tuple[int, int] | None:
        lo = L.llama_memory_seq_pos_min(self.mem, 0)
        return None if lo < 0 else (lo, L.llama_memory_seq_pos_max(self.mem, 0))

    def _process(self, batch, what: str) -> None:
        try:
            rc = L.llama_process(self.ctx, L.LLAMA_PROCESS_TYPE_DECODE, batch)
        finally:
            L.llama_batch_ext_free(batch)
        if rc != 0:
            raise RuntimeError(f"DSpark {what} failed with code {rc}")

    def _set_pos(self, batch, idx: int, pos: int) -> None:
        self._pos[0] = pos
        L.llama_batch_ext_set_pos(batch, idx, self._pos)

    def inject(self, pos0: int, rows: np.ndarray) -> None:
        """Put the target's captured rows for positions pos0, pos0 + 1, ... into the KV cache."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        width = rows.shape[1]
        fp = ctypes.POINTER(ctypes.c_float)
        b = L.llama_batch_ext_init(self.ctx)
        for i in range(rows.shape[0]):
            idx = L.llama_batch_ext_add_embd(b, 0, L.llama_embd(rows[i].ctypes.data_as(fp), 1, width))
            self._set_pos(b, idx, pos0 + i)
        self._process(b, "hidden-state injection")

    def draft(self, anchor: int, pos0: int, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """One block of ``n`` slots (at most the block size) for the anchor at ``pos0``: the logits
        (n, n_vocab) and the confidence (n,), None without a confidence head. The block's cells
        are dropped again, so the cache keeps only committed positions."""
        n = min(n, self.block_size)
        b = L.llama_batch_ext_init(self.ctx)
        for i in range(n):
            idx = L.llama_batch_ext_add_token(b, 0, anchor if i == 0 else self.mask)
            self._set_pos(b, idx, pos0 + i)
            L.llama_batch_ext_set_output_logits(b, idx, True)
        try:
            self._process(b, "block decode")
            logits = np.stack([np.ctypeslib.as_array(L.llama_get_logits_ith(self.ctx, i), (self.n_vocab,))
                               for i in range(n)])  # np.stack copies
            conf = None
            if self.has_confidence:
                h = np.ctypeslib.as_array(ext("get_embeddings_nextn")(self.ctx), (n, self.model.n_embd))
                conf = h[:, 0].copy()  # the scalar is broadcast along each row
        finally:
            self.truncate(pos0)
        return logits, conf
