"""Append-only schema upgrades, shared by the round log and the store."""

from __future__ import annotations

from typing import Callable


def apply_upgrades(d: dict, upgrades: list[Callable[[dict], dict]], current: int) -> dict:
    """Bring a parsed document of schema ``d["schema"]`` to ``current``: ``upgrades[i]`` turns
    schema i+1 into i+2. ValueError for a schema this build does not know."""
    version = d.get("schema")
    if type(version) is not int or not 1 <= version <= current:
        raise ValueError(f"unknown schema {version!r} (this build reads 1..{current})")
    for step in upgrades[version - 1 :]:
        d = step(d)
    d["schema"] = current
    return d
