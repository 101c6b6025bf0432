"""llama-cpp-python target: tree verify in one llama_decode, KV commit, chat template, timing.

The model, the target and a drafter's sequence; bindings.py holds what they share with dspark.py.

How a tree is verified (DESIGN.md, "Engine facts"): the context is created with a unified KV
cache. Every leaf of the tree gets its own sequence id 1..L; a row's sequence-id set is the set of
leaves below it (the anchor carries all of them) and its position is the anchor's position plus its
depth. llama.cpp's KQ mask tests a cell against the row's *first* sequence id, so each row sees
exactly the committed prefix (which every leaf sequence must carry) and its own ancestors. A chain
(at most one leaf) decodes on sequence 0 and its commit is a single tail removal.

Leaf sequences are synced lazily. DESIGN.md copies the whole committed prefix into every leaf
sequence before each tree verify and drops it after; in llama.cpp each copied cell is a std::map
update per sequence, so at 16 rows and 1,000 tokens of context that cost 4.6 ms of host time per
round, growing with the context. Instead a leaf sequence keeps the prefix it already has:
``_synced[s]`` is the number of committed positions sequence s carries (always a prefix of
sequence 0's own cells, never a cell of its own), and a verify only tops it up with the positions
committed since. The commit removes the leaf sequences from the tree's positions only: 0.55 ms of
host time at 16 rows (15 leaves) at 1,000 tokens of context (``make bench-host``).
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
        # prompt matches what users of Llama.create_chat_completion get.
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        def text_of(tok: int) -> str:
            return self.piece_special(tok).decode(errors="replace") if tok >= 0 else ""

        fmt = Jinja2ChatFormatter(
            template=self.chat_template,
            eos_token=text_of(L.llama_vocab_eos(self.vocab)),
            bos_token=text_of(L.llama_vocab_bos(self.vocab)),
        )
        try:
            return fmt(messages=messages).prompt
        except Exception as e:  # a template error names the model, not our stack
            raise InputError(f"the chat template of {self.path.name} failed: {e}") from None

    def target(self, n_ctx: int | None = None, threads: int | None = None, reuse_prefix: bool = False) -> "LlamaTarget":
        """A verifying context on this model (``n_ctx``: default the model's, at most 8192)."""
        return LlamaTarget(self, n_ctx=n_ctx, threads=threads, reuse_prefix=reuse_prefix)

    def piece_special(self, token: int) -> bytes:
        n = L.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, True)
        return self._piece_buf.raw[: max(n, 0)]


