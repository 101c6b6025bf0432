"""N-gram candidates from the request's own text (paper section 3.3, "N-gram candidates").

The source reads the request's own tokens (prompt, history, reply so far). From the anchor and
from each drafter pick it follows a chain: the token that followed an earlier occurrence of the
current context, read on along the earlier passage (copy mode), or else the most frequent follower
of the last three tokens (follower mode). A chain step equal to a drafter candidate marks that
candidate agreed; a drafter candidate beside a different proposal is marked contradicted; any
other step becomes an n-gram node. Beyond the paper, where earlier occurrences of the context
continue differently, a few of those other continuations become sibling chains of their own.

Everything here is pure Python and a function of its arguments; nothing touches llama.cpp.

Terms used below:

- ``H`` is the hypothetical text a chain step continues: the committed tokens (``index.tokens``)
  followed by ``extra``, the tokens on the tree path from the anchor to the chain's current node.
  ``H`` is never materialised; positions past the committed text index into ``extra``.
- A gram "occurred earlier" when it is in the index, i.e. it occurred in the committed text with a
  token after it. The index therefore only ever returns occurrences whose continuation is known.
"""

from __future__ import annotations

from adaspark_core.base import tree
from adaspark_core.base.tree import ANCHOR, COPY_MIN, FOLLOWER_CONTEXT, NGRAM, PICK, Candidate
from adaspark_core.candidates.memory import NgramMemory

MAX_MATCH = 16  # longest suffix looked up
MAX_SCAN = 64  # earlier occurrences scanned when counting followers
ALT_CONTEXT = COPY_MIN  # the context whose other continuations become sibling chains in copy mode
ALT_DEPTH = 8  # a sibling chain's most nodes: its deep nodes are seldom worth a row, and each costs pricing

COPY, FOLLOW, COPY_ALT, FOLLOW_ALT = "copy", "follow", "copy-alt", "follow-alt"
# A copy whose match reaches back past the reply's first token. At a reply's start the chat
# template's tail ("<|im_end|>\n<|im_start|>assistant\n") matches the start of every earlier
# reply, so the match is long but says only that the reply may begin as an earlier one did; its
# own kind gives it buckets of its own, which learn what such a match is worth (priced as a plain
# copy it was over-priced by a third: ARCHITECTURE.md, section 5).
COPY_START = "copy-start"
MEMORY = "memory"  # a chain read from the n-gram memory of earlier requests (memory.py)
_COPY_KINDS = (COPY, COPY_START, COPY_ALT, MEMORY)  # evidence is a match length
_FOLLOW_KINDS = (FOLLOW, FOLLOW_ALT)


def evidence_bin(kind: str, evidence: int) -> str:
    """The evidence bin of a bucket. Copy evidence is a match length, follower evidence a count;
    bins are roughly logarithmic because each doubling of either is about equally informative."""
    if kind in _COPY_KINDS:
        for top, name in ((4, "4"), (7, "5"), (15, "8"), (31, "16")):
            if evidence <= top:
                return name
        return "32"
    if kind in _FOLLOW_KINDS:
        for top, name in ((1, "1"), (2, "2"), (4, "3"), (8, "5")):
            if evidence <= top:
                return name
        return "9"
    raise ValueError(f"unknown n-gram kind {kind!r}")


def _above_bin(above: int) -> str:
    if above <= 3:
        return str(max(above, 0))
    for top, name in ((7, "4"), (15, "8")):
        if above <= top:
            return name
    return "16"


def bucket(kind: str, evidence: int, above: int) -> str:
    """The acceptance model's bucket for an n-gram proposal, e.g. ``"copy/8/0"``: kind, evidence
    bin and how many n-gram nodes lie above it (a proposal below unverified n-gram nodes is only
    as good as the chain it continues, which the first two parts do not see)."""
    return f"{kind}/{evidence_bin(kind, evidence)}/{_above_bin(above)}"


