"""A request's grammar (structured output): which tokens its reply may take next, and what that
changes in a round. The grammar engine is llguidance (the one llama.cpp itself links with
``LLAMA_LLGUIDANCE``): its token mask costs 14-29 us a row here (medians) against 6-18 ms for llama.cpp's GBNF
sampler over the whole vocabulary (ARCHITECTURE.md, section 5), so a mask per verify row is cheap
beside the row itself.

Under a grammar the target's token at a row is its argmax over the tokens the grammar allows
after the row's prefix: greedy output is plain decoding under the same grammar, and a sampled
row draws from the constrained distribution (the mask first, then the sampler chain). A round
uses the grammar three ways (``Grammar.fit``, ``GrammarRows``):

- a candidate the grammar forbids after its own path is cut before it is priced, with its subtree;
- where the grammar allows exactly one token (a schema's keys and punctuation), that token is
  known without the model: the round leads with the run of such tokens as FORCED candidates,
  certain (q = 1), and hangs the run from there below each proposed leaf; the verify takes them
  as rows of the tree (their KV is filled there; no round is spent on them), and the accept walk
  accepts each whose parent it accepts;
- the verify's tokens are read lazily along the accept walk, a mask computed for each row it
  reads; a greedy row keeps the raw argmax where the mask allows it (no logits read).

Replies are compact JSON (no whitespace between tokens of the structure): fewer tokens, and more of
them forced.
"""

from __future__ import annotations

import json
from functools import cache
from typing import Callable

import llguidance
import numpy as np

from adaspark_core.base.errors import InputError
from adaspark_core.base.tree import ANCHOR, FORCED, Candidate, Layout

# llguidance's JSON-schema options: no whitespace the structure does not need (see above).
JSON_OPTIONS = {"whitespace_flexible": False}
# An integer (and a number's integral part) at most 16 digits long where the schema gives no
# bound, as llama.cpp's own schema converter writes it: unbounded, a small model under the
# grammar writes digits until its token cap (the simulated model did, to 256 tokens).
DIGITS_BOUND = 10**16 - 1
# Keywords whose values are data, not schemas: nothing under them is bounded.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


# A lazy grammar's JSON (tool calls under ``auto``) keeps the model's own whitespace between its
# tokens, bounded as llama.cpp's schema converter bounds it: none, a space, or a newline and at
# most 20 spaces or tabs of indentation.
LAZY_JSON_OPTIONS = {"whitespace_pattern": "( |\n[ \t]{0,20})?"}
LAZY_WINDOW = 256  # bytes of free text a lazy grammar keeps: a call's opening is within its last ones

# OpenAI's ``json_object``: any JSON object.
ANY_OBJECT = {"type": "object"}


def json_grammar(schema: dict) -> str:
    """The llguidance grammar of JSON replies following ``schema``, its unbounded integers and
    numbers bounded (``DIGITS_BOUND``). InputError for a schema it cannot compile."""
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(_bounded(schema)), defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as e:
        raise InputError(f"the JSON schema cannot be compiled: {e}") from None


