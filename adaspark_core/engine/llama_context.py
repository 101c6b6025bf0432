"""One llama.cpp context with a unified KV cache and its batch buffers (``LlamaContext``), which
the slots verifying on it share (llama_target.py), and the size of a target's context
(``context_size``). ``model`` is a LlamaModel (llama.py), which makes targets and so is above.
"""

from __future__ import annotations

import ctypes

import llama_cpp as L
import numpy as np

from adaspark_core.base.errors import InputError
from adaspark_core.engine.bindings import UINT32_MAX, FreedWithObject, logits_address


class LlamaContext(FreedWithObject):
    """One llama.cpp context with a unified KV cache and its batch buffers: the slots verifying on
    it (LlamaTarget) share it, each on a range of sequence ids of its own, so one llama_decode can
    hold every slot's rows (LlamaBatch.verify)."""

    def __init__(self, model, n_cells: int, n_seq: int, rows: int, outputs: int, threads: int,
                 flash_attn: bool, max_width: int):
        cp = L.llama_context_default_params()
        cp.n_ctx = n_cells
        cp.n_batch = rows
        cp.n_ubatch = rows  # a verify never splits into ubatches
        cp.n_seq_max = n_seq
        # Logits buffer for a step's verify rows (``outputs``), not a prefill's; llama.cpp
        # reserves at least one output per sequence, so it must also cover n_seq.
        cp.n_outputs_max = max(outputs, n_seq)
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.kv_unified = True
        cp.swa_full = True
        cp.no_perf = True
        cp.flash_attn_type = 1 if flash_attn else 0  # see FLASH_ATTN_NOTE
        if model.recurrent:
            cp.n_rs_seq = max_width  # recurrent-state snapshots to roll back a rejected chain tail
        self.ctx = L.llama_init_from_model(model.ptr, cp)
        if not self.ctx:
            raise InputError(f"llama.cpp could not create a context of {n_cells} tokens for {model.path.name}")
        self.mem = L.llama_get_memory(self.ctx)
        # RPC servers and GPUs compute a decode after llama_decode returned, and only reading an
        # output waits for them (over RPC llama_synchronize waits for the messages to be sent,
        # not answered). The CPU's decode is synchronous.
        self.asynchronous = not model.layout.local_cpu
        self.n_vocab = model.n_vocab
        self.n_seq = n_seq
        self.cap = rows
        # Pending prompt tokens one step's decode may carry besides its verify rows (verify_together).
        self.prefill_budget = rows
        self.batch = L.llama_batch_init(rows, 0, n_seq)
        b = self.batch
        self.tok = np.ctypeslib.as_array(b.token, (rows,))
        self.pos = np.ctypeslib.as_array(b.pos, (rows,))
        self.nseq = np.ctypeslib.as_array(b.n_seq_id, (rows,))
        self.out = np.ctypeslib.as_array(b.logits, (rows,))
        self.seq = [np.ctypeslib.as_array(b.seq_id[i], (n_seq,)) for i in range(rows)]
        self.seq_ids = np.arange(n_seq, dtype=np.int32)
        # The same arrays as ctypes pointers, which a verify's few rows are written through
        # (LlamaTarget._fill); the numpy views above serve a prefill's many.
        self.tok_p, self.pos_p, self.nseq_p, self.out_p = b.token, b.pos, b.n_seq_id, b.logits
        self.seq_p = [b.seq_id[i] for i in range(rows)]
        self._logits_type = ctypes.c_float * (cp.n_outputs_max * self.n_vocab)
        self._logits_at: int | None = None  # the logits buffer's address, and a view of it
        self._logits_view: np.ndarray | None = None

    def close(self) -> None:
        if getattr(self, "ctx", None):
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            self.ctx = None

    def decode(self, n: int, where: str) -> None:
        self.batch.n_tokens = n
        rc = L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} (batch of {n} rows {where})")

    def decode_settled(self, n: int, where: str) -> None:
        """``decode`` of ``n`` rows none of which has an output (prompt tokens), returning once
        they are computed. Unread, an asynchronous backend's compute would be waited for by the
        next decode, and its time counted there: the first verify after a 2491-token prompt over
        two RPC servers took 2.1 s. So the last row reads one row of logits; on the CPU nothing
        is added."""
        if not self.asynchronous:
            return self.decode(n, where)
        self.out[n - 1] = 1
        self.decode(n, where)
        self.logits(1)

    def logits(self, rows: int) -> np.ndarray:
        """A view of the first ``rows`` output rows of the logits buffer. The view of the whole
        buffer is made again only when llama.cpp moved it: made every verify, it took 30-35 us of
        the 65 us reading one row's argmax cost, the decode having left the caches cold."""
        addr = logits_address(self.ctx)
        if addr != self._logits_at:
            flat = np.frombuffer(self._logits_type.from_address(addr), dtype=np.float32)
            self._logits_view, self._logits_at = flat.reshape(-1, self.n_vocab), addr
        return self._logits_view[:rows]


def context_size(model, n_ctx: int | None) -> int:
    n = int(n_ctx or min(model.n_ctx_train or 4096, 8192))
    if n > UINT32_MAX:
        # llama.cpp's n_ctx is a uint32_t: ctypes would cut the value to its low 32 bits (2^32 +
        # 16 became 16, and llama.cpp aborted the process), so refuse it before it gets there.
        raise InputError(f"a context of {n} tokens is more than llama.cpp can hold (at most {UINT32_MAX})")
    return n
