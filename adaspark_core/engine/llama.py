"""llama-cpp-python target: tree verify in one llama_decode, KV commit, chat template, timing.

The model, the target and a drafter's sequence; bindings.py holds what they share with dspark.py.

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

Several requests verify together on one context's slots (``LlamaBatch``, ``verify_together``):
each slot is a LlamaTarget on its own range of sequence ids, "sequence 0" above being its first.
"""

from __future__ import annotations

import ctypes
import os
import re
import time

import llama_cpp as L
import numpy as np

from adaspark_core.base.errors import InputError
from adaspark_core.base.tree import MAX_WIDTH, Layout
from adaspark_core.engine.base import Verified
from adaspark_core.engine.bindings import (
    HIDDEN_STATE_ARCHS,
    MAX_SEQ,
    UINT32_MAX,
    FreedWithObject,
    check_gguf,
    ext,
    init_backend,
    logits_address,
    thread_count,
)


class LlamaModel:
    """A loaded GGUF model: weights, vocabulary, chat template. Contexts are made from it."""

    def __init__(self, path: str | os.PathLike, verbose: bool = False):
        self.path = check_gguf(path)
        init_backend(verbose)
        mparams = L.llama_model_default_params()
        self.ptr = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.ptr:
            raise InputError(f"llama.cpp could not load the model: {self.path}")
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(self.ptr)
        self.recurrent = bool(L.llama_model_is_recurrent(self.ptr) or L.llama_model_is_hybrid(self.ptr))
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.ptr, buf, len(buf))
        self.desc = buf.value.decode(errors="replace")
        tmpl = L.llama_model_chat_template(self.ptr, None)
        self.chat_template = tmpl.decode() if tmpl else None
        self._chat_formatter = None  # compiled at the first chat_prompt (_render_jinja)
        self._piece_buf = ctypes.create_string_buffer(256)
        self._pieces: dict[int, bytes] = {}
        self.arch = self.meta("general.architecture") or "?"
        self.n_embd = L.llama_model_n_embd(self.ptr)
        self.n_layer = L.llama_model_n_layer(self.ptr)

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, None if the file has no such key."""
        buf = ctypes.create_string_buffer(512)
        n = L.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    def close(self) -> None:
        if self.ptr:
            L.llama_model_free(self.ptr)
            self.ptr = None

    # --- text ----------------------------------------------------------------------------------

    def tokenize(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        data = text.encode()
        if add_bos is None:
            add_bos = bool(L.llama_vocab_get_add_bos(self.vocab))
        cap = len(data) + 8
        arr = (L.llama_token * cap)()
        n = L.llama_tokenize(self.vocab, data, len(data), arr, cap, add_bos, special)
        if n < 0:  # buffer too small: -n is the size needed
            cap = -n
            arr = (L.llama_token * cap)()
            n = L.llama_tokenize(self.vocab, data, len(data), arr, cap, add_bos, special)
        return list(arr[:n])

    def piece(self, token: int) -> bytes:
        """The bytes of one token (special tokens render as nothing)."""
        got = self._pieces.get(token)
        if got is None:
            n = L.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, False)
            got = self._piece_buf.raw[: max(n, 0)]
            self._pieces[token] = got
        return got

    def is_eog(self, token: int) -> bool:
        return bool(L.llama_vocab_is_eog(self.vocab, token))

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Tokens of ``messages`` rendered with the model's own chat template, ready for the
        assistant's reply. InputError if the model has no chat template (use raw mode).

        Only the template's own markup may become control tokens. Message text is plain text: a
        user who writes ``<|im_end|>`` gets those characters, not the end of their turn (else any
        message could open a system turn). The template is rendered once more with a unique mark
        in place of each message's text, which splits the prompt into markup and message text.
        The markup's control tokens cut the prompt into the same raw-text runs that llama.cpp's
        own tokenizer would cut it into, and each run is tokenized with special parsing off, so a
        prompt without control-token text in its messages gets exactly the tokens of the whole
        rendered text (and the same as llama-cpp-python's ``create_chat_completion``)."""
        if not self.chat_template:
            raise InputError(f"{self.path.name} has no chat template; use --raw to send the text as is")
        text = self._render_jinja(messages)
        nonce = os.urandom(8).hex()
        masked = self._render_jinja([{**m, "content": f"<{nonce}:{i}>"} for i, m in enumerate(messages)])
        parts = re.split(f"<{nonce}:(\\d+)>", masked)  # markup, index, markup, index, ..., markup
        contents = [messages[int(i)]["content"] for i in parts[1::2]]
        if "".join(x for pair in zip(parts[::2], contents + [""]) for x in pair) != text:
            # The template rewrites message text (trims it, splits it): the marks do not show
            # where the text went. Plain text in that case only if it holds no control tokens.
            if any(self.tokenize(c, special=True, add_bos=False) != self.tokenize(c, special=False, add_bos=False)
                   for c in contents):
                raise InputError(f"the chat template of {self.path.name} rewrites message text, so a message "
                                 f"holding control-token text cannot be kept as plain text; use --raw")
            return self.tokenize(text, special=True, add_bos=False)
        pieces: list[str | int] = []  # raw text and the markup's control tokens, in order
        for k, markup in enumerate(parts[::2]):
            pieces += self._split_markup(markup)
            if k < len(contents):
                pieces.append(contents[k])
        tokens: list[int] = []
        run = ""
        for p in pieces + [-1]:
            if isinstance(p, str):
                run += p
                continue
            if run:
                tokens += self.tokenize(run, special=False, add_bos=False)
            run = ""
            if p >= 0:
                tokens.append(p)
        return tokens

    def _split_markup(self, markup: str) -> list[str | int]:
        """``markup`` as its raw-text pieces and the control tokens llama.cpp finds in it. A
        token that strips whitespace beside it (the LSTRIP/RSTRIP attributes) takes it along."""
        out: list[str | int] = []
        at = 0
        for tok in self.tokenize(markup, special=True, add_bos=False):
            attr = L.llama_vocab_get_attr(self.vocab, tok)
            if not attr & (L.LLAMA_TOKEN_ATTR_CONTROL | L.LLAMA_TOKEN_ATTR_UNKNOWN):
                continue
            word = self.piece_special(tok).decode(errors="replace")
            found = markup.find(word, at)
            if not word or found < 0:  # cannot place it: keep the markup's own tokens whole
                return list(self.tokenize(markup, special=True, add_bos=False))
            raw = markup[at:found]
            if attr & L.LLAMA_TOKEN_ATTR_LSTRIP:
                raw = raw.rstrip()
            out += [raw, tok]
            at = found + len(word)
            if attr & L.LLAMA_TOKEN_ATTR_RSTRIP:
                at += len(markup[at:]) - len(markup[at:].lstrip())
        out.append(markup[at:])
        return out

    def _render_jinja(self, messages: list[dict]) -> str:
        # The model's own Jinja template, as llama-cpp-python's high-level API renders it, so the
        # prompt matches what users of Llama.create_chat_completion get. Compiled once per model:
        # compiling it took 2-3 ms, twice a request (chat_prompt renders it twice), before every
        # reply's first token.
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        def text_of(tok: int) -> str:
            return self.piece_special(tok).decode(errors="replace") if tok >= 0 else ""

        try:
            if self._chat_formatter is None:
                self._chat_formatter = Jinja2ChatFormatter(
                    template=self.chat_template,
                    eos_token=text_of(L.llama_vocab_eos(self.vocab)),
                    bos_token=text_of(L.llama_vocab_bos(self.vocab)),
                )
            return self._chat_formatter(messages=messages).prompt
        except Exception as e:  # a template error (compiling or rendering) names the model, not our stack
            raise InputError(f"the chat template of {self.path.name} failed: {e}") from None

    def target(self, n_ctx: int | None = None, threads: int | None = None, reuse_prefix: bool = False) -> "LlamaTarget":
        """A verifying context on this model (``n_ctx``: default the model's, at most 8192)."""
        return LlamaTarget(self, n_ctx=n_ctx, threads=threads, reuse_prefix=reuse_prefix)

    def piece_special(self, token: int) -> bytes:
        n = L.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, True)
        return self._piece_buf.raw[: max(n, 0)]