def _bounded(schema):
    """``schema`` with ``DIGITS_BOUND`` as the minimum and maximum of every integer or number
    subschema that has none (a copy; the caller's schema is left alone)."""
    if isinstance(schema, list):
        return [_bounded(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else _bounded(v) for k, v in schema.items()}
    types = out.get("type")
    if isinstance(types, str) and types in ("integer", "number") or isinstance(types, list) and (
            "integer" in types or "number" in types):
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -DIGITS_BOUND
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = DIGITS_BOUND
    return out


def follows_schema(text: str, schema: dict) -> bool:
    """Whether ``text`` is one JSON value following ``schema``, whoever
    wrote it. The value is parsed and its compact form run through the schema's grammar, not the
    reply's own tokens: llama.cpp's grammar (GBNF) lets a reply hold whitespace between tokens and
    ``\\u`` escapes of any character, both JSON, which ours refuses. Like both grammars, the check
    asks for the properties in the schema's order."""
    try:
        compact = json.dumps(json.loads(text, parse_constant=_no_constant), ensure_ascii=False,
                             separators=(",", ":"), allow_nan=False).encode()  # a lone surrogate fails here
    except ValueError:  # not JSON (JSONDecodeError and UnicodeEncodeError are ValueErrors)
        return False
    matcher = llguidance.LLMatcher(_byte_tokenizer(), json_grammar(schema), log_level=0)  # no warning per misfit
    return matcher.consume_tokens(list(compact)) and matcher.is_accepting()


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")  # Python's json reads NaN and Infinity


class _Bytes:
    """A vocabulary of the 256 bytes and an end token, as llguidance.TokenizerWrapper reads one:
    a text checked byte by byte, whatever model wrote it."""

    eos_token_id, bos_token_id = 256, None
    tokens = [bytes([b]) for b in range(256)] + [b"\xff<end>"]  # the 0xff lead marks a special token
    special_token_ids = [256]

    def __call__(self, data: bytes) -> list[int]:
        return list(data)


@cache
def _byte_tokenizer() -> llguidance.LLTokenizer:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


class Grammar:
    """One request's grammar state: a matcher that has consumed the reply's committed tokens."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str, n_vocab: int):
        self.matcher = llguidance.LLMatcher(tokenizer, grammar)
        if self.matcher.is_error():
            raise InputError(f"the grammar cannot be compiled: {self.matcher.get_error()}")
        # A keyword llguidance does not enforce is a warning: refused, since a reply would not
        # follow the schema as the client wrote it.
        if warnings := self.matcher.get_grammar_warnings():
            raise InputError(f"the grammar engine cannot enforce all of it: {warnings[0]}")
        self.n_vocab = n_vocab
        # The end tokens: allowed where the grammar accepts, and never consumed. llguidance's
        # matcher stops by itself where the grammar can go no further (after a JSON reply's last
        # brace) and then takes no token at all; the end token that follows is ours to commit.
        self.ends = frozenset(tokenizer.eos_tokens)
        self._bits = np.zeros((tokenizer.vocab_size + 31) // 32, dtype=np.int32)

    @classmethod
    def for_schema(cls, model, schema: dict) -> "Grammar":
        """The grammar of JSON replies following ``schema`` on ``model``'s vocabulary."""
        return cls(model.grammar_tokenizer(), json_grammar(schema), model.n_vocab)

    # --- what may come next --------------------------------------------------------------------

    def allows(self, token: int) -> bool:
        """Whether the grammar takes ``token`` next (no mask needed: 0.4 us). The mask may be
        stricter: it leaves out a token that would split text the canonical way's tokens would
        not (``,`` where ``,"`` starts the next key), so a candidate this lets through may still
        not be the target's token; the rows' tokens are chosen under the mask."""
        if self.matcher.is_stopped():
            return token in self.ends
        return self.matcher.validate_tokens([token]) == 1

    def compute_mask(self) -> None:
        """The mask of the tokens that may come next, packed 32 to a word (``masked``,
        ``allowed`` and ``only_token`` read it)."""
        self.matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)

    def masked(self, token: int) -> bool:
        """Whether the last mask allows ``token`` (one bit read: no vocabulary-wide array)."""
        return bool((int(self._bits[token >> 5]) >> (token & 31)) & 1)

    def allowed(self) -> np.ndarray:
        """The last mask, one bool per vocabulary entry."""
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return bits[: self.n_vocab].astype(bool)

    def only_token(self) -> int | None:
        """The one token that may come next, None where there are several (or none)."""
        self.compute_mask()
        words = np.flatnonzero(self._bits)
        if len(words) != 1:
            return None
        word = int(self._bits[words[0]]) & 0xFFFFFFFF
        if word & (word - 1):
            return None
        return int(words[0]) * 32 + word.bit_length() - 1

    # --- a round -------------------------------------------------------------------------------

    def forced_run(self, limit: int) -> list[int]:
        """The tokens the grammar alone allows from here, each the only one after those before,
        at most ``limit`` of them. The matcher is left where it was."""
        run: list[int] = []
        while len(run) < limit:
            t = self.only_token()
            if t is None:
                break
            run.append(t)
            if t in self.ends:
                break
            self.matcher.consume_token(t)
        self.matcher.rollback(len(run) - (run[-1] in self.ends) if run else 0)
        return run

    def fit(self, cands: list[Candidate], depth_limit: int) -> list[Candidate]:
        """The round's candidates under the grammar, none deeper than ``depth_limit``, parents
        before their children:

        - the forced run from the anchor, a chain of FORCED candidates;
        - every proposed candidate the grammar allows after its path, re-parented below the run
          (one that stands on the run's depths is the run's own token: dropped); a forbidden
          one goes with its subtree;
        - below each proposed leaf, the forced run from there (a copied value's closing quote
          is followed by the next key: ``","city":"``), FORCED candidates again."""
        kept, tails = self._allowed_subtrees(cands, depth_limit)
        run = self.forced_run(depth_limit)
        out = [Candidate(token=t, parent=d - 1 if d else ANCHOR, source=FORCED, depth=d + 1) for d, t in enumerate(run)]
        index: dict[int, int] = {}  # proposed index -> index in ``out``
        for j in kept:
            c = cands[j]
            if c.depth <= len(run):
                index[j] = c.depth - 1  # the run's token at its depth (the only one allowed there)
                continue
            if c.parent != ANCHOR:
                c.parent = index[c.parent]
            index[j] = len(out)
            out.append(c)
        for j, tail in tails.items():
            if cands[j].depth > len(run):  # (a leaf on the run's depths: the run went on from there)
                at = index[j]
                for t in tail:
                    out.append(Candidate(token=t, parent=at, source=FORCED, depth=out[at].depth + 1))
                    at = len(out) - 1
        return out

    def _allowed_subtrees(self, cands: list[Candidate], depth_limit: int) -> tuple[list[int], dict[int, list[int]]]:
        """The indices, in order, of the candidates the grammar allows after their whole path, and
        the forced run below each such leaf (end tokens aside) that has one."""
        kids: dict[int, list[int]] = {}
        for j, c in enumerate(cands):
            kids.setdefault(c.parent, []).append(j)
        kept: list[int] = []
        tails: dict[int, list[int]] = {}

        def visit(parent: int) -> None:  # the matcher stands after ``parent``'s path
            leaf = parent != ANCHOR
            for j in kids.get(parent, ()):
                t = cands[j].token
                if t in self.ends:  # a leaf (tree.cut_below_ends), kept where the grammar accepts
                    if self.allows(t):
                        kept.append(j)
                        leaf = False
                elif self.matcher.try_consume_tokens([t]) == 1:
                    kept.append(j)
                    leaf = False
                    visit(j)
                    self.matcher.rollback(1)
            if leaf and (tail := self.forced_run(depth_limit - cands[parent].depth)):
                tails[parent] = tail

        visit(ANCHOR)
        return sorted(kept), tails

    def complete_after(self, tokens: list[int]) -> int | None:
        """How many of ``tokens`` the grammar takes until it accepts (a lazy grammar's object or
        list closed), or None if it does not within them. The matcher is left where it was."""
        taken = 0
        try:
            for t in tokens:
                if t in self.ends or not self.matcher.consume_token(t):
                    return None
                taken += 1
                if self.matcher.is_accepting():
                    return taken
            return None
        finally:
            self.matcher.rollback(taken)

    def rows(self, lay: Layout, pick: Callable[[int, np.ndarray], int], raw: list[int] | None) -> "GrammarRows":
        """The verify's token per row under the grammar, for the accept walk (``GrammarRows``)."""
        return GrammarRows(self, lay, pick, raw)

    def commit(self, tokens: list[int]) -> None:
        """The round's committed tokens (an end token, which ends them, is not the grammar's) join
        the reply."""
        if not self.matcher.consume_tokens([t for t in tokens if t not in self.ends]):
            raise RuntimeError(f"a committed token broke the grammar: {self.matcher.get_error()}")


