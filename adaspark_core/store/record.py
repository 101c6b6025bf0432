"""The round record and the JSON-lines round log (DESIGN.md, "Round record and round log").

A record holds everything any learner needs about one round, so learners can be trained and
replayed from a log without the model. One JSON object per line, written with orjson. Every line
carries ``schema``; reading a log upgrades older lines through ``UPGRADES``, an append-only list of
functions, the i-th of which turns a schema-(i+1) line into a schema-(i+2) line.

Reading checks every line, after its upgrade, against what the writer guarantees (``check``): the
readers (replay, the regret accounts, simulate) index one field by another (a path's candidates,
an argmax per row, a step's requests), so an edited or damaged line that got past the reader
ended in a KeyError deep inside a learner. A line that does not hold is one error naming it.
"""

from __future__ import annotations

import math
import os
from dataclasses import MISSING, dataclass, field, fields, replace
from itertools import compress, product, repeat
from operator import is_, is_not, itemgetter, lt, sub
from typing import Callable, Iterator

import orjson

from adaspark_core.base.checks import LIMIT
from adaspark_core.base.decision import WidthDecision
from adaspark_core.base.errors import InputError, OutputError
from adaspark_core.base.files import open_log, open_regular
from adaspark_core.base.sampling import SEED_RANGE
from adaspark_core.base.schema import apply_upgrades
from adaspark_core.base.tree import ANCHOR, FORCED, NGRAM, PICK, SIBLING, Candidate
from adaspark_core.candidates.ngram import COPY, COPY_ALT, COPY_START, FOLLOW, FOLLOW_ALT, MEMORY

SCHEMA = 8

# Append-only: UPGRADES[i] maps a dict of schema i+1 to schema i+2. Never edit an entry.
UPGRADES: list[Callable[[dict], dict]] = [
    # 1 -> 2: the acceptance model's inputs and choices (p_src, which estimate priced, exploration).
    lambda d: {**d, "p_src": None, "priced": None, "explored": False},
    # 2 -> 3: the learners' time and the round's start on the request's clock (regret account).
    lambda d: {**d, "times": {**d["times"], "learn": 0.0, "start": None}},
    # 3 -> 4: sampled rounds are logged, with their request's sampler settings and seed.
    lambda d: {**d, "sampling": None},
    # 4 -> 5: no ``reach`` (the most rows the round's sources could fill): no learner reads it (a
    # measuring round verifies the width it measures, so the cost model never moves a width to it).
    lambda d: {k: v for k, v in d.items() if k != "reach"},
    # 5 -> 6: rounds verified together with other requests' carry their ``step``.
    lambda d: {**d, "step": None},
    # 6 -> 7: a draft model's rounds log its forwards (the depth learner's, learn/depth.py).
    lambda d: {**d, "drafting": None},
    # 7 -> 8: a request decoded under a grammar (decode/grammar.py) marks its rounds ``constrained``.
    lambda d: {**d, "constrained": False},
]


@dataclass(slots=True)
class Timing:
    """Milliseconds. ``draft`` is D (drafter + tree build); ``verify`` is T (the target's verify,
    batch build and argmax read included); ``commit`` the KV commit; ``host`` the engine's own
    Python time outside llama_decode (batch build, KV sequence operations, argmax read);
    ``learn`` the learners' step on this round (after the record was built, before it was
    written); ``start`` when the round began, since the request's first round began. The gaps
    between consecutive starts are the rounds' wall times, which also hold what no field times
    (building the record, writing the log, the consumer of the emitted text)."""

    draft: float
    verify: float
    commit: float
    host: float
    decode: float  # llama_decode alone
    learn: float = 0.0
    start: float | None = None

    @property
    def total(self) -> float:
        return self.draft + self.verify + self.commit


@dataclass(slots=True)
class Step:
    """One request's round in a step verified together with other requests' rounds
    (decode/batch.py). The step's own fields are the same on every record of the step; ``index``,
    ``lead`` and ``max_rows`` are this round's place in it."""

    batch: str  # the batch's id: tells one run's steps from another's in one log
    id: int  # the step's number in its batch
    requests: int  # rounds verified in the step
    rows: int  # every request's rows
    cells: int  # every request's context: each row attends them all
    draft: float  # ms of every request's proposing and pricing
    last: bool  # a request ended in it
    index: int  # this round's place in the step's verify (the lead first)
    lead: bool  # the step's first record, which carries the step's cost to the cost model
    max_rows: int  # this request's bound on its rows
    # Prompt tokens of joining requests that rode in the step's decode (such a step does not teach
    # the cost model); None: none.
    prefill: int | None = None
    # [request, sampled] of the requests that joined since the previous step: their per-request
    # learner state starts there, before their prompts are in. None: a log from before chunked prefill.
    began: list[list] | None = None

    def shared(self) -> tuple:
        """The fields every record of the step holds alike."""
        return (self.batch, self.id, self.requests, self.rows, self.cells, self.draft, self.last, self.prefill,
                self.began)

    def to_json(self) -> dict:
        d = {"batch": self.batch, "id": self.id, "requests": self.requests, "rows": self.rows, "cells": self.cells,
             "draft": self.draft, "last": self.last}
        if self.prefill is not None:
            d["prefill"] = self.prefill
        if self.began is not None:
            d["began"] = self.began
        d.update(index=self.index, lead=self.lead, max_rows=self.max_rows)
        return d


