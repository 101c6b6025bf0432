"""llama-cpp-python target: tree verify in one llama_decode, KV commit, prompt-prefix reuse.

A request's slot of a llama.cpp context (llama_context.py), made by LlamaModel.target (llama.py)
or LlamaBatch (llama_batch.py); ``model`` is that LlamaModel. It also captures the hidden states
a DSpark drafter reads (dspark.py).

How a tree is verified (DESIGN.md, "Engine facts"): the context is created with a unified KV
cache. Every leaf of the tree gets its own sequence id 1..L; a row's sequence-id set is the set of
leaves below it (the anchor carries all of them) and its position is the anchor's position plus its
depth. llama.cpp's KQ mask tests a cell against the row's *first* sequence id, so each row sees
exactly the committed prefix (which every leaf sequence must carry) and its own ancestors. A chain
(at most one leaf) decodes on sequence 0 and its commit is a single tail removal.

Leaf sequences are synced lazily: copying the whole committed prefix into every leaf before each
verify (DESIGN.md) costs a std::map update per cell and sequence, growing with the context
(ARCHITECTURE.md, section 5). Instead a leaf sequence keeps the prefix it already has:
``_synced[s]`` is the number of committed positions sequence s carries (always a prefix of
sequence 0's own cells, never a cell of its own), and a verify only tops it up with the positions
committed since. The commit removes the leaf sequences from the tree's positions only.

Several requests verify together on one context's slots (``verify_together``; ``LlamaBatch``
makes the slots): each slot is a LlamaTarget on its own range of sequence ids, "sequence 0" above
being its first.
"""

from __future__ import annotations

import time

import llama_cpp as L
import numpy as np

from adaspark_core.base.errors import InputError
from adaspark_core.base.tree import MAX_WIDTH, Layout
from adaspark_core.engine.base import Verified
from adaspark_core.engine.bindings import HIDDEN_STATE_ARCHS, MAX_SEQ, FreedWithObject, ext, thread_count
from adaspark_core.engine.llama_context import LlamaContext, context_size