class _Context(FreedWithObject):
    """One llama.cpp context with a unified KV cache and its batch buffers: the slots verifying on
    it (LlamaTarget) share it, each on a range of sequence ids of its own, so one llama_decode can
    hold every slot's rows (LlamaBatch.verify)."""

    def __init__(self, model: LlamaModel, n_cells: int, n_seq: int, rows: int, outputs: int, threads: int,
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

    def logits(self, rows: int) -> np.ndarray:
        """A view of the first ``rows`` output rows of the logits buffer. The view of the whole
        buffer is made again only when llama.cpp moved it: made every verify, it took 30-35 us of
        the 65 us reading one row's argmax cost, the decode having left the caches cold."""
        addr = logits_address(self.ctx)
        if addr != self._logits_at:
            flat = np.frombuffer(self._logits_type.from_address(addr), dtype=np.float32)
            self._logits_view, self._logits_at = flat.reshape(-1, self.n_vocab), addr
        return self._logits_view[:rows]


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
        model: LlamaModel,
        n_ctx: int | None = None,
        threads: int | None = None,
        max_width: int = MAX_WIDTH,
        n_batch: int = 512,
        flash_attn: bool = False,
        reuse_prefix: bool = False,
        *,
        shared: tuple[_Context, int, int] | None = None,
    ):
        self.model = model
        # Keep the committed KV across requests and prefill only what follows the longest common
        # token prefix (``start``). Off where nothing follows a request on this target.
        self.reuse_prefix = reuse_prefix
        self.n_vocab = model.n_vocab
        self.n_ctx = _context_size(model, n_ctx)
        self.supports_trees = not model.recurrent
        self.threads = thread_count(threads)
        if shared is None:
            # Sequence 0 plus one per leaf; a tree of max_width rows has at most max_width-1 leaves.
            n_seq = 1 if model.recurrent else min(max_width, MAX_SEQ)
            self._c = _Context(model, self.n_ctx, n_seq, max(n_batch, max_width), max_width, self.threads,
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

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.model.chat_prompt(messages)

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
            self._c.decode(n, f"at position {self.n_past}")
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


def _context_size(model: LlamaModel, n_ctx: int | None) -> int:
    n = int(n_ctx or min(model.n_ctx_train or 4096, 8192))
    if n > UINT32_MAX:
        # llama.cpp's n_ctx is a uint32_t: ctypes would cut the value to its low 32 bits (2^32 +
        # 16 became 16, and llama.cpp aborted the process), so refuse it before it gets there.
        raise InputError(f"a context of {n} tokens is more than llama.cpp can hold (at most {UINT32_MAX})")
    return n


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
    c.decode(rows, f"of {len(items)} request(s) and {rows - outputs} prompt token(s)")
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


class LlamaBatch(FreedWithObject):
    """``n`` slots on one llama.cpp context, each a LlamaTarget with ``n_ctx`` positions and
    ``MAX_SEQ // n`` sequences of its own (so its trees hold at most that many rows), for
    requests verified together (``verify_together``): llama-server's parallel slots, with trees.
    The unified cache holds every slot's cells; a step's rows attend every cell in use (masked to
    their own slot's), so a step costs what its rows and the slots' contexts together cost."""

    def __init__(self, model: LlamaModel, n: int, n_ctx: int | None = None, threads: int | None = None,
                 max_width: int = MAX_WIDTH, reuse_prefix: bool = False, prefill_per_step: int | None = None):
        if model.recurrent:
            raise InputError(f"{model.path.name} is recurrent/hybrid: its state has no slots to batch requests in")
        if not 1 <= n <= MAX_SEQ:
            raise InputError(f"parallel requests must be 1 to {MAX_SEQ}, got {n}")
        per_slot = MAX_SEQ // n if n > 1 else min(max_width, MAX_SEQ)
        width = min(max_width, per_slot)
        n_ctx = _context_size(model, n_ctx)
        # Every slot's context, plus a tree's rows beyond it for each (a verify near the end of a
        # slot's context must still find cells).
        cells = n * (n_ctx + width)
        if cells > UINT32_MAX:
            raise InputError(f"{n} slots of {n_ctx} tokens are more than llama.cpp can hold")
        self._c = _Context(model, cells, per_slot * n, max(512, n * width), n * width, thread_count(threads),
                           False, width)
        # A joining request's prompt fills what a step's batch has room for, as llama-server fills
        # its n_batch; ``prefill_per_step`` bounds it lower (shorter steps while a prompt goes in).
        if prefill_per_step is not None:
            self._c.prefill_budget = max(1, prefill_per_step)
        self.slots = [LlamaTarget(model, n_ctx, threads, width, reuse_prefix=reuse_prefix,
                                  shared=(self._c, i * per_slot, per_slot)) for i in range(n)]

    def verify(self, items: list[tuple[LlamaTarget, Layout]], prefill: list[LlamaTarget] = ()) -> list[Verified]:
        """Several slots' layouts in one llama_decode, with chunks of the ``prefill`` slots'
        pending prompts (``verify_together``)."""
        return verify_together(items, prefill)

    def close(self) -> None:
        for s in getattr(self, "slots", []):
            s.close()
        if getattr(self, "_c", None) is not None:
            self._c.close()


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