@dataclass(slots=True)
class Drafting:
    """A draft model's draft in one round (drafters.ModelDrafter): the depth learner's inputs."""

    forwards: list[float]  # ms of each forward, one a position drafted (none: a depth of 0)
    rows: int  # tokens the first forward decoded (the anchor and what the draft cache had not seen; 0 without one)
    limit: int  # the most positions it could draft
    max_rows: int  # the round's bound on its verify

    def to_json(self) -> dict:
        return {"forwards": self.forwards, "rows": self.rows, "limit": self.limit, "max_rows": self.max_rows}


@dataclass(slots=True)
class RoundRecord:
    request: str
    round: int  # 0-based index within the request
    context: int  # committed tokens at the start of the round (the anchor included)
    arm: str
    anchor: int  # the anchor's token
    candidates: list[dict]  # Candidate.to_dict() of every proposed candidate, placed or not
    order: list[int]  # best-first order of candidate indices (Proposition 1)
    decision: WidthDecision  # the rows verified (the anchor included), the widths offered, their prices
    rows: list[int]  # candidate index per verified row, -1 for the anchor, depth-first
    argmax: list[int]  # the target's argmax per verified row (sampled: its draw, -1 where not drawn)
    path: list[int]  # accepted candidate indices, from the anchor down
    bonus: int  # the target's argmax (sampled: draw) at the deepest accepted row
    emitted: list[int]  # tokens this round added to the reply (after stop truncation)
    times: Timing
    p_src: float | None = None  # the n-gram source's top-1 precision on the committed text
    priced: str | None = None  # which acceptance estimate priced the candidates: fitted or head
    explored: bool = False  # the last row went to an exploring n-gram node (logs before hindsight labels)
    first: bool = False  # the request's first round
    last: bool = False  # the request's last round
    finish: str | None = None  # on the last round: stop, length or context
    # A sampled request's settings (temperature, top_k, top_p, min_p) and its seed: the round
    # belongs to the sampled regime's learners (learned.Learners.regime); None: greedy.
    sampling: dict | None = None
    # A round verified together with other requests' rounds (decode/batch.py); None: alone.
    step: Step | None = None
    # A draft model's draft this round (drafters.ModelDrafter, learn/depth.py); None: no draft
    # model drafts position by position in this round.
    drafting: Drafting | None = None
    # The request decodes under a grammar (decode/grammar.py): its argmax are over the tokens the
    # grammar allows, and its candidates may lead with FORCED ones, the only token allowed there.
    constrained: bool = False
    schema: int = field(default=SCHEMA)

    @property
    def width(self) -> int:
        """Rows verified, the anchor's included."""
        return self.decision.width

    def as_step(self) -> "RoundRecord":
        """The step this record leads, as one round of all its rows over all its cells: what the
        verify-cost model learns from (its time is the step's)."""
        s = self.step
        return replace(self, decision=replace(self.decision, width=s.rows), context=s.cells, first=False,
                       last=s.last, times=replace(self.times, draft=s.draft))

    def to_json(self) -> dict:
        """A shallow dict for orjson: the record's own lists and dicts are shared, not copied
        (``dataclasses.asdict`` deep-copies every candidate, too slow per round: ARCHITECTURE.md,
        section 5). The decision is the line's ``width``, ``offered``, ``prices`` and ``measure``."""
        dec = self.decision
        offered, prices = dec.columns()
        decided = {"offered": offered, "prices": prices, "width": dec.width, "measure": dec.measure}
        d = {f: decided[f] if f in decided else getattr(self, f) for f in LINE_FIELDS}
        d["times"] = {**{f: getattr(self.times, f) for f in _TIMING_FIELDS}, "total": self.times.total}
        if self.step is not None:
            d["step"] = self.step.to_json()
        if self.drafting is not None:
            d["drafting"] = self.drafting.to_json()
        return d

    @staticmethod
    def from_json(d) -> "RoundRecord":
        """The record of a parsed log line, upgraded to the current schema and checked
        (``check``); ValueError saying what is wrong with it. ``d`` is left as it is."""
        if type(d) is dict:  # _record makes its fields the record's: copies of the caller's
            d = dict(d)
            if type(d.get("times")) is dict:
                d["times"] = dict(d["times"])
        return _record(d)