class LlamaTarget(FreedWithObject):
    """A target for tree verification on one llama.cpp context.

    State between rounds: sequence 0 holds the committed tokens except the last one, the anchor,
    which is not yet in the KV cache; it is row 0 of the next verify, at position ``self.n_past``.
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
    ):
        self.model = model
        # Keep the committed KV across requests and prefill only what follows the longest common
        # token prefix (``start``). Off where nothing follows a request on this target.
        self.reuse_prefix = reuse_prefix
        self.n_vocab = model.n_vocab
        self.n_ctx = int(n_ctx or min(model.n_ctx_train or 4096, 8192))
        if self.n_ctx > UINT32_MAX:
            # llama.cpp's n_ctx is a uint32_t: ctypes would cut the value to its low 32 bits (2^32 +
            # 16 became 16, and llama.cpp aborted the process), so refuse it before it gets there.
            raise InputError(f"a context of {self.n_ctx} tokens is more than llama.cpp can hold (at most {UINT32_MAX})")
        self.max_width = max_width
        self.supports_trees = not model.recurrent
        threads = thread_count(threads)
        self.threads = threads
        # Sequence 0 plus one per leaf; a tree of max_width rows has at most max_width-1 leaves.
        self.n_seq = 1 if model.recurrent else min(max_width, MAX_SEQ)
        cp = L.llama_context_default_params()
        cp.n_ctx = self.n_ctx
        cp.n_batch = max(n_batch, max_width)
        cp.n_ubatch = cp.n_batch  # a verify never splits into ubatches
        cp.n_seq_max = self.n_seq
        # Logits buffer for a verify's rows, not a prefill's; llama.cpp reserves at least one
        # output per sequence, so it must also cover n_seq.
        cp.n_outputs_max = max(max_width, self.n_seq)
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
            raise InputError(f"llama.cpp could not create a context of {self.n_ctx} tokens for {model.path.name}")
        # A recurrent state cannot drop a rejected tail unless llama.cpp keeps snapshots to roll
        # back to; without them only one row per round is exact.
        self.supports_chains = not model.recurrent or L.llama_n_rs_seq(self.ctx) > 0
        self.mem = L.llama_get_memory(self.ctx)
        self._cap = cp.n_batch
        self.batch = L.llama_batch_init(self._cap, 0, self.n_seq)
        b = self.batch
        self._tok = np.ctypeslib.as_array(b.token, (self._cap,))
        self._pos = np.ctypeslib.as_array(b.pos, (self._cap,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, (self._cap,))
        self._out = np.ctypeslib.as_array(b.logits, (self._cap,))
        self._seq = [np.ctypeslib.as_array(b.seq_id[i], (self.n_seq,)) for i in range(self._cap)]
        self._seq_ids = np.arange(self.n_seq, dtype=np.int32)
        self._logits_type = ctypes.c_float * (cp.n_outputs_max * self.n_vocab)
        self.n_past = 0  # cells of sequence 0 = position of the anchor
        self.anchor: int | None = None
        self._synced = [0] * self.n_seq  # committed positions each leaf sequence carries
        self._kv: list[int] = []  # the tokens at positions 0..n_past-1 of sequence 0
        self.reused = 0  # prompt tokens the last start took from the cache instead of prefilling
        self._last_rows = 0
        # Hidden-state capture for a DSpark drafter (capture_hidden): the target layers whose
        # inputs are kept, the last verify's rows, and the committed rows not yet taken.
        self._hidden_ids: list[int] = []
        self._verify_hidden: np.ndarray | None = None
        self._hidden_pending: list[tuple[int, np.ndarray]] = []

    def close(self) -> None:
        if getattr(self, "ctx", None):
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            self.ctx = None

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

    def start(self, tokens: list[int]) -> None:
        """Prefill ``tokens[:-1]``; ``tokens[-1]`` becomes the anchor.

        With ``reuse_prefix``, the cells of the longest common prefix of the committed tokens and
        ``tokens[:-1]`` stay (as llama-server's prompt cache and llama-cpp-python's ``Llama`` do)
        and only the rest is prefilled: a conversation's next turn pays for its new text only.
        Kept cells were computed by verifies and prefills of other shapes, so a greedy reply can
        differ from a fresh prefill's at near ties (paper 3.5), never elsewhere. Not on a recurrent
        model (its state cannot be cut back to a prefix) nor with a DSpark drafter reading the
        prefill's hidden states (it needs them all); there the cache is cleared."""
        if not 0 < len(tokens) < self.n_ctx:
            raise ValueError(f"cannot start with {len(tokens)} tokens in a context of {self.n_ctx}")
        body = tokens[:-1]
        keep = 0
        if self.reuse_prefix and not self.model.recurrent and not self._hidden_ids:
            for a, b in zip(self._kv, body):
                if a != b:
                    break
                keep += 1
        if keep:
            L.llama_memory_seq_rm(self.mem, 0, keep, -1)
            for s in range(1, self.n_seq):  # a leaf sequence holds a prefix of sequence 0's cells
                if self._synced[s] > keep:
                    L.llama_memory_seq_rm(self.mem, s, keep, -1)
                    self._synced[s] = keep
        else:
            L.llama_memory_clear(self.mem, True)
            self._synced = [0] * self.n_seq
        self.n_past = self.reused = keep
        self._kv = body[:keep]
        self._hidden_pending = []
        body = body[keep:]
        for i in range(0, len(body), self._cap):
            chunk = body[i : i + self._cap]
            n = len(chunk)
            self._tok[:n] = chunk
            self._pos[:n] = np.arange(self.n_past, self.n_past + n, dtype=np.int32)
            self._nseq[:n] = 1
            for r in range(n):
                self._seq[r][0] = 0
            self._out[:n] = 0
            self.batch.n_tokens = n
            self._decode()
            if self._hidden_ids:
                self._hidden_pending.append((self.n_past, self._read_hidden(n)))
            self.n_past += n
        self._kv += body
        self.anchor = tokens[-1]

    def _decode(self) -> None:
        rc = L.llama_decode(self.ctx, self.batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with code {rc} (batch of {self.batch.n_tokens} rows at position {self.n_past})")

    def room(self) -> int:
        """How many more tokens the context can take after the anchor."""
        return self.n_ctx - self.n_past - 1

    def verify(self, lay: Layout) -> Verified:
        t0 = time.perf_counter()
        w = lay.width
        if w > self.max_width:
            raise ValueError(f"verify of {w} rows exceeds max_width {self.max_width}")
        if lay.token[0] != self.anchor:
            raise ValueError("the layout's row 0 is not the current anchor")
        chain = lay.is_chain
        if not chain and not self.supports_trees:
            raise ValueError("recurrent/hybrid models verify chains only")
        if w > 1 and not self.supports_chains:
            raise ValueError("this recurrent model cannot roll back a chain; only one row per round")
        if self.n_past + lay.max_depth >= self.n_ctx:
            raise ValueError("the tree runs past the context")
        self._tok[:w] = lay.token
        self._pos[:w] = np.asarray(lay.depth, dtype=np.int32) + self.n_past
        self._out[:w] = 1
        if chain:
            self._nseq[:w] = 1
            for r in range(w):
                self._seq[r][0] = 0
        else:
            ids = self._seq_ids
            for r in range(w):
                lo, hi = lay.seq_lo[r], lay.seq_hi[r]
                self._nseq[r] = hi - lo + 1
                self._seq[r][: hi - lo + 1] = ids[lo : hi + 1]
            synced = self._synced
            for s in range(1, lay.n_leaves + 1):
                if synced[s] < self.n_past:  # top up with the positions committed since
                    L.llama_memory_seq_cp(self.mem, 0, s, synced[s], -1)
                    synced[s] = self.n_past
        self.batch.n_tokens = w
        t1 = time.perf_counter()
        self._decode()
        t2 = time.perf_counter()
        argmax = self._logits(w).argmax(axis=1).tolist()
        if self._hidden_ids:
            self._verify_hidden = self._read_hidden(w)
        t3 = time.perf_counter()
        self._last_rows = w
        decode_ms = (t2 - t1) * 1e3
        verify_ms = (t3 - t0) * 1e3
        return Verified(argmax, verify_ms, decode_ms, verify_ms - decode_ms)

    def commit(self, lay: Layout, keep_rows: list[int], next_anchor: int) -> float:
        """Keep the anchor and ``keep_rows`` (a path from it, top down) in sequence 0, drop every
        other row, and make ``next_anchor`` the new anchor. Returns milliseconds taken."""
        t0 = time.perf_counter()
        p0 = self.n_past
        end = p0 + len(keep_rows) + 1  # first position past the kept path
        if lay.is_chain:
            L.llama_memory_seq_rm(self.mem, 0, end, -1)
        else:
            deepest = keep_rows[-1] if keep_rows else 0
            s_star = lay.seq_lo[deepest]  # any leaf below the deepest kept row carries the path
            L.llama_memory_seq_rm(self.mem, s_star, end, -1)
            L.llama_memory_seq_cp(self.mem, s_star, 0, p0, -1)
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
            L.llama_memory_seq_rm(self.mem, 0, self.n_past, -1)
        else:
            self._drop_leaves(lay.n_leaves, self.n_past)

    def _drop_leaves(self, n_leaves: int, p0: int) -> None:
        """Take leaf sequences 1..n_leaves off every cell at position >= p0 (the tree's cells);
        a cell left with no sequence is freed. They keep the committed prefix below p0."""
        for s in range(1, n_leaves + 1):
            L.llama_memory_seq_rm(self.mem, s, p0, -1)

    # --- hidden states for a DSpark drafter ------------------------------------------------------

    def capture_hidden(self, layer_ids: list[int]) -> None:
        """Keep the inputs of target layers ``layer_ids`` for every token the KV cache commits, for
        ``take_hidden``. Before the first ``start``: llama.cpp sizes its buffers for them."""
        if self.model.arch not in HIDDEN_STATE_ARCHS:
            raise InputError(f"a DSpark drafter reads the target's hidden states, which llama.cpp does not "
                             f"expose for the {self.model.arch!r} architecture of {self.model.path.name}")
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
        """The last verify's logits, one row per verified row: a view, valid until the next
        decode (a sampled round draws its tokens from it)."""
        return self._logits(self._last_rows)

    def last_logits(self) -> np.ndarray:
        """A copy of the last verify's logits, one row per verified row (tests compare them)."""
        return self._logits(self._last_rows).copy()

    def _logits(self, rows: int) -> np.ndarray:
        """A view of the first ``rows`` output rows of the logits buffer. (np.frombuffer on a
        cached ctypes array type: np.ctypeslib.as_array builds a new type per call, 70 us.)"""
        addr = ctypes.cast(L.llama_get_logits(self.ctx), ctypes.c_void_p).value
        flat = np.frombuffer(self._logits_type.from_address(addr), dtype=np.float32)
        return flat[: rows * self.n_vocab].reshape(rows, self.n_vocab)

    def synced(self, seq: int) -> int:
        """Committed positions leaf sequence ``seq`` carries (tests check the KV invariants)."""
        return self._synced[seq]

    def seq_ranges(self) -> dict[int, tuple[int, int]]:
        """(min, max) position per sequence that holds cells."""
        out = {}
        for s in range(self.n_seq):
            lo = L.llama_memory_seq_pos_min(self.mem, s)
            if lo >= 0:
                out[s] = (lo, L.llama_memory_seq_pos_max(self.mem, s))
        return out

    def seq_state_bytes(self, seq: int = 0) -> int:
        """Size of sequence ``seq``'s saved state: affine in the number of cells it holds."""
        return L.llama_state_seq_get_size(self.ctx, seq)


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
