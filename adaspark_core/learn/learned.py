"""The learners a serving process keeps across requests, and their store sections.

Two online models learn while AdaSpark serves (paper 3.1, Figure 2): the width policy (the
verify-cost model with the chooser, chooser.py) and the acceptance model (acceptance.py). Each
persists in its own section of the store (store.py); the acceptance model's per-request intercept
and offset are not stored, they restart with each request.

Every learner, these two, their parts and ``Learners`` itself, keeps one contract
(tests/learn/test_learner_contract.py): ``learn(rec)`` reads a round record and never changes it;
``state()`` is plain JSON, with the section's ``version``; ``from_state(st, params, path)`` checks
every field (checks.py), upgrades an older section and refuses a newer one, and returns a new
learner whose ``state()`` is ``st``'s (upgraded).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from adaspark_core.base.checks import NewerVersion, UnknownField, mapping
from adaspark_core.base.errors import StoreError
from adaspark_core.learn.acceptance import AcceptanceModel, AcceptParams, RoundScore
from adaspark_core.learn.chooser import AdaptiveWidth, Chooser, WidthParams
from adaspark_core.learn.cost import CostModel
from adaspark_core.learn.depth import DepthParams, DraftDepth

WIDTH_SECTION = "width"
ACCEPTANCE_SECTION = "acceptance"
DEPTH_SECTION = "depth"
# The sampled regime's learners, as a section holding their own width and acceptance sections.
SAMPLED_SECTION = "sampled"
HINT = "it was left as is: move it away or run `adaspark store reset`"


@dataclass
class LearnerParams:
    width: WidthParams = field(default_factory=WidthParams)
    acceptance: AcceptParams = field(default_factory=AcceptParams)
    depth: DepthParams = field(default_factory=DepthParams)


@dataclass(slots=True)
class Learners:
    """The greedy regime's learners, and the sampled regime's (``sampled``) once a sampled request
    came: a sampled round accepts a child x of an accepted parent with probability p(x) under the
    sampler, not iff x is the argmax, so its acceptance is a regime of its own (a temperature
    feature would assume one shape across temperatures and tie greedy buckets to sampled ones;
    a regime starts from the greedy learners' state and learns apart). Both persist and replay."""

    policy: AdaptiveWidth = field(default_factory=AdaptiveWidth)
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    sampled: Learners | None = None
    depth: DraftDepth = field(default_factory=DraftDepth)  # a draft model's depth (learn/depth.py)

    @classmethod
    def fresh(cls, params: LearnerParams | None = None) -> "Learners":
        """Learners that know nothing yet, with ``params`` (Table 14's values by default)."""
        p = params or LearnerParams()
        return cls(AdaptiveWidth(CostModel(p.width.cost), Chooser(p.width.chooser)), AcceptanceModel(p.acceptance),
                   depth=DraftDepth(p.depth))

    def regime(self, sampled: bool) -> "Learners":
        """The learners a request decodes and learns with: these for a greedy one; for a sampled
        one the sampled regime's, made at the first sampled request as a copy of these (its cost
        model then knows the verify times, its acceptance model the buckets' greedy rates to
        start from). The live run and replay both call this at the same point of the stream, so
        replay reproduces the copy."""
        if not sampled:
            return self
        # A regime no request began in is an untouched copy (its only requests were forgotten):
        # it is copied again now, as replay, which never saw it, copies it at this point.
        if self.sampled is None or self.sampled.acceptance.requests == 0:
            self.sampled = Learners(copy.deepcopy(self.policy), copy.deepcopy(self.acceptance),
                                    depth=copy.deepcopy(self.depth))
        return self.sampled

    def start_request(self, request: str = "", alone: bool = True) -> None:
        """A request begins: the per-request state restarts (the acceptance model's intercept
        and offset); what persists across requests stays. Requests decoded together (not
        ``alone``) each keep their own, selected by ``use``."""
        self.acceptance.start_request(request, alone)

    def forget_request(self, request: str) -> None:
        """``request`` ended before the round log said it began (AcceptanceModel.forget_request)."""
        self.acceptance.forget_request(request)

    def use(self, request: str) -> None:
        """The next decision and learning step are for ``request`` (of several decoded together)."""
        self.acceptance.use(request)

    def learn(self, rec) -> RoundScore:
        """Every learner learns from one round's record, the width policy first, the draft depth
        last (the order the live run and replay share). Returns the acceptance model's score of
        the round's labels."""
        self.policy.learn(rec)
        score = self.acceptance.learn(rec)
        self.depth.learn(rec)
        return score

    def state(self) -> dict:
        """The store sections, by name (each learner versions its own)."""
        st = {WIDTH_SECTION: self.policy.state(), ACCEPTANCE_SECTION: self.acceptance.state()}
        if self.depth.rounds:  # else no draft model was ever asked: a store without one has none
            st[DEPTH_SECTION] = self.depth.state()
        if self.sampled is not None and self.sampled.acceptance.requests:  # else an untouched copy (regime)
            st[SAMPLED_SECTION] = self.sampled.state()
        return st

    @classmethod
    def from_state(cls, st: dict, params: LearnerParams | None = None, path: str = "sections") -> "Learners":
        """Restore a ``state()``: each section checked by its learner's ``from_state``, fresh
        where it is absent. Another section is not the learners' to check: the store keeps it as
        it is."""
        p = params or LearnerParams()
        fresh = cls.fresh(p)
        width, accept = mapping(st, path).get(WIDTH_SECTION), st.get(ACCEPTANCE_SECTION)
        depth = st.get(DEPTH_SECTION)
        sampled = st.get(SAMPLED_SECTION)
        if sampled is not None and SAMPLED_SECTION in mapping(sampled, f"{path}.{SAMPLED_SECTION}"):
            raise ValueError(f"{path}.{SAMPLED_SECTION}: a regime has no regime of its own")
        return cls(AdaptiveWidth.from_state(width, p.width, f"{path}.{WIDTH_SECTION}") if width is not None
                   else fresh.policy,
                   AcceptanceModel.from_state(accept, p.acceptance, f"{path}.{ACCEPTANCE_SECTION}") if accept is not None
                   else fresh.acceptance,
                   cls.from_state(sampled, params, f"{path}.{SAMPLED_SECTION}") if sampled is not None else None,
                   DraftDepth.from_state(depth, p.depth, f"{path}.{DEPTH_SECTION}") if depth is not None
                   else fresh.depth)

    @classmethod
    def from_store(cls, store, params: LearnerParams | None = None, hint: str = HINT) -> "Learners":
        """The learners restored from ``store``'s sections (``from_state``).

        Every field of both sections is checked first, so a damaged section is a StoreError
        ending in ``hint`` here, before any decoding, and is never saved back. A field this
        version does not know is refused too: restoring without it would drop it from the file at
        the next save; so is a section of a newer version, whose fields may mean something else."""
        try:
            return cls.from_state(store.sections, params)
        except NewerVersion as e:
            raise StoreError(f"the store {store.path} was written by a newer AdaSpark ({e}); {hint}") from None
        except UnknownField as e:
            raise StoreError(f"the store {store.path} has a field this version does not know: {e} "
                             f"(written by a newer AdaSpark?); {hint}") from None
        except ValueError as e:  # checks.py names the field
            raise StoreError(f"the store {store.path} is damaged, this version cannot read it: {e}; {hint}") from None
        except (KeyError, TypeError, AttributeError) as e:  # a check this version lacks
            raise StoreError(f"the store {store.path} is damaged, this version cannot read it "
                             f"({type(e).__name__}: {e}); {hint}") from None

    def to_store(self, store) -> None:
        state = self.state()
        for name, st in state.items():
            store.put(name, st)
        if SAMPLED_SECTION not in state:  # a regime saved while a request that was then forgotten ran
            store.sections.pop(SAMPLED_SECTION, None)
