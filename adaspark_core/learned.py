"""The learners a serving process keeps across requests, and their store sections.

Two online models learn while AdaSpark serves (paper 3.1, Figure 2): the width policy (the
verify-cost model with the chooser, chooser.py) and the acceptance model (acceptance.py). Each
persists in its own section of the store (store.py); the acceptance model's per-request intercept
and offset are not stored, they restart with each request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .acceptance import AcceptanceModel
from .chooser import AdaptiveWidth
from .store import StoreError

WIDTH_SECTION = "width"
ACCEPTANCE_SECTION = "acceptance"


@dataclass(slots=True)
class Learners:
    policy: AdaptiveWidth = field(default_factory=AdaptiveWidth)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)

    @classmethod
    def from_store(cls, store) -> "Learners":
        """The learners restored from ``store``'s sections, fresh where a section is absent."""
        width, accept = store.get(WIDTH_SECTION), store.get(ACCEPTANCE_SECTION)
        try:
            return cls(AdaptiveWidth.from_state(width) if width else AdaptiveWidth(),
                       AcceptanceModel.from_state(accept) if accept else AcceptanceModel())
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise StoreError(f"the store {store.path} has a learner section this version cannot read "
                             f"({type(e).__name__}: {e}); it was left as is: move it away or run "
                             f"`adaspark store reset`") from None

    def to_store(self, store) -> None:
        store.put(WIDTH_SECTION, self.policy.state())
        store.put(ACCEPTANCE_SECTION, self.acceptance.state())

    def state(self) -> dict:
        return {WIDTH_SECTION: self.policy.state(), ACCEPTANCE_SECTION: self.acceptance.state()}
