"""The width decision: how many rows a round verifies, and why. One type from the chooser
(learn/chooser.py) through the round and the batched step (decode/round.py, decode/batch.py) and
the round record (store/record.py) to replay, which decides every logged round again."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class WidthDecision:
    """``width``: the rows verified, the anchor's included. ``offered``: every width the arm
    offered, in increasing order, each with its price in ms where the arm priced the round (an
    adaptive arm past cold start), else None. ``measure``: the width a cold-start round verifies to
    measure it (then ``width`` is it). ``favourite``: the chooser's own best width where it chose
    (hysteresis may hold another); not logged, since replay computes it again."""

    width: int
    offered: dict[int, float | None]
    measure: int | None = None
    favourite: int | None = None

    @classmethod
    def unpriced(cls, width: int, offered: list[int], measure: int | None = None) -> "WidthDecision":
        """A decision no price made: a fixed arm's, a cold-start round's, a round without candidates'."""
        return cls(width, dict.fromkeys(offered), measure)

    @classmethod
    def logged(cls, width: int, offered: list[int], prices: list[float] | None, measure: int | None) -> "WidthDecision":
        """From a round record's columns: the offered widths and their prices (None: unpriced)."""
        return cls(width, dict(zip(offered, prices)) if prices is not None else dict.fromkeys(offered), measure)

    @property
    def prices(self) -> dict[int, float] | None:
        """The offered widths' prices, or None where the round was not priced."""
        if not self.offered or None in self.offered.values():
            return None
        return self.offered  # type: ignore[return-value]

    def columns(self) -> tuple[list[int], list[float] | None]:
        """(offered widths, their prices or None): how a round record's line holds them."""
        prices = self.prices
        return list(self.offered), (list(prices.values()) if prices is not None else None)
