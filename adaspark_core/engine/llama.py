"""llama-cpp-python model: weights, vocabulary, tokens and pieces, the model's own chat template.

Contexts are made from it: a target verifying trees (``target``, llama_target.py; its context,
llama_context.py), the slots of one context for requests verified together (llama_batch.py), a
draft model's sequence and the reference re-score (llama_sequence.py). bindings.py holds what
they share with dspark.py.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import warnings

import llama_cpp as L
import llguidance
import llguidance.llamacpp

from adaspark_core.base.errors import InputError
from adaspark_core.engine.bindings import check_gguf, init_backend
from adaspark_core.engine.devices import DeviceLayout, bound_rpc_reads, effective, model_params
from adaspark_core.engine.llama_target import LlamaTarget


class LlamaModel:
    """A loaded GGUF model: weights, vocabulary, chat template. Contexts are made from it."""

    def __init__(self, path: str | os.PathLike, verbose: bool = False, chat_template: str | None = None,
                 layout: DeviceLayout = DeviceLayout()):
        self.path = check_gguf(path)
        init_backend(verbose)
        # where its layers run (``--n-gpu-layers``, ``--device``, ...), as it takes effect here
        self.layout = effective(layout, L)
        mparams = L.llama_model_default_params()
        keep = model_params(mparams, self.layout, L)  # noqa: F841 (arrays the parameters point into)
        self.ptr = L.llama_model_load_from_file(str(self.path).encode(), mparams)
        if not self.ptr:
            raise InputError(f"llama.cpp could not load the model: {self.path}")
        if self.layout.rpc:
            bound_rpc_reads(self.layout)
        self.vocab = L.llama_model_get_vocab(self.ptr)
        self.n_vocab = L.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = L.llama_model_n_ctx_train(self.ptr)
        self.recurrent = bool(L.llama_model_is_recurrent(self.ptr) or L.llama_model_is_hybrid(self.ptr))
        buf = ctypes.create_string_buffer(256)
        L.llama_model_desc(self.ptr, buf, len(buf))
        self.desc = buf.value.decode(errors="replace")
        tmpl = L.llama_model_chat_template(self.ptr, None)
        # ``chat_template``: one given in place of the file's (--chat-template-file)
        self.chat_template = chat_template or (tmpl.decode() if tmpl else None)
        self._chat_formatter = None  # compiled at the first chat_prompt (_render_jinja)
        self._takes_tools: bool | None = None
        self._grammar_tokenizer: llguidance.LLTokenizer | None = None
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

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, reply_start: str = "") -> list[int]:
        """Tokens of ``messages`` rendered with the model's own chat template, ready for the
        assistant's reply, which starts with ``reply_start`` (a required tool call's opening; its
        markup may be special tokens). ``tools``: the functions the template shows the model.
        InputError if the model has no chat template (use raw mode).

        Only the template's own markup may become control tokens. Message text is plain text: a
        user who writes ``<|im_end|>`` gets those characters, not the end of their turn (else any
        message could open a system turn). The template is rendered once more with a unique mark
        in place of each message's text, which splits the prompt into markup and message text.
        The markup's control tokens cut the prompt into the same raw-text runs that llama.cpp's
        own tokenizer would cut it into, and each run is tokenized with special parsing off, so a
        prompt without control-token text in its messages gets exactly the tokens of the whole
        rendered text (and the same as llama-cpp-python's ``create_chat_completion``). Tools and
        tool calls are rendered as markup, so they may hold no control-token text."""
        if not self.chat_template:
            raise InputError(f"{self.path.name} has no chat template; use --raw to send the text as is")
        calls = [m["tool_calls"] for m in messages if m.get("tool_calls")]
        if tools or calls:
            shown = json.dumps([tools, calls], ensure_ascii=False)
            if self.tokenize(shown, special=True, add_bos=False) != self.tokenize(shown, special=False, add_bos=False):
                raise InputError("a tool or a tool call holds control-token text, which the template would make markup")
        tokens = self._chat_tokens(messages, tools)
        return tokens + (self.tokenize(reply_start, special=True, add_bos=False) if reply_start else [])

    def takes_tools(self) -> bool:
        """Whether the chat template shows the model the tools it is given (a probe function's
        name in the rendered prompt), as llama-server's ``--jinja`` finds out."""
        if self._takes_tools is None:
            probe = "adaspark_probe_function"
            shown = self._render_jinja([{"role": "user", "content": "?"}],
                                       [{"type": "function", "function": {"name": probe, "parameters": {}}}])
            self._takes_tools = probe in shown
        return self._takes_tools

    def _chat_tokens(self, messages: list[dict], tools: list[dict] | None) -> list[int]:
        text = self._render_jinja(messages, tools)
        nonce = os.urandom(8).hex()
        # (an empty content stays empty: a template may test it, as before an assistant's tool calls)
        masked = self._render_jinja([{**m, "content": f"<{nonce}:{i}>"} if m["content"] else m
                                     for i, m in enumerate(messages)], tools)
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

    def _render_jinja(self, messages: list[dict], tools: list[dict] | None = None) -> str:
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
            return self._chat_formatter(messages=messages, tools=tools or None).prompt
        except Exception as e:  # a template error (compiling or rendering) names the model, not our stack
            raise InputError(f"the chat template of {self.path.name} failed: {e}") from None

    def target(self, n_ctx: int | None = None, threads: int | None = None, reuse_prefix: bool = False) -> "LlamaTarget":
        """A verifying context on this model (``n_ctx``: default the model's, at most 8192)."""
        return LlamaTarget(self, n_ctx=n_ctx, threads=threads, reuse_prefix=reuse_prefix)

    def grammar_tokenizer(self) -> llguidance.LLTokenizer:
        """The vocabulary as llguidance reads it (decode/grammar.py), built at the first call
        (0.3 s for SmolLM2's 49k tokens, 1 s for Qwen2.5's 152k). Every end-of-generation token
        ends a reply the grammar has accepted, not only the vocabulary's EOS: chat models end a
        turn with their own (``<|im_end|>``)."""
        if self._grammar_tokenizer is None:
            ends = [t for t in range(self.n_vocab) if L.llama_vocab_is_eog(self.vocab, t)]
            with warnings.catch_warnings():  # it reads each token's attributes by a name llama.cpp deprecated
                warnings.simplefilter("ignore", DeprecationWarning)
                self._grammar_tokenizer = llguidance.llamacpp.lltokenizer_from_vocab(self.vocab, self.n_vocab, ends)
        return self._grammar_tokenizer

    def piece_special(self, token: int) -> bytes:
        n = L.llama_token_to_piece(self.vocab, token, self._piece_buf, len(self._piece_buf), 0, True)
        return self._piece_buf.raw[: max(n, 0)]