class GrammarRows:
    """A verify's token per row under the grammar, read when the accept walk first reads it: the
    walk reads a row after its parent's, so the matcher steps along one path (rolled back at
    ``release``). ``raw``: the target's unconstrained argmax per row (greedy), kept where the
    row's mask allows it (it is the argmax over the allowed tokens then); otherwise, and for every
    row of a sampled verify (``raw`` None), ``pick(row, allowed)`` chooses under the mask."""

    def __init__(self, grammar: Grammar, lay: Layout, pick: Callable[[int, np.ndarray], int], raw: list[int] | None):
        self.grammar, self.lay, self.pick, self.raw = grammar, lay, pick, raw
        self._got: dict[int, int] = {}
        self._at: list[int] = []  # the rows whose tokens the matcher has consumed, from the anchor down

    def __getitem__(self, row: int) -> int:
        t = self._got.get(row)
        if t is None:
            raw = None if self.raw is None else self.raw[row]
            if not self._step_to(row):  # below an end token: never emitted (stop_cut)
                t = raw if raw is not None else -1
            else:
                g = self.grammar
                g.compute_mask()
                t = raw if raw is not None and g.masked(raw) else self.pick(row, g.allowed())
            self._got[row] = t
        return t

    def _step_to(self, row: int) -> bool:
        """The matcher after ``row``'s path; False if an end token is on it (not consumed)."""
        path = []
        while row > 0:
            path.append(row)
            row = self.lay.parent_row[row]
        path.reverse()
        token, ends = self.lay.token, self.grammar.ends
        below_end = any(token[r] in ends for r in path)
        if below_end:
            path = path[: next(i for i, r in enumerate(path) if token[r] in ends)]
        common = 0
        while common < min(len(path), len(self._at)) and path[common] == self._at[common]:
            common += 1
        if len(self._at) > common:
            self.grammar.matcher.rollback(len(self._at) - common)
        for r in path[common:]:
            self.grammar.matcher.consume_token(token[r])
        self._at = path
        return not below_end

    def release(self) -> None:
        """The matcher back where the verify began (before the round's tokens are committed)."""
        if self._at:
            self.grammar.matcher.rollback(len(self._at))
            self._at = []

    def as_list(self) -> list[int]:
        """The token per row the walk read; the raw argmax (greedy) or -1 (sampled) elsewhere."""
        rest = self.raw if self.raw is not None else [-1] * len(self.lay.token)
        return [self._got.get(r, rest[r]) for r in range(len(self.lay.token))]