# A line's fields, in the order they are written: the record's, its decision's four in their place.
LINE_FIELDS = ["request", "round", "context", "arm", "anchor", "candidates", "order", "offered", "prices", "width",
               "rows", "argmax", "path", "bonus", "emitted", "times", "measure", "p_src", "priced", "explored",
               "first", "last", "finish", "sampling", "step", "drafting", "constrained", "schema"]
_DECISION_FIELDS = ("width", "offered", "prices", "measure")
assert set(LINE_FIELDS) == {f.name for f in fields(RoundRecord)} - {"decision"} | set(_DECISION_FIELDS)
_TIMING_FIELDS = [f.name for f in fields(Timing)]
# The first writers left out the fields they did not have yet: an older line reads with these.
_DEFAULTS = {**{f.name: f.default for f in fields(RoundRecord) if f.default is not MISSING and f.name != "schema"},
             "measure": None}


def upgrade(d: dict) -> dict:
    """Bring a parsed log line to the current schema."""
    return apply_upgrades(d, UPGRADES, SCHEMA)


def _record(d: dict) -> RoundRecord:
    """RoundRecord.from_json of a line the caller owns: ``d`` and its ``times`` become the record's."""
    if type(d) is not dict:
        raise ValueError(f"the line is a JSON {type(d).__name__}, not an object")
    written = d.get("schema")
    if written != SCHEMA:
        try:
            # The first writers left out the fields they did not have yet (``measure``): an older
            # line reads with the defaults; a current one has every field, as the writer writes it.
            d = {**_DEFAULTS, **upgrade(d)}
        except (KeyError, TypeError, AttributeError) as e:  # an upgrade reads the old line's fields
            raise ValueError(f"a line of schema {written} lacks what its upgrade reads ({type(e).__name__}: {e})") from None
    check(d)
    t = d.pop("times")
    t.pop("total", None)
    decision = WidthDecision.logged(d.pop("width"), d.pop("offered"), d.pop("prices"), d.pop("measure"))
    step, drafting = d.pop("step"), d.pop("drafting")
    return RoundRecord(times=Timing(**t), decision=decision, step=None if step is None else Step(**step),
                       drafting=None if drafting is None else Drafting(**drafting), **d)


# --- what a line may hold (RoundRecord.from_json, read_log) ----------------------------------------

_NULL = type(None)
_TINY = math.ulp(0.0)  # the least positive float: ``lo=_TINY`` is "above 0" for ints and floats alike


def _show(v) -> str:
    s = "null" if v is None else repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


