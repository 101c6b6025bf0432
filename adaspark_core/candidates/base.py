"""The proposer contract: what every source of candidates implements, one request at a time.

The shape of llama.cpp's ``common_speculative`` (begin, draft, accept) and of Hugging Face's
``CandidateGenerator``: a request ``begin``s with its prompt; each round every proposer, in order,
``propose``s into the round's candidates (a later one sees what the earlier ones proposed: the
n-gram fill hangs its chains from the drafter's picks and marks where it agrees); after the verify
each ``accept``s what the round committed, with the candidates verified and those accepted; the
request ``end``s with its reply. The model drafters (drafters.py: DSpark, a draft model) and the
n-gram source (ngram.py: the request's own text, then the memory of earlier replies) implement it,
and so does the simulated drafter of the learner studies (engine/sim.py)."""

from __future__ import annotations

from typing import Protocol

from adaspark_core.base.tree import PICK, Candidate, append_proposal


class Proposer(Protocol):
    name: str
    # Drafts position by position, one forward each (a draft model): it asks ``go_on`` before
    # each position and leaves its forwards' times in ``last_draft`` (RoundRecord.drafting).
    sequential: bool

    def begin(self, tokens: list[int]) -> None:
        """A new request whose committed tokens so far are ``tokens`` (the last is the anchor)."""

    def propose(self, cands: list[Candidate], depth_limit: int, go_on=None) -> None:
        """Add this round's candidates to ``cands`` in place: below the anchor, parents before
        children, none deeper than ``depth_limit``; features (h, share) set, ``q`` left to the
        acceptance model. ``cands`` holds what the proposers before this one proposed.
        ``go_on(hs, limit)``: for a proposer that drafts position by position (a draft model),
        whether to draft one more given its picks' h so far, of at most ``limit`` this round
        (learn/depth.py); others ignore it."""

    def accept(self, committed: list[int], verified: list[Candidate], accepted: list[Candidate]) -> None:
        """The round committed ``committed`` (the last is the new anchor); ``verified`` are the
        candidates its verify held, ``accepted`` those on the accepted path."""

    def end(self, reply: list[int]) -> None:
        """The request ended; ``reply`` is what it emitted."""


def propose_round(proposers: list[Proposer], depth_limit: int, go_on=None) -> list[Candidate]:
    """One round's candidates, unpriced: every proposer in order (none below a depth limit of 0),
    each told the depth rule ``go_on`` (Proposer.propose)."""
    cands: list[Candidate] = []
    if depth_limit > 0:
        for source in proposers:
            source.propose(cands, depth_limit, go_on)
    return cands


class PicksOnly:
    """A model drafter's picks alone, re-linked as one chain (the ``block-chain`` arm: the whole
    block verified as a chain, its siblings dropped); otherwise the drafter itself."""

    def __init__(self, drafter: Proposer):
        self.drafter = drafter
        self.name = f"{drafter.name}-picks"
        self.sequential = drafter.sequential

    def begin(self, tokens: list[int]) -> None:
        self.drafter.begin(tokens)

    def propose(self, cands: list[Candidate], depth_limit: int, go_on=None) -> None:
        mine: list[Candidate] = []
        self.drafter.propose(mine, depth_limit, go_on)
        picks = [c for c in mine if c.source == PICK]
        for i, c in enumerate(picks):
            c.parent = i - 1  # ANCHOR for the first
        append_proposal(cands, picks)

    def accept(self, committed: list[int], verified: list[Candidate], accepted: list[Candidate]) -> None:
        self.drafter.accept(committed, verified, accepted)

    def end(self, reply: list[int]) -> None:
        self.drafter.end(reply)