class LlamaTarget(FreedWithObject):
    """A target for tree verification: one request's slot of a llama.cpp context.

    State between rounds: the slot's first sequence (``seq0``, sequence 0 on a context of its own)
    holds the committed tokens except the last one, the anchor, which is not yet in the KV cache;
    it is row 0 of the next verify, at position ``self.n_past``. The slot's other sequences are its
    tree's leaves. Made alone (``LlamaModel.target``) it owns its context; made by ``LlamaBatch``
    it is one of several slots on a shared one, each with ``n_ctx`` positions of its own.
    """

    def __init__(
        self,
        model,
        n_ctx: int | None = None,
        threads: int | None = None,
        max_width: int = MAX_WIDTH,
        n_batch: int = 512,
        flash_attn: bool = False,
        reuse_prefix: bool = False,
        *,
        shared: tuple[LlamaContext, int, int] | None = None,
    ):
        self.model = model
        # Keep the committed KV across requests and prefill only what follows the longest common
        # token prefix (``start``). Off where nothing follows a request on this target.
        self.reuse_prefix = reuse_prefix
        self.n_vocab = model.n_vocab
        self.n_ctx = context_size(model, n_ctx)
        self.supports_trees = not model.recurrent
        self.threads = thread_count(threads)
        if shared is None:
            # Sequence 0 plus one per leaf; a tree of max_width rows has at most max_width-1 leaves.
            n_seq = 1 if model.recurrent else min(max_width, MAX_SEQ)
            self._c = LlamaContext(model, self.n_ctx, n_seq, max(n_batch, max_width), max_width, self.threads,
                                    flash_attn, max_width)
            self._owner, self.seq0 = True, 0
        else:
            self._c, self.seq0, n_seq = shared
            self._owner = False
        self.n_seq = n_seq
        # A tree needs a leaf sequence per leaf; a chain (or a recurrent model) only the first.
        self.max_width = max_width if model.recurrent else min(max_width, n_seq)
        self.ctx, self.mem = self._c.ctx, self._c.mem
        # A recurrent state cannot drop a rejected tail unless llama.cpp keeps snapshots to roll
        # back to; without them only one row per round is exact.
        self.supports_chains = not model.recurrent or L.llama_n_rs_seq(self.ctx) > 0
        self.n_past = 0  # cells of the slot's first sequence = position of the anchor
        self.anchor: int | None = None
        self._synced = [0] * self.n_seq  # committed positions each leaf sequence carries
        self._kv: list[int] = []  # the tokens at positions 0..n_past-1 of the first sequence
        self.reused = 0  # prompt tokens the last start took from the cache instead of prefilling
        self.pending: list[int] = []  # prompt tokens a deferred start has not prefilled yet
        self._row0 = 0  # where the last verify's rows start in the shared batch
        self._last_rows = 0
        # Hidden-state capture for a DSpark drafter (capture_hidden): the target layers whose
        # inputs are kept, the last verify's rows, and the committed rows not yet taken.
        self._hidden_ids: list[int] = []
        self._verify_hidden: np.ndarray | None = None
        self._hidden_pending: list[tuple[int, np.ndarray]] = []

    def close(self) -> None:
        if self._owner:
            self._c.close()
        self.ctx = None

    @property
    def batch_rows(self) -> int:
        """Rows one llama_decode of this context takes (a prefill goes in chunks of this many)."""
        return self._c.cap

    # --- delegation to the model ---------------------------------------------------------------

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.model.tokenize(text, special)

    def piece(self, token: int) -> bytes:
        return self.model.piece(token)

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    # --- decoding ------------------------------------------------------------------------------

    def start(self, tokens: list[int], defer: bool = False) -> None:
        """Prefill ``tokens[:-1]``; ``tokens[-1]`` becomes the anchor.

        With ``reuse_prefix``, the cells of the longest common prefix of the committed tokens and
        ``tokens[:-1]`` stay (as llama-server's prompt cache and llama-cpp-python's ``Llama`` do)
        and only the rest is prefilled: a conversation's next turn pays for its new text only.
        Kept cells were computed by verifies and prefills of other shapes, so a greedy reply can
        differ from a fresh prefill's at near ties (paper 3.5), never elsewhere. Not on a recurrent
        model (its state cannot be cut back to a prefix) nor with a DSpark drafter reading the
        prefill's hidden states (it needs them all); there the slot's cells are cleared.

        ``defer``: prefill nothing now; the tokens wait in ``pending`` and go in chunks into the
        next steps' decodes beside the other slots' verify rows (``verify_together``), so a
        joining request does not stall the running ones for its whole prompt."""
        if not 0 < len(tokens) < self.n_ctx:
            raise ValueError(f"cannot start with {len(tokens)} tokens in a context of {self.n_ctx}")
        if defer and self._hidden_ids:
            raise ValueError("a slot capturing hidden states prefills at once")
        s0 = self.seq0
        body = tokens[:-1]
        keep = 0
        if self.reuse_prefix and not self.model.recurrent and not self._hidden_ids:
            for a, b in zip(self._kv, body):
                if a != b:
                    break
                keep += 1
        if keep:
            L.llama_memory_seq_rm(self.mem, s0, keep, -1)
            for s in range(1, self.n_seq):  # a leaf sequence holds a prefix of the first one's cells
                if self._synced[s] > keep:
                    L.llama_memory_seq_rm(self.mem, s0 + s, keep, -1)
                    self._synced[s] = keep
        elif self._owner:
            L.llama_memory_clear(self.mem, True)
            self._synced = [0] * self.n_seq
        else:  # the other slots' cells stay
            for s in range(self.n_seq):
                L.llama_memory_seq_rm(self.mem, s0 + s, -1, -1)
            self._synced = [0] * self.n_seq
        self.n_past = self.reused = keep
        self._kv = body[:keep]
        self._hidden_pending = []
        self.pending = body[keep:]
        self.anchor = tokens[-1]
        while self.pending and not defer:
            n = self._fill_prefill(0, self._c.cap)
            # The prompt is in when start returns, not when the first verify waited for it; the
            # chunks before the last need not wait (an RPC server computes one while the next goes in).
            decode = self._c.decode_settled if n == len(self.pending) else self._c.decode
            decode(n, f"at position {self.n_past}")
            self._prefilled(n)

    def _fill_prefill(self, row0: int, room: int) -> int:
        """Write up to ``room`` of the pending prompt tokens into the batch from row ``row0``, on
        this slot's first sequence, no logits. Returns how many."""
        c, s0 = self._c, self.seq0
        chunk = self.pending[:room]
        n, end = len(chunk), row0 + len(chunk)
        c.tok[row0:end] = chunk
        c.pos[row0:end] = np.arange(self.n_past, self.n_past + n, dtype=np.int32)
        c.nseq[row0:end] = 1
        for r in range(row0, end):
            c.seq[r][0] = s0
        c.out[row0:end] = 0
        return n

    def _prefilled(self, n: int) -> None:
        """The first ``n`` pending tokens are in the KV cache (the decode that held them ran)."""
        if self._hidden_ids:  # prefilled alone, from row 0
            self._hidden_pending.append((self.n_past, self._read_hidden(n)))
        self._kv += self.pending[:n]
        self.pending = self.pending[n:]
        self.n_past += n

    def room(self) -> int:
        """How many more tokens the context can take after the anchor."""
        return self.n_ctx - self.n_past - 1

    def verify(self, lay: Layout) -> Verified:
        """The layout's rows in one llama_decode of this slot alone."""
        return verify_together([(self, lay)])[0]

    def _check(self, lay: Layout) -> None:
        w = lay.width
        if w > self.max_width:
            raise ValueError(f"verify of {w} rows exceeds max_width {self.max_width}")
        if self.pending:
            raise ValueError("the slot's prompt is not all prefilled yet")
        if lay.token[0] != self.anchor:
            raise ValueError("the layout's row 0 is not the current anchor")
        if not lay.is_chain and not self.supports_trees:
            raise ValueError("recurrent/hybrid models verify chains only")
        if w > 1 and not self.supports_chains:
            raise ValueError("this recurrent model cannot roll back a chain; only one row per round")
        if self.n_past + lay.max_depth >= self.n_ctx:
            raise ValueError("the tree runs past the context")

    def _fill(self, lay: Layout, row0: int) -> None:
        """Write the layout's rows into the shared batch from row ``row0``, on this slot's
        sequences; top up the leaf sequences it uses with the positions committed since."""
        c, s0, w = self._c, self.seq0, lay.width
        end = row0 + w
        # Row by row through ctypes: one row took 7 us so against 52 as numpy slices (a verify
        # runs right after a decode, with the caches cold).
        tok, pos, out, n_past = c.tok_p, c.pos_p, c.out_p, self.n_past
        for r, (t, d) in enumerate(zip(lay.token, lay.depth), row0):
            tok[r], pos[r], out[r] = t, n_past + d, 1
        if lay.is_chain:
            nseq, seq = c.nseq_p, c.seq_p
            for r in range(row0, end):
                nseq[r] = 1
                seq[r][0] = s0
        else:
            ids = c.seq_ids
            for r in range(w):
                lo, hi = s0 + lay.seq_lo[r], s0 + lay.seq_hi[r]
                c.nseq[row0 + r] = hi - lo + 1
                c.seq[row0 + r][: hi - lo + 1] = ids[lo : hi + 1]
            synced = self._synced
            for s in range(1, lay.n_leaves + 1):
                if synced[s] < self.n_past:  # top up with the positions committed since
                    L.llama_memory_seq_cp(self.mem, s0, s0 + s, synced[s], -1)
                    synced[s] = self.n_past
        self._row0, self._last_rows = row0, w

    def commit(self, lay: Layout, keep_rows: list[int], next_anchor: int) -> float:
        """Keep the anchor and ``keep_rows`` (a path from it, top down) in the first sequence,
        drop every other row, and make ``next_anchor`` the new anchor. Returns milliseconds taken."""
        t0 = time.perf_counter()
        p0, s0 = self.n_past, self.seq0
        end = p0 + len(keep_rows) + 1  # first position past the kept path
        if lay.is_chain:
            # Nothing lies past a chain kept whole (a verify of the anchor alone, most rounds):
            # llama.cpp's seq_rm would scan every cell to find that out. A recurrent state is
            # always told, so its snapshots follow the rule they always did.
            if len(keep_rows) + 1 < lay.width or self.model.recurrent:
                L.llama_memory_seq_rm(self.mem, s0, end, -1)
        else:
            deepest = keep_rows[-1] if keep_rows else 0
            s_star = s0 + lay.seq_lo[deepest]  # any leaf below the deepest kept row carries the path
            L.llama_memory_seq_rm(self.mem, s_star, end, -1)
            L.llama_memory_seq_cp(self.mem, s_star, s0, p0, -1)
            self._drop_leaves(lay.n_leaves, p0)
        if self._hidden_ids:
            self._hidden_pending.append((p0, self._verify_hidden[[0, *keep_rows]]))
        self._kv.append(self.anchor)
        self._kv += [lay.token[r] for r in keep_rows]
        self.n_past = end
        self.anchor = next_anchor
        return (time.perf_counter() - t0) * 1e3

    def discard(self, lay: Layout) -> None:
        """Undo a verify without committing anything: the KV cache is as before it."""
        if lay.is_chain:
            L.llama_memory_seq_rm(self.mem, self.seq0, self.n_past, -1)
        else:
            self._drop_leaves(lay.n_leaves, self.n_past)

    def _drop_leaves(self, n_leaves: int, p0: int) -> None:
        """Take leaf sequences 1..n_leaves off every cell at position >= p0 (the tree's cells);
        a cell left with no sequence is freed. They keep the committed prefix below p0."""
        for s in range(1, n_leaves + 1):
            L.llama_memory_seq_rm(self.mem, self.seq0 + s, p0, -1)

    # --- hidden states for a DSpark drafter ------------------------------------------------------

    def capture_hidden(self, layer_ids: list[int]) -> None:
        """Keep the inputs of target layers ``layer_ids`` for every token the KV cache commits, for
        ``take_hidden``. Before the first ``start``: llama.cpp sizes its buffers for them."""
        if self.model.arch not in HIDDEN_STATE_ARCHS:
            raise InputError(f"a DSpark drafter reads the target's hidden states, which llama.cpp does not "
                             f"expose for the {self.model.arch!r} architecture of {self.model.path.name}")
        if not self._owner:
            raise InputError("a DSpark drafter reads one request's hidden states: it cannot serve batched requests")
        bad = [i for i in layer_ids if not 0 <= i <= self.model.n_layer]
        if bad:
            raise InputError(f"the drafter reads target layers {bad}; {self.model.path.name} has "
                             f"{self.model.n_layer} layers")
        for lid in layer_ids:
            ext("set_embeddings_layer_inp")(self.ctx, lid, True)
        self._hidden_ids = list(layer_ids)

    def _read_hidden(self, rows: int) -> np.ndarray:
        """The last decode's rows of the captured layer inputs, side by side: (rows, layers x n_embd)."""
        get, n_embd = ext("get_embeddings_layer_inp"), self.model.n_embd
        parts = [np.ctypeslib.as_array(get(self.ctx, lid), (rows, n_embd)) for lid in self._hidden_ids]
        return np.concatenate(parts, axis=1)  # a copy: the buffers are overwritten by the next decode

    def take_hidden(self) -> list[tuple[int, np.ndarray]]:
        """The captured rows of the tokens committed since the last call, as (first position, rows):
        the prefill's chunks, then the anchor and kept path of every commit."""
        out, self._hidden_pending = self._hidden_pending, []
        return out

    # --- inspection (tests, profile) -----------------------------------------------------------

    def row_logits(self) -> np.ndarray:
        """The last verify's logits, one row per verified row of this slot: a view, valid until
        the next decode (a sampled round draws its tokens from it)."""
        return self._c.logits(self._row0 + self._last_rows)[self._row0 :]

    def last_logits(self) -> np.ndarray:
        """A copy of the last verify's logits, one row per verified row (tests compare them)."""
        return self.row_logits().copy()

    def synced(self, seq: int) -> int:
        """Committed positions leaf sequence ``seq`` (of this slot) carries (tests check the KV
        invariants)."""
        return self._synced[seq]

    def seq_ranges(self) -> dict[int, tuple[int, int]]:
        """(min, max) position per sequence of this slot that holds cells (0: its first)."""
        out = {}
        for s in range(self.n_seq):
            lo = L.llama_memory_seq_pos_min(self.mem, self.seq0 + s)
            if lo >= 0:
                out[s] = (lo, L.llama_memory_seq_pos_max(self.mem, self.seq0 + s))
        return out

    def seq_state_bytes(self, seq: int = 0) -> int:
        """Size of sequence ``seq``'s saved state: affine in the number of cells it holds."""
        return L.llama_state_seq_get_size(self.ctx, self.seq0 + seq)


