"""The learners a serving process keeps across requests, and their store sections.

Two online models learn while AdaSpark serves (paper 3.1, Figure 2): the width policy (the
verify-cost model with the chooser, chooser.py) and the acceptance model (acceptance.py). Each
persists in its own section of the store (store.py); the acceptance model's per-request intercept
and offset are not stored, they restart with each request.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .acceptance import AcceptanceModel
from .checks import UnknownField
from .chooser import AdaptiveWidth
from .store import StoreError

WIDTH_SECTION = "width"
ACCEPTANCE_SECTION = "acceptance"
HINT = "it was left as is: move it away or run `adaspark store reset`"


@dataclass(slots=True)
class Learners:
    policy: AdaptiveWidth = field(default_factory=AdaptiveWidth)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)

    @classmethod
    def from_store(cls, store, hint: str = HINT) -> "Learners":
        """The learners restored from ``store``'s sections, fresh where a section is absent.

        Every field of both sections is checked first (each learner's ``from_state``, with
        checks.py), so a damaged section is a StoreError ending in ``hint`` here, before any
        decoding, and is never saved back. A field this version does not know is refused too:
        restoring without it would drop it from the file at the next save."""
        width, accept = store.get(WIDTH_SECTION), store.get(ACCEPTANCE_SECTION)
        try:
            return cls(AdaptiveWidth.from_state(width, path=f"sections.{WIDTH_SECTION}")
                       if width is not None else AdaptiveWidth(),
                       AcceptanceModel.from_state(accept, path=f"sections.{ACCEPTANCE_SECTION}")
                       if accept is not None else AcceptanceModel())
        except UnknownField as e:
            raise StoreError(f"the store {store.path} has a field this version does not know: {e} "
                             f"(written by a newer AdaSpark?); {hint}") from None
        except ValueError as e:  # checks.py names the field
            raise StoreError(f"the store {store.path} is damaged, this version cannot read it: {e}; {hint}") from None
        except (KeyError, TypeError, AttributeError) as e:  # a check this version lacks
            raise StoreError(f"the store {store.path} is damaged, this version cannot read it "
                             f"({type(e).__name__}: {e}); {hint}") from None

    def to_store(self, store) -> None:
        store.put(WIDTH_SECTION, self.policy.state())
        store.put(ACCEPTANCE_SECTION, self.acceptance.state())

    def state(self) -> dict:
        return {WIDTH_SECTION: self.policy.state(), ACCEPTANCE_SECTION: self.acceptance.state()}
