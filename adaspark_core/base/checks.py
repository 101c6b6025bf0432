"""Checks of learned state read back from a store, shared by the learners' restore functions.

A store can pass the file checks (valid JSON, known schema, right fingerprint) and still hold a
learner section that would crash a decode, or mislead it, long after it was read: an FTRL vector
of the wrong length, a negative count, a width no table can hold, a NaN that JSON turned into
null. Each learner's ``from_state`` / ``load`` checks every field with these functions before it
uses any, so a damaged store is reported when it is opened and never saved back.

Every check is a pure function: it returns the value (a number as float, a count as int) or
raises ValueError naming the field by its dotted path in the store (``sections.width.cost...``).
A field this version does not know raises UnknownField, a ValueError: a newer AdaSpark may have
written it, and restoring without it would drop it on the next save.

Every learner versions its own section (``version``): a learner whose layout changes bumps its
``VERSION`` and upgrades older sections itself (cost.upgrade_state), so the store's file schema
never has to know a learner's layout.
"""

from __future__ import annotations

import math

# The largest magnitude of any learned float. The learners' floats are times in ms, decayed sums,
# FTRL weights and accumulated (squared) gradients, and none comes near it: an hour is 3.6e6 ms, a
# decayed sum is at most a few hundred of its steps, and an accumulated gradient grows by at most
# ~1e4 a step even at a context of a million tokens (the law's u^2 term), ~1e13 after a billion
# rounds. Under it the products the pricing forms stay finite; 1e308 overflows to inf at the
# first one and turns the prices into NaN, which the next save writes as null.
LIMIT = 1e15


VERSION_FIELD = "version"


class UnknownField(ValueError):
    """A field a known section does not have (the dotted path is the message)."""


class NewerVersion(UnknownField):
    """A section of a version above the one this build writes: a newer AdaSpark wrote it."""


def _show(v) -> str:
    if v is None:
        return "null"
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def fields(v, path: str, known: tuple[str, ...], legacy: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> dict:
    """``v``, an object with exactly the fields ``known``, and perhaps the ``optional`` ones;
    ``legacy`` ones (written by an older version, no longer read) are allowed and ignored."""
    if not isinstance(v, dict):
        raise ValueError(f"{path} is {_show(v)}, not an object")
    for k in v:
        if k not in known and k not in legacy and k not in optional:
            raise UnknownField(f"{path}.{k}")
    for k in known:
        if k not in v:
            raise ValueError(f"{path}.{k} is missing")
    return v


def section(st, path: str, current: int, known: tuple[str, ...], legacy: tuple[str, ...] = ()) -> int:
    """Check a learner's section: its ``version`` (1 to ``current``), then its fields ``known``
    (``fields``). Returns the version."""
    v = version(st, path, current)
    fields(st, path, known, legacy, optional=(VERSION_FIELD,))
    return v


def version(st, path: str, current: int) -> int:
    """The version of the learner section ``st``, 1 to ``current``. A section without one was
    written before learners versioned their sections, so it is the oldest, 1. A version above
    ``current`` is refused (NewerVersion) rather than read as this one: its fields may mean
    something else."""
    v = mapping(st, path).get(VERSION_FIELD, 1)
    if type(v) is not int or v < 1:
        raise ValueError(f"{path}.{VERSION_FIELD} is {_show(v)}, not an integer >= 1")
    if v > current:
        raise NewerVersion(f"{path}.{VERSION_FIELD} is {v}, this version reads 1 to {current}")
    return v


def mapping(v, path: str) -> dict:
    """``v``, an object with any (string) keys."""
    if not isinstance(v, dict):
        raise ValueError(f"{path} is {_show(v)}, not an object")
    return v


def array(v, path: str, length: int | None = None, min_len: int = 0, max_len: int | None = None) -> list:
    """``v``, a list of exactly ``length`` items, or of ``min_len`` to ``max_len``."""
    if not isinstance(v, list):
        raise ValueError(f"{path} is {_show(v)}, not a list")
    if length is not None and len(v) != length:
        raise ValueError(f"{path} has {len(v)} items, not {length}")
    if len(v) < min_len or (max_len is not None and len(v) > max_len):
        raise ValueError(f"{path} has {len(v)} items, not {min_len} to {max_len}")
    return v


def number(v, path: str, lo: float = -LIMIT, hi: float = LIMIT, positive: bool = False) -> float:
    """``v`` as a float: a finite number (not a bool, not null) in [lo, hi], and > 0 if
    ``positive``."""
    # The range first: NaN fails it, and so does an integer too large for a float.
    ok = type(v) in (int, float) and lo <= v <= hi and math.isfinite(v) and (v > 0 or not positive)
    if not ok:
        raise ValueError(f"{path} is {_show(v)}, not a number in {'(' if positive else '['}{lo:g}, {hi:g}]")
    return float(v)


def numbers(v, path: str, lo: float = -LIMIT, hi: float = LIMIT, positive: bool = False, **size) -> list[float]:
    """A list of numbers (``number``); ``size``: the list's ``length`` or ``min_len`` / ``max_len``."""
    return [number(x, f"{path}.{i}", lo, hi, positive) for i, x in enumerate(array(v, path, **size))]


def count(v, path: str, lo: int = 0, hi: int | None = None) -> int:
    """``v``, an integer (a JSON integer: not a bool, not a float) in [lo, hi]."""
    if type(v) is not int or v < lo or (hi is not None and v > hi):
        raise ValueError(f"{path} is {_show(v)}, not an integer " + (f">= {lo}" if hi is None else f"in [{lo}, {hi}]"))
    return v


def int_key(k: str, path: str, lo: int, hi: int) -> int:
    """An object key that is an integer in [lo, hi], written as ``str(n)`` writes it (so that no
    two keys, "8" and "08", stand for one number and one of them is lost)."""
    try:
        n = int(k)
    except ValueError:
        n = None
    if n is None or str(n) != k or not lo <= n <= hi:
        raise ValueError(f"{path} has the key {_show(k)}, not an integer in [{lo}, {hi}]")
    return n