class SuffixIndex:
    """Index of one request's tokens (prompt, history and reply so far), extended every round.

    For every k-gram (1 <= k <= max_match) that has a token after it, ``_end_of`` keeps the end
    position of its most recent occurrence, and ``_prev[k][e]`` the end of the occurrence of the
    k-gram ending at ``e`` before that one (-1 if none, or if no k-gram fits before ``e``): a
    linked list through all earlier occurrences, newest first, held in flat lists of ints. A
    k-gram ending at the last token has no follower yet, so it is inserted only when the next
    token arrives: a lookup therefore finds only earlier occurrences with a known continuation.

    ``extend`` also scores the source on the committed text: before each new token it asks for
    the source's top-1 prediction (what a chain from the anchor would propose first) and counts a
    hit when the token matches. ``p_src`` is that precision, the n-gram's prior in Eq. (6).
    """

    def __init__(self, max_match: int = MAX_MATCH):
        # The fill looks up grams of length COPY_MIN (copies) and FOLLOWER_CONTEXT (followers);
        # an index that cannot hold them would silently never propose anything.
        if max_match < COPY_MIN:
            raise ValueError(f"max_match must be at least {COPY_MIN}")
        self.max_match = max_match
        self.tokens: list[int] = []
        self.start = 0  # where the reply begins: the tokens before it are the prompt (``NgramSource.begin``)
        self._end_of: dict[tuple[int, ...], int] = {}  # gram -> end index of latest occurrence
        self._prev: list[list[int]] = [[] for _ in range(max_match + 1)]  # [k][e]; k = 0 unused
        # Longest suffix of ``tokens`` (any length up to max_match) that is in the index, and the
        # end of its most recent occurrence: kept up to date by ``extend`` (amortised O(1) per
        # token, see there) and used for the anchor chain's first step and the precision score.
        self._match = 0
        self._match_end = -1
        self.predictions = 0
        self.hits = 0

    # ---- building -------------------------------------------------------------------------

    def extend(self, new_tokens: list[int]) -> None:
        """Append committed tokens. Token by token or in bulk gives the same state."""
        toks, end_of, prev, mm = self.tokens, self._end_of, self._prev, self.max_match
        for t in new_tokens:
            # Score the source on this token before it is known (fresh start, as from the anchor).
            guess = self.predict()
            if guess is not None:
                self.predictions += 1
                self.hits += guess == t
            end = len(toks) - 1  # the grams ending here now get their follower, t
            toks.append(t)
            if end >= 0:
                # One tuple of the last max_match tokens before t, sliced per length (a tuple
                # slice is a single allocation; this loop is most of the indexing time).
                window = tuple(toks[max(0, end + 1 - mm) : end + 1])
                w = len(window)
                for k in range(1, mm + 1):
                    if k > w:  # no k-gram fits: keep _prev[k] indexable by end
                        prev[k].append(-1)
                        continue
                    g = window[w - k :]
                    prev[k].append(end_of.get(g, -1))
                    end_of[g] = end
            # The new longest match is at most the old one plus one: if the k-gram ending at the
            # new last token occurred earlier, so did the (k-1)-gram ending one before it, and
            # that one was already indexed. Scanning down from there makes the total work over
            # a text linear (the length grows by at most one per token), instead of up to
            # max_match lookups per token.
            n = len(toks)
            k = min(self._match + 1, mm, n - 1)
            self._match, self._match_end = 0, -1
            while k > 0:
                e = end_of.get(tuple(toks[n - k :]))
                if e is not None:
                    self._match, self._match_end = k, e
                    break
                k -= 1

    @property
    def p_src(self) -> float:
        """The source's top-1 precision on the committed text, Laplace-smoothed (0.5 at first)."""
        return (self.hits + 1) / (self.predictions + 2)

    # ---- lookups --------------------------------------------------------------------------

    def followers(self, gram: tuple[int, ...]) -> list[tuple[int, int, int]]:
        """The distinct tokens that followed the most recent (up to MAX_SCAN) occurrences of
        ``gram``, as (token, count among those occurrences, end index of the most recent
        occurrence it followed), most frequent first, ties to the most recent. Empty if ``gram``
        never occurred with a follower (or is longer than max_match)."""
        k = len(gram)
        if not 1 <= k <= self.max_match:
            return []
        toks, prev = self.tokens, self._prev[k]
        e = self._end_of.get(gram, -1)
        seen: dict[int, list[int]] = {}  # token -> [count, latest end]; insertion = most recent
        scanned = 0
        while e >= 0 and scanned < MAX_SCAN:
            f = toks[e + 1]
            hit = seen.get(f)
            if hit is None:
                seen[f] = [1, e]
            else:
                hit[0] += 1
            scanned += 1
            e = prev[e]
        # sorted() is stable, so equal counts keep the most-recent-first order of the scan.
        return sorted(((f, c, last) for f, (c, last) in seen.items()), key=lambda x: -x[1])

    def predict(self, extra: list[int] | None = None) -> int | None:
        """The source's top-1 proposal for the token after H = tokens + extra, from a fresh start
        (no passage being read), or None."""
        step = self.step(extra or [])
        return None if step is None else step[0]

    def step(self, extra: list[int], p: int = -1, length: int = 0, alts: bool = False):
        """One chain step: the proposal for the token after H = tokens + extra.

        ``p``/``length`` is the copy state: H[p] ends an earlier passage whose last ``length``
        tokens equal H's suffix (p = -1: fresh start, no passage being read). Returns None when
        nothing is proposed, else ``(token, kind, evidence, p, length, alternatives)`` with the
        copy state for the next step (-1, 0 after a follower step) and, when ``alts``, the other
        continuations as ``(token, kind, evidence, p, length)`` (the state an alternative chain
        continues from), most frequent first, ties to the most recent.
        """
        if p < 0:
            length, p = self._longest(extra)
        if p >= 0:
            # Copy mode: read on along the passage. p + 1 may lie in ``extra`` itself: the chain
            # then continues its own output, which is how a loop continues periodically.
            n = len(self.tokens)
            t = self.tokens[p + 1] if p + 1 < n else extra[p + 1 - n]
            others: list[tuple[int, str, int, int, int]] = []
            if alts:
                # Other ways the last ALT_CONTEXT tokens continued earlier. Not the whole copy's
                # context: a long copy's 16-gram is usually unique, so the places where a
                # repeated phrase goes on differently would never show.
                m = min(length, ALT_CONTEXT)
                for f, _, last in self.followers(self.tail(extra, m)):
                    if f != t:
                        others.append((f, COPY_ALT, m, last + 1, m + 1))
            kind = COPY_START if length > n + len(extra) - self.start else COPY
            return t, kind, length, p + 1, length + 1, others
        # Follower mode: no earlier passage matches COPY_MIN tokens, so a single continuation is
        # weak evidence; vote among the followers of the last three tokens instead.
        if not extra and self._match < FOLLOWER_CONTEXT:
            return None  # known without a lookup (the common case while extend scores itself)
        fol = self.followers(self.tail(extra, FOLLOWER_CONTEXT))
        if not fol:
            return None
        t, count, _ = fol[0]
        others = []
        if alts:
            m = FOLLOWER_CONTEXT
            others = [(f, FOLLOW_ALT, c, last + 1, m + 1) for f, c, last in fol[1:]]
        return t, FOLLOW, count, -1, 0, others

    def _longest(self, extra: list[int]) -> tuple[int, int]:
        """(k, end): the longest suffix of H of length COPY_MIN..max_match in the index, and the
        end of its most recent occurrence; (0, -1) when none is that long."""
        if not extra:  # H is the committed text: extend keeps its longest match
            if self._match >= COPY_MIN:
                return self._match, self._match_end
            return 0, -1
        tail = self.tail(extra, self.max_match)
        best = (0, -1)
        # Scan upward: if the k-gram suffix is absent, so is every longer one (a longer earlier
        # occurrence contains a shorter one), so the first miss ends the search. Most contexts
        # miss at COPY_MIN, which costs a single lookup.
        for k in range(COPY_MIN, len(tail) + 1):
            e = self._end_of.get(tail[len(tail) - k :])
            if e is None:
                break
            best = (k, e)
        return best

    def tail(self, extra: list[int], m: int) -> tuple[int, ...]:
        """The last m tokens of H (fewer if H is shorter), without copying the committed text."""
        x = len(extra)
        if x >= m:
            return tuple(extra[x - m :])
        toks = self.tokens
        return tuple(toks[max(0, len(toks) - (m - x)) :]) + tuple(extra)

    def match(self) -> tuple[int, int]:
        """(end index of the earlier occurrence, match length) of the longest matching suffix of
        the committed text, or (-1, 0) when even the last token never occurred before."""
        return (self._match_end, self._match) if self._match else (-1, 0)


