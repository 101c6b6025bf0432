"""A simulated language model for the whole command line: ``--model sim:CURVE``.

It lets the CLI, the store, the logs and the servers be tested end to end without loading
llama.cpp, where the model is not the point (decoding correctness on the real engine is tested on
the real model). Everything is deterministic: the same prompt gives the same reply, widths and
virtual times in every process.

- Tokens are bytes: token ``b + BYTE0`` is byte ``b``; 0 is unused, ``EOG`` ends a reply.
- The model's greedy next token is a fixed rule of the last two tokens and of the position's
  "era" (``ERA`` tokens long): a hash into a small lower-case alphabet. Inside an era the text
  soon falls into a cycle (a few dozen tokens long), so the n-gram fill finds continuations that are accepted; at an era's
  start the rule changes, so drafts are also rejected. A prompt whose text holds ``STOP_MARK``
  makes the reply end (EOG) at reply token ``STOP_AFTER``, to exercise ``finish: stop``.
- A sampled request draws from ``row_logits``: the greedy token well ahead of the other letters.
- Verify time is ``engine/sim.py``'s curve ``CURVE`` (a measured CPU table or a GPU curve) with
  seeded one-sided interference, on a virtual clock (``target.clock``) that the scheduler reads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import llguidance
import numpy as np

from adaspark_core.base.errors import InputError
from adaspark_core.base.paths import SIM_PREFIX
from adaspark_core.base.tree import Layout
from adaspark_core.engine.base import Verified
from adaspark_core.engine.sim import CURVES, Interference, VirtualClock

BYTE0 = 3
EOG = 2
ERA = 96
ALPHABET = b"etaoinshrdlu "  # what the rule emits: short words, ASCII, so every piece is text
STOP_MARK = "[stop]"
STOP_AFTER = 40
N_CTX = 4096
# A sampled request's distribution per row (row_logits): the rule's token at this logit, the other
# letters of the alphabet at 0, every other token far below. At temperature 0.7 the rule's token
# has p = 0.86, at 1.0 p = 0.63: sampled text strays from the rule and its copies now and then.
SAMPLED_TOP = 3.0


class SimModel:
    """The model half (tokenizer, chat template, pieces) of ``sim:CURVE``."""

    def __init__(self, spec: str):
        name = spec[len(SIM_PREFIX):]
        if name not in CURVES:
            raise InputError(f"unknown simulated model {spec!r}: use sim: with one of {', '.join(sorted(CURVES))}")
        self.name = name
        self.path = Path(spec)  # shown where a model file's name is; the fingerprint knows it is a sim
        self.desc = f"simulated model, verify times of {name}"
        self.chat_template = None  # its chat markup is its own (chat_prompt) and shows no tools
        self.n_ctx_train = N_CTX
        self.n_vocab = BYTE0 + 256
        self._key = hashlib.sha256(f"adaspark-simlm:{name}".encode()).digest()[:16]

    def tokenize(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        return [b + BYTE0 for b in text.encode("utf-8")]  # no BOS, no special tokens

    def takes_tools(self) -> bool:
        return False

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None, reply_start: str = "") -> list[int]:
        if tools:
            raise InputError(f"the simulated model {self.name} takes no tools")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>" + reply_start
        return self.tokenize(text)

    def piece(self, token: int) -> bytes:
        return bytes([token - BYTE0]) if token >= BYTE0 else b""

    def grammar_tokenizer(self) -> llguidance.LLTokenizer:
        """The byte vocabulary as llguidance reads it (decode/grammar.py): EOG a special token."""
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocab(self.n_vocab)))

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def next_token(self, prev: int, cur: int, pos: int) -> int:
        """The greedy token at position ``pos`` after the tokens ``prev``, ``cur``."""
        era = (pos // ERA) % 8
        h = hashlib.blake2b(bytes((era, prev & 255, cur & 255)), key=self._key, digest_size=1).digest()[0]
        b = ALPHABET[h % len(ALPHABET)]
        if b + BYTE0 == cur:  # no letter twice in a row: the text cycles, never sticks on one letter
            b = ALPHABET[(h + 1) % len(ALPHABET)]
        return b + BYTE0

    def target(self, n_ctx: int | None = None, threads: int | None = None, reuse_prefix: bool = False,
               seed: int = 0) -> "SimLMTarget":
        return SimLMTarget(self, n_ctx or N_CTX, seed)  # no prefill is simulated: nothing to reuse

    def close(self) -> None:
        pass


class SimLMTarget:
    """A Target (engine/base.py) for a SimModel; the KV cache is the committed token list."""

    supports_trees = True
    supports_chains = True
    reused = 0  # prompt tokens taken from the cache (engine/llama_target.py): none, no prefill is simulated

    def __init__(self, model: SimModel, n_ctx: int, seed: int = 0):
        self.model = model
        self.n_ctx = n_ctx
        self.n_vocab = model.n_vocab
        self.curve = CURVES[model.name]
        self.noise = Interference(seed=seed)
        self.clock = VirtualClock()
        self.tokens: list[int] = []  # committed, the anchor last
        self.n_past = 0
        self.anchor: int | None = None
        self._stop_at: int | None = None
        self._pending: Layout | None = None
        self._argmax: list[int] = []  # the last verify's

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        return self.model.tokenize(text, special)

    def piece(self, token: int) -> bytes:
        return self.model.piece(token)

    def is_eog(self, token: int) -> bool:
        return self.model.is_eog(token)

    def start(self, tokens: list[int]) -> None:
        if not tokens or len(tokens) >= self.n_ctx:
            raise InputError("the prompt must be non-empty and leave room in the context")
        self.tokens = list(tokens)
        self.n_past = len(tokens) - 1
        self.anchor = tokens[-1]
        text = b"".join(map(self.model.piece, tokens))
        self._stop_at = len(tokens) + STOP_AFTER if STOP_MARK.encode() in text else None
        self._pending = None

    def room(self) -> int:
        return self.n_ctx - self.n_past - 1

    def _next(self, prev: int, cur: int, pos: int) -> int:
        return EOG if pos == self._stop_at else self.model.next_token(prev, cur, pos)

    def verify(self, lay: Layout) -> Verified:
        assert self.anchor is not None and lay.token[0] == self.anchor, "row 0 must be the anchor"
        assert self.n_past + lay.width <= self.n_ctx, "the verify's rows overflow the context"
        prev0 = self.tokens[-2] if len(self.tokens) > 1 else 0
        pairs: list[tuple[int, int]] = []  # per row: the last two tokens of its path
        argmax = []
        for r in range(lay.width):
            pairs.append((prev0, self.anchor) if r == 0 else (pairs[lay.parent_row[r]][1], lay.token[r]))
            argmax.append(self._next(*pairs[r], self.n_past + lay.depth[r] + 1))
        ms = self.curve.true_ms(lay.width, self.n_past + 1) * (1.0 + self.noise.draw())
        self.clock.advance_ms(ms)
        self._pending = lay
        self._argmax = argmax
        return Verified(argmax, ms, ms, 0.0)

    def row_logits(self) -> np.ndarray:
        """The last verify's logits, one row per verified row (see SAMPLED_TOP)."""
        rows = np.full((len(self._argmax), self.n_vocab), -30.0, dtype=np.float32)
        rows[:, [b + BYTE0 for b in ALPHABET]] = 0.0
        rows[np.arange(len(self._argmax)), self._argmax] = SAMPLED_TOP
        return rows

    def commit(self, lay: Layout, keep_rows: list[int], next_anchor: int) -> float:
        assert lay is self._pending, "commit of a layout that was not the last verify"
        self.tokens += [lay.token[r] for r in keep_rows] + [next_anchor]
        self.n_past += 1 + len(keep_rows)
        self.anchor = next_anchor
        self._pending = None
        return 0.0

    def discard(self, lay: Layout) -> None:
        self._pending = None

    def close(self) -> None:
        pass


class _ByteVocab:
    """What llguidance.TokenizerWrapper reads of a tokenizer, for the byte tokens: each token's
    bytes (the unused and the end token as special tokens, marked by the 0xff lead byte as
    llguidance's own llama.cpp reader marks them) and the encoder."""

    def __init__(self, n_vocab: int):
        self.eos_token_id, self.bos_token_id = EOG, None
        self.tokens = [b"\xff<unused>", b"\xff<bos>", b"\xff<eog>"] + [bytes([b]) for b in range(n_vocab - BYTE0)]
        self.special_token_ids = list(range(BYTE0))

    def __call__(self, data: bytes) -> list[int]:
        return [b + BYTE0 for b in data]