def verify_together(items: list[tuple[LlamaTarget, Layout]], prefill: list[LlamaTarget] = ()) -> list[Verified]:
    """Every slot's layout in one llama_decode (slots of one context, each at most once): each
    row sees its own slot's committed cells and its own ancestors only (a row's sequence ids are
    its slot's), so each slot's rows are what a verify of that slot alone gives, up to the
    kernels' near ties (paper 3.5). Each Verified has its slot's argmax and the step's times.

    ``prefill``: slots with pending prompt tokens (a deferred ``start``); as many of those tokens
    as the context's ``prefill_budget`` and the batch's room allow ride in the same decode, after
    the rows, without logits (llama-server's continuous batching does the same): the weights are
    streamed once for both. The prefill's time is in the step's."""
    t0 = time.perf_counter()
    c = (items[0][0] if items else prefill[0])._c
    rows = 0
    for slot, lay in items:
        if slot._c is not c:
            raise ValueError("slots of different contexts cannot verify together")
        slot._check(lay)
        if rows + lay.width > c.cap:
            raise ValueError(f"a step of {rows + lay.width} rows exceeds the batch's {c.cap}")
        slot._fill(lay, rows)
        rows += lay.width
    outputs = rows
    chunks = []
    for slot in prefill:
        if slot._c is not c:
            raise ValueError("slots of different contexts cannot decode together")
        room = min(c.cap, outputs + c.prefill_budget) - rows
        if room <= 0:
            break
        n = slot._fill_prefill(rows, room)
        chunks.append((slot, n))
        rows += n
    t1 = time.perf_counter()
    # A step of prompt tokens alone that ends a prompt returns once it is computed, as a start
    # does; a step with verify rows waits anyway, reading their logits.
    settle = not outputs and any(n == len(slot.pending) for slot, n in chunks)
    (c.decode_settled if settle else c.decode)(rows, f"of {len(items)} request(s) and {rows - outputs} prompt token(s)")
    t2 = time.perf_counter()
    for slot, n in chunks:
        slot._prefilled(n)
    argmax = c.logits(outputs).argmax(axis=1).tolist()
    for slot, lay in items:
        if slot._hidden_ids:
            slot._verify_hidden = slot._read_hidden(lay.width)
    t3 = time.perf_counter()
    decode_ms, verify_ms = (t2 - t1) * 1e3, (t3 - t0) * 1e3
    return [Verified(argmax[slot._row0 : slot._row0 + lay.width], verify_ms, decode_ms, verify_ms - decode_ms)
            for slot, lay in items]