def fill(cands: list[Candidate], index: SuffixIndex, depth_limit: int, max_alts: int = 3,
         memory: NgramMemory | None = None) -> None:
    """Append the n-gram candidates of one round to ``cands`` in place (paper 3.3).

    ``cands`` holds the drafter's candidates (or nothing), parents before children. Chains start
    from the anchor, then from each pick in list order that no earlier chain passed through (its
    continuation would repeat that chain's). At each step with proposal t below parent P:

    - a drafter child of P with token t is marked agreed and takes the proposal's features; the
      chain goes on below it. An n-gram child with token t (chains meet) is followed unchanged.
      Otherwise an n-gram node is appended.
    - every other drafter child of P is marked contradicted with the proposal's features (unless
      agreed: agreement wins, and the first proposal to mark a candidate keeps it).

    Where the request's own text offers no copy (nothing, or only a follower vote), a chain asks
    the n-gram ``memory`` of earlier requests (memory.py, beyond the paper): a match of at least
    GRAM tokens there starts a run of ``memory`` nodes, read on along the memory (evidence: the
    match length, one more per step) until its document ends. A copy from the request's own text
    wins over the memory (it is the same conversation); where the memory continues a main chain's
    first step differently, its chain is one more alternative (a sibling), after the own ones.

    Chains stop when the next node would be deeper than ``depth_limit`` or nothing is proposed.
    The alternatives met along the main chains (shallowest first, the anchor chain first at equal
    depth) then become up to ``max_alts`` sibling chains of at most ALT_DEPTH nodes, which read
    on along their own earlier occurrence but spawn no alternatives; they are expanded last so the
    main chains keep the lower indices.
    """
    if depth_limit <= 0:
        return
    _Fill(cands, index, depth_limit, max_alts, memory).run()