class LazyGrammar:
    """A grammar over part of a reply, as llama.cpp's lazy grammars hold the tool calls of
    ``tool_choice: auto``: the reply is free until ``opens`` finds where a held value begins in
    its free text (a call's JSON after its opening, e.g. ``<tool_call>`` or a fenced
    ``{"name"``), then held to a JSON value following ``schema`` until that value is complete,
    then free again, until the next opening. The held value keeps the model's own whitespace
    (Qwen2.5 indents its calls), bounded (``LAZY_JSON_OPTIONS``).

    A round is either held or free throughout. The free round in which an opening is found ends
    with the token that completes it (the rows after it were read without the grammar), and the
    held round in which the value completes ends with its last token (the row after it was read
    under a grammar that allows nothing more), so every emitted token is the target's choice under
    the grammar that holds at its place. The value's text written before the opening was found
    (``{"name"``) is handed to the grammar when it starts. The value is complete where the grammar
    first accepts: a call is an object (or Mistral's list), complete at its closing bracket. ``Generation`` asks ``cut`` for a
    round's end and ``after`` for the grammar of the next round."""

    def __init__(self, model, opens: Callable[[str], int | None], schema: dict):
        self.model, self.opens = model, opens
        # The value, then the whitespace a model writes in the value's last token (``}\n``): held
        # to ``}`` alone, a model reads a split it never wrote and may end the reply there.
        body = {**_bounded(schema), "x-guidance": LAZY_JSON_OPTIONS}
        self.grammar = f"%llguidance {{}}\nstart: value TAIL\nTAIL: /[ \\t\\r\\n]{{0,4}}/\nvalue: %json {json.dumps(body)}"
        self._free = b""  # the free text since the last held value, its last LAZY_WINDOW bytes
        self._scan: tuple | None = None  # ``cut``'s scan of a free round's tokens, for ``after``
        self._start()  # compiled once now: a schema it cannot take is refused with the request

    def _start(self) -> Grammar:
        return Grammar(self.model.grammar_tokenizer(), self.grammar, self.model.n_vocab)

    def _opening(self, tokens: list[int]) -> tuple[int | None, str, bytes]:
        """Where free ``tokens`` open a held value: (how many of them up to the one that completes
        the opening, the value's text so far, the free text then: none); else (None, "", the free
        text after them)."""
        free = self._free
        for i, t in enumerate(tokens):
            free += self.model.piece(t)
            text = free.decode(errors="replace")
            if (at := self.opens(text)) is not None:
                return i + 1, text[at:], b""
        return None, "", free[-LAZY_WINDOW:]

    def cut(self, accepted: list[int], held: Grammar | None) -> list[int]:
        """The start of a round's ``accepted`` tokens that it may emit: up to the opening in a free
        round, up to the held value's end in a held one."""
        if held is not None:
            end = held.complete_after(accepted)
        else:  # the scan is kept: ``after`` gets these tokens back unless an end or the budget cut them
            end, value, tail = self._opening(accepted)
            self._scan = (accepted if end is None else accepted[:end], end, value, tail)
        return accepted if end is None else accepted[:end]

    def after(self, committed: list[int], held: Grammar | None) -> Grammar | None:
        """The grammar of the next round, once ``committed`` joined the reply (``held`` has read them)."""
        if held is not None:
            return None if held.matcher.is_accepting() else held
        scan, self._scan = self._scan, None
        end, value, self._free = scan[1:] if scan is not None and scan[0] == committed else self._opening(committed)
        if end is None:
            return None
        grammar = self._start()
        spelled = self.model.tokenize(value, special=False, add_bos=False) if value else []
        if "\ufffd" in value or not grammar.matcher.consume_tokens(spelled):
            return None  # what the value began with already breaks the schema: the reply stays free
        return grammar
