"""llama-cpp-python's own prompt-lookup decoding: ``Llama.generate`` with ``LlamaPromptLookupDecoding``,
greedy, through its high-level ``Llama`` API. The decoder a user of that API has today, which
``adaspark compare`` runs as its ``pld:N`` peer arms; here because only the engine runs a model.
Importing this module loads llama.cpp, so a simulated run imports it only when it needs it."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


class PromptLookupDecoder:
    """One ``Llama`` on ``path`` for every prompt-lookup size: each ``generate`` puts in the draft
    model of its own size first."""

    def __init__(self, path: Path, n_ctx: int, threads: int):
        # Made with a draft model and logits_all: Llama then keeps the logits of every row (its
        # score buffer is sized by the logits_all argument), which verifying drafts needs.
        self._llama = Llama(str(path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False,
                            logits_all=True, draft_model=LlamaPromptLookupDecoding())
        self._drafts: dict[int, LlamaPromptLookupDecoding] = {}

    @property
    def n_ctx(self) -> int:
        return self._llama.n_ctx()

    def generate(self, prompt: list[int], n: int) -> Iterator[int]:
        """Greedy tokens after ``prompt``, proposing ``n`` tokens a step by prompt lookup; endless
        (the caller stops at an end-of-generation token, its cap or the context)."""
        if n < 1:
            raise ValueError("prompt lookup proposes at least one token")
        self._llama.draft_model = self._drafts.setdefault(n, LlamaPromptLookupDecoding(num_pred_tokens=n))
        yield from self._llama.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0)

    def detokenize(self, tokens: list[int]) -> bytes:
        return self._llama.detokenize(tokens)