class _Fill:
    """One round's fill (``fill``): the candidates so far with lookups by (parent, token), the
    chains' walks and the alternatives they met."""

    def __init__(self, cands: list[Candidate], index: SuffixIndex, depth_limit: int, max_alts: int,
                 memory: NgramMemory | None):
        self.cands, self.index, self.depth_limit, self.max_alts, self.memory = cands, index, depth_limit, max_alts, memory
        self.n0 = len(cands)
        self.kids: dict[tuple[int, int], int] = {}  # (parent, token) -> candidate index
        self.drafted: dict[int, list[int]] = {}  # parent -> its drafter children
        self.ng_path: list[int] = []  # n-gram nodes on the path from the anchor to j, j included
        for j, c in enumerate(cands):
            self.kids[(c.parent, c.token)] = j
            if c.source != NGRAM:
                self.drafted.setdefault(c.parent, []).append(j)
            self.ng_path.append((0 if c.parent == ANCHOR else self.ng_path[c.parent]) + (c.source == NGRAM))
        self.reached: set[int] = set()  # nodes some chain passed through
        # Alternatives found so far, sorted by (depth, chain, rank) and capped at max_alts: a step
        # whose depth and chain sort after the last kept one cannot contribute, so it skips the
        # follower scan that finding alternatives costs.
        self.found: list[tuple] = []

    def run(self) -> None:
        """The anchor's chain, one from each pick no chain passed through, then the alternatives."""
        cands = self.cands
        self.walk(ANCHOR, [], -1, 0, 0)
        chain_no = 0
        for j in range(self.n0):
            c = cands[j]
            if c.source != PICK or j in self.reached or c.depth >= self.depth_limit:
                continue
            chain_no += 1
            self.walk(j, _path_tokens(cands, j), -1, 0, chain_no)
        for _, _, _, parent, f, akind, aev, ap, alen, extra in self.found:
            j = self.kids.get((parent, f))
            if j is not None and cands[j].source == NGRAM:
                continue  # an earlier alternative chain placed it; its continuation is already there
            above = self.above(parent)
            j = self.place(parent, f, akind, aev, above, bucket(akind, aev, above))
            extra.append(f)
            if akind == MEMORY:  # read on along the memory from the token placed
                self.walk(j, extra, -1, 0, None, ap, alen)
            else:
                self.walk(j, extra, ap, alen, None)

    def above(self, parent: int) -> int:
        return 0 if parent == ANCHOR else self.ng_path[parent]

    def walk(self, parent: int, extra: list[int], p: int, length: int, chain_no: int | None,
             mp: int = -1, mlen: int = 0) -> None:
        """Follow one chain from ``parent``; ``chain_no`` None: an alternative chain. ``mp``,
        ``mlen``: reading the memory (the position of the last token read, the match length)."""
        cands = self.cands
        depth = start = 0 if parent == ANCHOR else cands[parent].depth
        limit = self.depth_limit if chain_no is not None else min(self.depth_limit, depth + ALT_DEPTH - 1)
        while depth < limit:
            if mp >= 0:
                t = self.memory.read_on(mp)
                if t is None:
                    return
                mp, mlen = mp + 1, mlen + 1
                prop = (t, MEMORY, mlen, -1, 0, ())
            else:
                prop = self.propose(extra, p, length, depth, start, chain_no)
                if prop is None:
                    return
                if prop[1] == MEMORY:  # a memory match: the chain reads on along it from here
                    mlen, mp = prop[2], prop[3]
                    prop = (*prop[:3], -1, 0, ())
            t, kind, ev, p, length, others = prop
            above = self.above(parent)
            b = bucket(kind, ev, above)
            self.contradict(parent, t, kind, ev, b)
            self.note_alternatives(parent, depth, chain_no, others, extra)
            j = self.place(parent, t, kind, ev, above, b)
            self.reached.add(j)
            extra.append(t)
            parent = j
            depth += 1

    def propose(self, extra: list[int], p: int, length: int, depth: int, start: int, chain_no: int | None):
        """The next step of a chain on the request's own text: (token, kind, evidence, position,
        length, alternatives), or where the text offers no copy a memory match (token, MEMORY,
        match length, its position in the memory, 0, no alternatives), or None."""
        memory, found = self.memory, self.found
        want = chain_no is not None and self.max_alts > 0 and (
            len(found) < self.max_alts or (depth + 1, chain_no) < found[-1][:2]
        )
        prop = self.index.step(extra, p, length, alts=want)
        if memory is not None and (prop is None or prop[1] in _FOLLOW_KINDS):
            hit = memory.lookup(self.index.tail(extra, MAX_MATCH))
            if hit is not None:
                t, mlen, mp = hit
                prop = (t, MEMORY, mlen, mp, 0, ())
        elif memory is not None and want and depth == start:
            # A main chain's first step copies the request's own text: where the memory goes on
            # differently, its chain becomes a sibling (after the own alternatives).
            hit = memory.lookup(self.index.tail(extra, MAX_MATCH))
            if hit is not None and hit[0] != prop[0]:
                prop = (*prop[:5], [*prop[5], (hit[0], MEMORY, hit[1], hit[2], hit[1])])
        return prop

    def contradict(self, parent: int, t: int, kind: str, ev: int, b: str) -> None:
        """Every drafter child of ``parent`` with another token than the proposal's is marked
        contradicted with its features (unless agreed; the first proposal to mark one keeps it)."""
        cands = self.cands
        for d in self.drafted.get(parent, ()):
            c = cands[d]
            if c.token != t and not c.agreed and not c.contradicted:
                c.contradicted = True
                c.kind, c.evidence, c.bucket = kind, ev, b

    def note_alternatives(self, parent: int, depth: int, chain_no: int | None, others, extra: list[int]) -> None:
        """Keep the step's alternatives among the first ``max_alts`` by (depth, chain, rank)."""
        found, cands = self.found, self.cands
        for rank, (f, akind, aev, ap, alen) in enumerate(others):
            j = self.kids.get((parent, f))
            if j is not None and cands[j].source == NGRAM:
                continue  # already an n-gram continuation here
            if any(x[3] == parent and x[4] == f for x in found):
                continue
            found.append((depth + 1, chain_no, rank, parent, f, akind, aev, ap, alen, extra[:]))
            found.sort(key=lambda x: x[:3])
            del found[self.max_alts:]

    def place(self, parent: int, t: int, kind: str, ev: int, above: int, b: str) -> int:
        """The child of ``parent`` with token t: an existing one (a drafter candidate is marked
        agreed) or a new n-gram node."""
        cands, kids = self.cands, self.kids
        j = kids.get((parent, t))
        if j is None:
            cands.append(tree.child_of(cands, parent, t, NGRAM, kind=kind, evidence=ev,
                                       above=above, bucket=b))
            j = len(cands) - 1
            kids[(parent, t)] = j
            self.ng_path.append(above + 1)
        elif cands[j].source != NGRAM and not cands[j].agreed:
            c = cands[j]
            c.agreed, c.contradicted = True, False
            c.kind, c.evidence, c.bucket = kind, ev, b
        return j