class _Bad(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class _Field:
    """What one JSON value may hold: a value whose type is one of ``types`` (``type(v)``, so a bool
    is not an integer), at least ``lo`` and at most ``hi`` where they are given, one of ``choices``
    when given. (JSON has no NaN or infinity, and orjson reads an integer past 64 bits as a float:
    every number read is finite and fits a float.)"""

    types: frozenset
    what: str  # the rule in words, for the message
    lo: float | None = None
    hi: float | None = None
    choices: frozenset | None = None

    def holds(self, v) -> bool:
        return (type(v) in self.types
                and (v is None or ((self.lo is None or self.lo <= v) and (self.hi is None or v <= self.hi)))
                and (self.choices is None or v in self.choices))

    def problem(self, v, where: str) -> str:
        return f"{where} is {_show(v)}, not {self.what}"


@dataclass(frozen=True, slots=True)
class _List:
    """A JSON list of ``item``s (or null, if ``null``)."""

    item: _Field
    null: bool = False

    @property
    def types(self) -> frozenset:
        return frozenset({list, _NULL} if self.null else {list})

    def holds(self, v) -> bool:
        return (v is None and self.null) or (type(v) is list and all(map(self.item.holds, v)))

    def problem(self, v, where: str) -> str:
        if type(v) is not list:
            return f"{where} is {_show(v)}, not a list" + (" or null" if self.null else "")
        i = next(i for i, x in enumerate(v) if not self.item.holds(x))
        return self.item.problem(v[i], f"{where}.{i}")


class _Fields:
    """The rules of an object's fields (``known``, each a _Field or a _List), laid out for a fast
    pass over one object (``row_holds``) or a column-wise one over many (``columns_hold``): every
    field's type at once, as the tuple of the value types, against the combinations the rules
    allow; then the ranges, choices and list items of the fields that have them. A log is read
    at tens of thousands of lines a second, each with up to hundreds of candidates, so this is
    what runs; only a line that fails it is gone through field by field (``_explain``), to say
    which field is wrong."""

    def __init__(self, known: dict):
        self.known = known
        self.values = itemgetter(*known)
        self.layouts = frozenset(product(*(f.types for f in known.values())))
        self.column_types = [f.types for f in known.values()]
        specs = list(enumerate(known.values()))
        self.ranged = [(i, f.lo, f.hi, _NULL in f.types) for i, f in specs if type(f) is _Field and f.lo is not None]
        self.chosen = [(i, f.choices) for i, f in specs if type(f) is _Field and f.choices is not None]
        # (a list's items are never null: their range needs no filter)
        self.listed = [(i, f.item.types, f.item.lo, f.item.hi) for i, f in specs if type(f) is _List]

    def row_holds(self, values: tuple) -> bool:
        if tuple(map(type, values)) not in self.layouts:
            return False
        for i, lo, hi, _ in self.ranged:
            v = values[i]
            if v is not None and (v < lo or (hi is not None and v > hi)):
                return False
        for i, choices in self.chosen:
            if values[i] not in choices:
                return False
        for i, types, lo, hi in self.listed:  # (_List.holds, inline: it runs for every list of every line)
            v = values[i]
            if v and (not set(map(type, v)) <= types or (lo is not None and min(v) < lo)
                      or (hi is not None and max(v) > hi)):
                return False
        return True

    def columns_hold(self, columns: list[tuple]) -> bool:
        if not all(set(map(type, column)) <= types for column, types in zip(columns, self.column_types)):
            return False
        for i, lo, hi, null in self.ranged:
            v = columns[i]
            if null:
                v = list(compress(v, map(is_not, v, repeat(None))))
            if v and (min(v) < lo or (hi is not None and max(v) > hi)):
                return False
        for i, choices in self.chosen:
            if not set(columns[i]) <= choices:
                return False
        return not self.listed  # (the rows' lists would need a pass each: no rows have any)


class _Object:
    """A JSON object (or null) with exactly the fields ``known``, and perhaps the ``optional`` ones.
    ``holds`` looks at its type only; ``check`` at its fields (not inside an object among them)."""

    def __init__(self, known: dict, optional: dict | None = None, null: bool = False):
        self.known, self.optional, self.null = known, optional or {}, null
        self.types = frozenset({dict, _NULL} if null else {dict})
        # the fast pass of every set of optional fields an object may have, by its number of fields
        self._fast: dict[int, list[_Fields]] = {}
        names = list(self.optional)
        for subset in product((False, True), repeat=len(names)):
            fields_ = {**known, **{k: self.optional[k] for k, on in zip(names, subset) if on}}
            self._fast.setdefault(len(fields_), []).append(_Fields(fields_))

    def holds(self, v) -> bool:
        return (v is None and self.null) or type(v) is dict

    def problem(self, v, where: str) -> str:
        return f"{where} is {_show(v)}, not an object" + (" or null" if self.null else "")

    def check(self, d: dict, where: str) -> None:
        """_Bad naming the first field of ``d`` that does not hold (``where``: its path's start)."""
        for f in self._fast.get(len(d), ()):
            try:
                values = f.values(d)
            except KeyError:
                continue
            if f.row_holds(values):
                return
        _explain(d, where, self.known, self.optional)


def _explain(d: dict, where: str, known: dict, optional: dict) -> None:
    """_Bad naming the first field of ``d`` that is missing, unknown or does not hold."""
    missing = [k for k in known if k not in d]
    if missing:
        raise _Bad(f"{where}{missing[0]} is missing")
    unknown = [k for k in d if k not in known and k not in optional]
    if unknown:
        raise _Bad(f"{where}{unknown[0]} is not a field this version knows")
    for name, f in [*known.items(), *((k, f) for k, f in optional.items() if k in d)]:
        if not f.holds(d[name]):
            raise _Bad(f.problem(d[name], where + name))


def _int(lo: int, hi: int | None = None, null: bool = False) -> _Field:
    what = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
    return _Field(frozenset({int, _NULL} if null else {int}), what + (" or null" if null else ""), lo, hi)


def _num(lo: float = 0.0, hi: float | None = 1.0, null: bool = False) -> _Field:
    low = "(0" if lo == _TINY else f"[{lo:g}"
    what = f"a number in {low}, {hi:g}]" if hi is not None else "a number > 0" if lo == _TINY else f"a number >= {lo:g}"
    return _Field(frozenset({int, float, _NULL} if null else {int, float}), what + (" or null" if null else ""), lo, hi)


def _text(choices: tuple = (), null: bool = False) -> _Field:
    what = ("one of " + ", ".join(choices) if choices else "a string") + (" or null" if null else "")
    return _Field(frozenset({str, _NULL} if null else {str}), what,
                  choices=frozenset(choices) | ({None} if null else set()) if choices else None)


_FLAG = _Field(frozenset({bool}), "true or false")
# A token is any integer: a model's are its vocabulary's, but a simulated target says "no token
# here" with negative ones (tracesim END and OFF), and a sampled verify marks a row it never drew -1.
_TOKEN = _Field(frozenset({int}), "an integer")
_MS = _num(0.0, LIMIT)  # a time in ms: a float a store would take (checks.LIMIT)
_KINDS = (COPY, COPY_START, COPY_ALT, FOLLOW, FOLLOW_ALT, MEMORY)

# Candidate.to_dict(): the features the acceptance model reads. A sibling's share r is its share of
# the siblings' mass, which rounding can put past 1 (drafters.block): only h and sigma are
# probabilities.
_CANDIDATE = {
    "token": _TOKEN, "parent": _int(ANCHOR), "source": _text((PICK, SIBLING, NGRAM, FORCED)), "depth": _int(1),
    "q": _num(), "h": _num(null=True), "share": _num(0.0, None, null=True), "sigma": _num(null=True),
    "kind": _text(_KINDS, null=True), "evidence": _int(0), "above": _int(0), "bucket": _text(null=True),
    "agreed": _FLAG, "contradicted": _FLAG,
}
assert tuple(_CANDIDATE) == Candidate.__slots__, "a candidate's fields changed: check them here"
_CANDIDATES = _Fields(_CANDIDATE)

_TIMES = _Object({"draft": _MS, "verify": _num(_TINY, LIMIT), "commit": _MS, "host": _MS, "decode": _MS,
                  "learn": _MS, "start": _num(0.0, LIMIT, null=True)}, {"total": _MS})
# a sampled request's settings (base/sampling.py): those of a Sampling with a temperature above 0
_SAMPLING = _Object({"temperature": _num(_TINY, None), "top_k": _int(0), "top_p": _num(), "min_p": _num(),
                     "seed": _int(*SEED_RANGE)}, null=True)
# decode/batch.py's step; ``prefill`` only where prompt tokens rode in it, ``began`` since chunked prefill
_STEP = _Object({"batch": _text(), "id": _int(0), "requests": _int(1), "rows": _int(1), "cells": _int(1),
                 "draft": _MS, "last": _FLAG, "index": _int(0), "lead": _FLAG, "max_rows": _int(1)},
                {"prefill": _int(1), "began": _List(_Field(frozenset({list}), "a [request, sampled] pair"))}, null=True)
_DRAFTING = _Object({"forwards": _List(_MS), "rows": _int(0), "limit": _int(0), "max_rows": _int(1)}, null=True)

_RECORD = _Object({
    "request": _text(), "round": _int(0), "context": _int(1), "arm": _text(), "anchor": _TOKEN,
    "candidates": _List(_Field(frozenset({dict}), "an object")), "order": _List(_int(0)),
    "offered": _List(_int(1)), "prices": _List(_num(_TINY, LIMIT), null=True), "width": _int(1),
    "rows": _List(_int(ANCHOR)), "argmax": _List(_TOKEN), "path": _List(_int(0)), "bonus": _TOKEN,
    "emitted": _List(_TOKEN), "times": _TIMES, "measure": _int(1, null=True), "p_src": _num(null=True),
    # learn/acceptance.py's FITTED and HEAD (a layer above this one)
    "priced": _text(("fitted", "head"), null=True), "explored": _FLAG, "first": _FLAG, "last": _FLAG,
    "finish": _text(null=True), "sampling": _SAMPLING, "step": _STEP, "drafting": _DRAFTING,
    "constrained": _FLAG, "schema": _int(SCHEMA, SCHEMA),
})
assert set(_RECORD.known) == set(LINE_FIELDS) and set(_TIMES.known) == set(_TIMING_FIELDS)
assert {**_STEP.known, **_STEP.optional}.keys() == {f.name for f in fields(Step)}
assert _DRAFTING.known.keys() == {f.name for f in fields(Drafting)}


def check(d: dict) -> None:
    """ValueError unless ``d`` (a line upgraded to the current schema) is a record the writer
    could have written (generation.Generation._record, batch.Batch.step), so that every reader can
    index one field by another: each field's type and range; the candidates a tree (each parent
    an earlier candidate or the anchor, its depth one below); ``order`` every candidate, parents
    first (Proposition 1); ``rows`` the anchor and the first width - 1 of the order, depth first;
    ``argmax`` one per row; ``path`` the accept walk from the anchor (each node a verified child of
    the one before, its token its parent row's argmax), ``bonus`` the argmax where it stopped and
    ``emitted`` a start of what it committed; a step's fields those of one request's place in it.
    No more than that: what the writer does not guarantee (a price's size, a share's top) is not
    asked of a line. It runs at every line of a log, so the per-item work is C-speed passes
    (``map``, ``set``, ``min``) wherever a list can be long."""
    _RECORD.check(d, "")
    _TIMES.check(d["times"], "times.")
    if d["sampling"] is not None:
        _SAMPLING.check(d["sampling"], "sampling.")
    cands, order, rows, width = d["candidates"], d["order"], d["rows"], d["width"]
    n = len(cands)
    if n:
        parents, tokens = _check_candidates(cands)
        if not d["constrained"] and FORCED in map(itemgetter("source"), cands):
            raise _Bad("a candidate is forced in a round decoded under no grammar")
        if len(order) != n or set(order) != set(range(n)):
            raise _Bad(f"order is not every candidate once (the round has {n})")
        rank = [0] * (n + 1)  # the anchor (-1) ranks first
        for i, j in enumerate(order, 1):
            rank[j] = i
        if not all(map(lt, map(rank.__getitem__, parents), rank)):
            late = next(j for j, p in enumerate(parents) if rank[p] >= rank[j])
            raise _Bad(f"order ranks candidate {late} before its parent {parents[late]}")
    elif order:
        raise _Bad("order is not every candidate once (the round has none)")
    else:
        parents = tokens = ()
    if width != len(rows):
        raise _Bad(f"rows has {len(rows)} items, not one per row of the width ({width})")
    if rows[0] != ANCHOR:
        raise _Bad(f"rows.0 is {_show(rows[0])}, not the anchor (-1)")
    verified = rows[1:]
    if verified:
        if len(set(verified)) != width - 1 or set(verified) != set(order[: width - 1]):
            raise _Bad(f"rows is {_show(rows)}, not the anchor and the first {width - 1} candidates of the order")
        placed = {ANCHOR}
        for r, j in enumerate(verified, 1):
            if parents[j] not in placed:
                raise _Bad(f"rows.{r} is candidate {j}, whose parent {parents[j]} is in no earlier row")
            placed.add(j)
    argmax, path, bonus = d["argmax"], d["path"], d["bonus"]
    if len(argmax) != width:
        raise _Bad(f"argmax has {len(argmax)} items, not one per row ({width})")
    at, parent_row = ANCHOR, 0
    if path:
        row_of = dict(zip(rows, range(width)))
        for k, j in enumerate(path):
            if j not in row_of or parents[j] != at:
                raise _Bad(f"path.{k} is {j}, not a verified child of {'the anchor' if at == ANCHOR else at}")
            if tokens[j] != argmax[parent_row]:
                raise _Bad(f"path.{k} is candidate {j}, whose token is not its parent row's argmax")
            at, parent_row = j, row_of[j]
    if bonus != argmax[parent_row] or (verified and any(parents[j] == at and tokens[j] == bonus for j in verified)):
        raise _Bad(f"bonus is {bonus}, not the argmax of the last accepted row, where the walk stops")
    emitted = d["emitted"]
    if emitted and emitted != ([tokens[j] for j in path] + [bonus])[: len(emitted)]:
        raise _Bad("emitted is not a start of the accepted tokens and the bonus")
    offered, prices = d["offered"], d["prices"]
    if not all(map(lt, offered, offered[1:])):
        raise _Bad(f"offered is {_show(offered)}, not widths in increasing order")
    if prices is not None and len(prices) != len(offered):
        raise _Bad(f"prices has {len(prices)} items, not one per offered width ({len(offered)})")
    if d["first"] and d["round"]:
        raise _Bad(f"first is true at round {d['round']}: a request's first round is its round 0")
    if d["last"] != (d["finish"] is not None):
        raise _Bad(f"last is {_show(d['last'])} with finish {_show(d['finish'])}: a last round has a finish, no other")
    if d["priced"] is not None and not n:  # (a line from before schema 2 has candidates and no priced)
        raise _Bad(f"priced is {_show(d['priced'])} for a round without candidates, which prices none")
    if d["step"] is not None:
        _check_step(d["step"], d)
    if d["drafting"] is not None:
        _check_drafting(d["drafting"], d)


def _check_drafting(dr: dict, d: dict) -> None:
    """A draft's forwards and rows: one forward a position drafted, so no more picks than
    forwards, one a depth (fewer where an end token cut the rest, tree.cut_below_ends); its first
    forward decodes ``rows`` >= 1 tokens, and no draft none."""
    _DRAFTING.check(dr, "drafting.")
    forwards = dr["forwards"]
    picks = [c["depth"] for c in d["candidates"] if c["source"] == PICK]
    if len(forwards) > dr["limit"]:
        raise _Bad(f"drafting.forwards has {len(forwards)} items, more than its limit ({dr['limit']})")
    if picks != list(range(1, len(picks) + 1)) or len(picks) > len(forwards):
        raise _Bad(f"drafting.forwards has {len(forwards)} items, not one per position of the draft's picks ({len(picks)})")
    if (dr["rows"] == 0) != (not forwards):
        raise _Bad(f"drafting.rows is {dr['rows']} with {len(forwards)} forwards: a draft's first forward decodes a row or more, no draft none")


# (n-gram node, kind is None, bucket is None, agreed, contradicted) of the candidates the writer
# makes (candidates/ngram.py): an n-gram node has its own kind and bucket and no marks; a drafter
# candidate has an n-gram proposal's kind and bucket exactly when it is agreed or contradicted.
# A bucket is "kind/evidence bin/nodes above bin" (ngram.bucket), whose parts the acceptance
# model reads apart (features).
_MARKS = frozenset({(True, False, False, False, False), (False, True, True, False, False),
                    (False, False, False, True, False), (False, False, False, False, True)})


def _check_candidates(cands: list[dict]) -> tuple[tuple, tuple]:
    """Every candidate's fields (column by column), the tree's rule (tree.check_topological) and
    the n-gram features (``_MARKS``); returns the parents and the tokens."""
    try:
        table = list(map(_CANDIDATES.values, cands))
    except KeyError:
        table = None
    columns = list(zip(*table)) if table else []
    if table is None or max(map(len, cands)) != len(_CANDIDATE) or not _CANDIDATES.columns_hold(columns):
        for j, c in enumerate(cands):
            _explain(c, f"candidates.{j}.", _CANDIDATE, {})
    tokens, parents, sources, depths, *_, kinds, _, _, buckets, agreed, contradicted = columns
    if not all(map(lt, parents, range(len(parents)))):
        j = next(j for j, p in enumerate(parents) if p >= j)
        raise _Bad(f"candidates.{j}.parent is {parents[j]}, not an earlier candidate or the anchor (-1)")
    above_depth = [*depths, 0]  # the anchor's depth last, where the parent -1 reads it
    if set(map(sub, depths, map(above_depth.__getitem__, parents))) != {1}:
        j = next(j for j, p in enumerate(parents) if depths[j] != above_depth[p] + 1)
        raise _Bad(f"candidates.{j}.depth is {depths[j]}, not its parent's depth + 1")
    ngram = list(map(NGRAM.__eq__, sources))
    marks = zip(ngram, map(is_, kinds, repeat(None)), map(is_, buckets, repeat(None)), agreed, contradicted)
    if not set(marks) <= _MARKS or not set(map(str.count, compress(buckets, map(is_not, buckets, repeat(None))),
                                                repeat("/"))) <= {2}:
        j = next(j for j, c in enumerate(table) if not _marks_hold(c[2], c[8], c[11], c[12], c[13]))
        raise _Bad(f"candidates.{j}: its kind, bucket, agreed and contradicted are not those of a {sources[j]} "
                   "candidate")
    return parents, tokens


def _marks_hold(source: str, kind, bucket: str | None, agreed: bool, contradicted: bool) -> bool:
    """``_MARKS`` and a bucket's parts, for one candidate (to name the one that breaks them)."""
    return ((source == NGRAM, kind is None, bucket is None, agreed, contradicted) in _MARKS
            and (bucket is None or bucket.count("/") == 2))


def _check_step(step: dict, d: dict) -> None:
    """One request's place in a batched step (decode/batch.py): an index among its requests (the
    lead first), its rows and cells within the step's, its most rows at least its width."""
    _STEP.check(step, "step.")
    requests, index = step["requests"], step["index"]
    if index >= requests:
        raise _Bad(f"step.index is {index}, not one of the step's {requests} requests")
    if step["lead"] != (index == 0):
        raise _Bad(f"step.lead is {_show(step['lead'])} at index {index}: the lead is the step's first request")
    if step["rows"] < d["width"] + requests - 1:
        raise _Bad(f"step.rows is {step['rows']}, fewer than this round's {d['width']} and one for each other request")
    if step["cells"] < d["context"]:
        raise _Bad(f"step.cells is {step['cells']}, fewer than this round's context {d['context']}")
    if step["max_rows"] < d["width"]:
        raise _Bad(f"step.max_rows is {step['max_rows']}, below this round's width {d['width']}")
    for i, pair in enumerate(step.get("began") or ()):
        if len(pair) != 2 or type(pair[0]) is not str or type(pair[1]) is not bool:
            raise _Bad(f"step.began.{i} is {_show(pair)}, not a [request, sampled] pair")


class LogWriteError(OutputError):
    """A round could not be written to the log (a full disk, a closed pipe)."""


class RoundLog:
    """Appends records to a JSON-lines file (opened by files.open_log: a regular file, a FIFO or
    a character device; emptied first if ``fresh``). Each line goes out in whole ``os.write``
    calls, unbuffered, so a crash loses at most the round being written; a write that fails
    (LogWriteError) takes back what it wrote of its line in a regular file, so the log stays
    readable line by line."""

    def __init__(self, path: str | os.PathLike, *, fresh: bool = False):
        self.name = str(path)
        self._fd: int | None = open_log(path, fresh=fresh)

    def write(self, rec: RoundRecord) -> None:
        if self._fd is None:
            raise LogWriteError(f"the round log {self.name} is closed")
        line = orjson.dumps(rec.to_json()) + b"\n"
        size = os.fstat(self._fd).st_size
        try:
            view = memoryview(line)
            while view:
                view = view[os.write(self._fd, view):]
        except OSError as e:
            try:  # only a regular file has a size to go back to
                if os.fstat(self._fd).st_size > size:
                    os.ftruncate(self._fd, size)
            except OSError:
                pass
            raise LogWriteError(f"cannot write the round log {self.name}: {e.strerror or e}") from None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "RoundLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LogReadError(InputError):
    """A round log with a line that is not a record the writer could have written: one line naming
    the file, the line and what is wrong."""


class _Steps:
    """A batched step's records are consecutive lines (Batch.step logs every one before the next
    step decides): they share the step's fields, and name each request and each index once; all
    of them in, their widths add up to the step's rows and their contexts to at most its cells.
    (Fewer than the step's requests is an incomplete log, which replay deals with, not a damaged
    line.)"""

    def __init__(self):
        self.key = None

    def add(self, rec: RoundRecord) -> None:
        s = rec.step
        if s is None:
            self.key = None
            return
        key, shared = (s.batch, s.id), s.shared()
        if key != self.key:
            self.key, self.shared, self.requests, self.indices = key, shared, set(), set()
            self.rows = self.cells = 0
        elif shared != self.shared:
            raise _Bad(f"step {s.batch}/{s.id}: its fields differ from those of the step's line before")
        if rec.request in self.requests or s.index in self.indices:
            raise _Bad(f"step {s.batch}/{s.id}: a second round of request {rec.request} or at index {s.index}")
        self.requests.add(rec.request)
        self.indices.add(s.index)
        self.rows += rec.width
        self.cells += rec.context
        if len(self.indices) == s.requests and (self.rows != s.rows or self.cells > s.cells):
            raise _Bad(f"step {s.batch}/{s.id}: its rounds' widths add up to {self.rows} rows and their "
                       f"contexts to {self.cells} cells; the step says {s.rows} rows, {s.cells} cells")


# A record holds one round: at most MAX_WIDTH rows and their candidates (the fixture log's largest
# line is 9 KB). A log is bounded only so that a device posing as one is refused.
MAX_RECORD_BYTES = 16 << 20
MAX_LOG_BYTES = 1 << 36


def read_log(path: str | os.PathLike, on_cut: Callable[[str], None] | None = None) -> Iterator[RoundRecord]:
    """Yield the records of a round log, upgraded to the current schema and checked (``check``,
    and a step's lines together).

    A last line that is not JSON and has no newline was cut by a crash while it was written
    (RoundLog writes each line whole, newline included, so nothing else leaves one): it is left out
    and ``on_cut`` is told so. Raises LogReadError naming the line for any other line that is not a
    record.
    """
    steps = _Steps()
    with open_regular(path, "the round log", MAX_LOG_BYTES, MAX_RECORD_BYTES) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                if not line.endswith(b"\n"):  # only the last line can lack one
                    if on_cut is not None:
                        on_cut(f"{path}:{lineno}: the last line is cut short (a crash while it was written?): left out")
                    return
                raise LogReadError(f"{path}:{lineno}: not a round record ({e})") from None
            try:
                rec = _record(d)
                steps.add(rec)
            except ValueError as e:
                raise LogReadError(f"{path}:{lineno}: not a round record ({e})") from None
            yield rec