def _path_tokens(cands: list[Candidate], j: int) -> list[int]:
    """Tokens on the path from the anchor to candidate j, j included."""
    out: list[int] = []
    while j != ANCHOR:
        out.append(cands[j].token)
        j = cands[j].parent
    out.reverse()
    return out


class KeptIndexes:
    """The index each slot's last request ended with (its prompt and its committed reply), so
    that the next request on the slot, whose prompt usually starts with that text (a
    conversation's next turn), extends it instead of indexing its whole prompt again: extending
    token by token gives the state indexing in bulk does, so the index is the same either way.
    (Indexing a long prompt whole delays the first token: ARCHITECTURE.md, section 5.)
    Keyed by the slot (the target object), one index each."""

    def __init__(self):
        self._by_slot: dict = {}

    def take(self, slot, tokens: list[int]) -> SuffixIndex | None:
        """The slot's kept index if its text is a prefix of ``tokens`` (then it is the caller's),
        else None (and it is dropped)."""
        idx = self._by_slot.pop(slot, None)
        if idx is not None and len(idx.tokens) <= len(tokens) and idx.tokens == tokens[: len(idx.tokens)]:
            return idx
        return None

    def put(self, slot, index: SuffixIndex) -> None:
        self._by_slot[slot] = index


class NgramSource:
    """The n-gram source as a Proposer (candidates/base.py): the fill of each round from the
    request's own text (a SuffixIndex made at ``begin``) or, where it has no copy to offer, from
    the ``memory`` of earlier replies, which keeps this reply when it ends (unless not
    ``remember``: a timing repeat of a reply must not find itself there). With ``kept``, the index
    starts from the one the slot's last request ended with where the prompt continues its text,
    and is kept for the next request when this one ends."""

    name = "ngram"
    sequential = False

    def __init__(self, max_alts: int, memory: NgramMemory | None = None, remember: bool = True,
                 kept: KeptIndexes | None = None, slot=None):
        self.max_alts = max_alts
        self.memory = memory
        self.remember = remember
        self.kept, self.slot = kept, slot
        self.index = SuffixIndex()

    @property
    def p_src(self) -> float:
        """The request's n-gram precision so far (Eq. 6's prior of an n-gram node)."""
        return self.index.p_src

    def begin(self, tokens: list[int]) -> None:
        idx = self.kept.take(self.slot, tokens) if self.kept is not None else None
        if idx is None:
            idx = SuffixIndex()
        idx.extend(tokens[len(idx.tokens):])
        idx.start = len(tokens)
        self.index = idx

    def propose(self, cands: list[Candidate], depth_limit: int, go_on=None) -> None:
        fill(cands, self.index, min(depth_limit, tree.MAX_CHAIN_DEPTH), self.max_alts, self.memory)

    def accept(self, committed: list[int], verified: list[Candidate], accepted: list[Candidate]) -> None:
        self.index.extend(committed)
        if self.memory is not None and verified:
            self.memory.note(sum(c.kind == MEMORY for c in verified), sum(c.kind == MEMORY for c in accepted))

    def end(self, reply: list[int]) -> None:
        if self.memory is not None and self.remember and reply:
            self.memory.add(reply)
        if self.kept is not None:
            self.kept.put(self.slot, self.index)
