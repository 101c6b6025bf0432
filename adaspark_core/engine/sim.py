"""Simulated targets and drafters with a known verify cost and a known acceptance law.

They exist to test the online cost model and the width chooser against ground truth: the true
verify time ``T(n, c)`` is a given curve (paper 3.2, Figure 3, Table 1), observed times carry
one-sided interference (Proposition 3), and the drafter's candidates are right with known
probabilities that the scheduler's simple prior prices exactly (paper 2.2, Eq. 1), so the long-run
rate of every pinned width, and hence the best pinned width, can be computed exactly
(``expected_rate``, ``best_pinned``).

Nothing here touches llama.cpp, the wall clock or global random state: every draw comes from a
``random.Random`` seeded from the constructor's seed (and, for the drafter, the round's position),
so a run is a pure function of its seeds.

Units: times in milliseconds, except ``VirtualClock()`` which returns seconds like
``time.perf_counter``; context ``c`` in tokens; widths ``n`` in verify rows (the anchor included).
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass

from adaspark_core.base.tree import (
    ANCHOR,
    PICK,
    SIBLING,
    Candidate,
    Layout,
    append_proposal,
    best_first,
    child_of,
    head_q,
    path_products,
)
from adaspark_core.engine.base import Verified

# Token ids. SimText draws distinct tokens from [TOKEN_LO, TOKEN_HI); SENTINEL is the argmax of a
# row whose path left the truth (no drafter ever proposes it, so nothing below a wrong node is
# accepted); EOG is the end token, emitted only where SimText was told to (``eog_at``).
TOKEN_LO, TOKEN_HI = 10, 1 << 24
SENTINEL = 1
EOG = 2


def _rng(*keys: object) -> random.Random:
    """A generator seeded from ``keys`` alone. A str seed is hashed with SHA-512 by ``random``, so
    this is reproducible across processes (unlike ``hash()`` of a str) and independent per key."""
    return random.Random("sim:" + ":".join(map(str, keys)))


# --- the clock --------------------------------------------------------------------------------


class VirtualClock:
    """A clock for ``Generation(clock=...)``: returns seconds, starts at 0, moves only when told.

    The simulated drafter advances it by its drafting time inside ``propose`` and the simulated
    target by the observed verify time inside ``verify``, so the scheduler measures D and T as it
    would on a real machine."""

    def __init__(self) -> None:
        self.ms = 0.0  # elapsed virtual milliseconds

    def __call__(self) -> float:
        return self.ms / 1e3

    def advance_ms(self, ms: float) -> None:
        if ms < 0:
            raise ValueError("a virtual clock does not run backwards")
        self.ms += ms


# --- the true verify cost ----------------------------------------------------------------------

STEP, LINEAR = "step", "linear-interp"


@dataclass(frozen=True)
class CostCurve:
    """The machine's true verify time ``T(n, c) = alpha(n) + beta(n) * c / 1000`` in ms (Eq. 3).

    ``points`` are ``(width, alpha_ms, beta_ms_per_1k_tokens)`` with increasing widths.
    ``kind == "step"``: the points are row classes (paper 3.2, Eq. 2); width ``n`` costs the class
    with the smallest top width >= n, so time is flat inside a class and steps between classes
    (not necessarily upward). ``kind == "linear-interp"``: alpha and beta are interpolated linearly
    between listed widths, for curves that rise with every row (a routed MoE target) or a measured
    table. Widths outside ``[1, max width]`` (step) or ``[min, max width]`` (interp) raise."""

    name: str
    kind: str
    points: tuple[tuple[int, float, float], ...]

    def __post_init__(self) -> None:
        if self.kind not in (STEP, LINEAR):
            raise ValueError(f"cost curve kind must be {STEP!r} or {LINEAR!r}, not {self.kind!r}")
        widths = [p[0] for p in self.points]
        if not widths or widths[0] < 1 or any(b <= a for a, b in zip(widths, widths[1:])):
            raise ValueError("cost curve widths must be positive and strictly increasing")

    @staticmethod
    def from_points(points, kind: str = LINEAR, name: str = "custom") -> "CostCurve":
        """Any curve, e.g. for tests: ``points`` are (width, alpha_ms, beta_ms_per_1k) triples, or
        (width, ms) pairs for a curve that does not depend on context."""
        triples = tuple((int(p[0]), float(p[1]), float(p[2]) if len(p) > 2 else 0.0) for p in points)
        return CostCurve(name, kind, triples)

    @property
    def widths(self) -> list[int]:
        return [p[0] for p in self.points]

    @property
    def max_width(self) -> int:
        return self.points[-1][0]

    def coefficients(self, n: int) -> tuple[float, float]:
        """(alpha_ms, beta_ms_per_1k_tokens) of width ``n``."""
        widths = self.widths
        if n > widths[-1] or n < 1 or (self.kind == LINEAR and n < widths[0]):
            raise ValueError(f"{self.name}: no verify time for {n} rows (widths {widths[0]}..{widths[-1]})")
        i = bisect.bisect_left(widths, n)  # first listed width >= n
        w, a, b = self.points[i]
        if self.kind == STEP or w == n:
            return a, b
        w0, a0, b0 = self.points[i - 1]
        f = (n - w0) / (w - w0)
        return a0 + f * (a - a0), b0 + f * (b - b0)

    def true_ms(self, n: int, c: int) -> float:
        """The noise-free verify time (ms) of ``n`` rows at ``c`` tokens of context."""
        a, b = self.coefficients(n)
        return a + b * c / 1e3


def _scaled(p: tuple[int, float, float], width: int, x: float) -> tuple[int, float, float]:
    """The class ``p`` with its time (intercept and slope alike) multiplied by ``x``, at ``width``."""
    return (width, p[1] * x, p[2] * x)


def _qwen3_4b() -> CostCurve:
    # Table 1, Qwen3-4B Q4_K_M: flat to 8 rows (one 8-row fragment), then steps; 64 rows = 2 x 32.
    r8, r16, r32 = (8, 24.7, 1.28), (16, 36.7, 2.35), (32, 100.5, 4.03)
    return CostCurve("qwen3-4b-q4km", STEP, (_scaled(r8, 1, 0.9), r8, r16, r32, _scaled(r32, 64, 2.0)))


def _lfm_26b_q8() -> CostCurve:
    # Table 1, LFM2.5-2.6B Q8_0, plus the steps of section 3.2: 20-24 rows cost 1.40 x the 16-row
    # class, and the 48-row class is 4.3% cheaper than the 40-row one (the non-monotone inversion).
    r8, r16, r32 = (8, 23.9, 0.13), (16, 25.8, 0.20), (32, 43.7, 0.43)
    r40 = _scaled(r32, 40, 1.30)
    return CostCurve("lfm2.5-2.6b-q8", STEP, (
        _scaled(r8, 1, 0.85), r8, r16, _scaled(r16, 24, 1.40), r32, r40,
        _scaled(r40, 48, 1 - 0.043), _scaled(r32, 64, 1.6)))


def _lfm_moe() -> CostCurve:
    # Section 3.2, LFM2.5-8B-A1B: every row is routed to its own experts, so time rises with every
    # row: T(8) = 1.64 T(2), T(16) = 2.16 T(2); one context slope for all widths (Table 1, 16 rows).
    t2 = 14.4
    t16 = 2.16 * t2
    t32 = 2 * t16 * 0.95
    beta = 0.11
    pts = ((1, 0.8 * t2, beta), (2, t2, beta), (8, 1.64 * t2, beta), (16, t16, beta),
           (32, t32, beta), (64, 2 * t32, beta))
    return CostCurve("lfm2.5-8b-a1b-moe", LINEAR, pts)


CPU_WIDTHS = (1, 2, 4, 6, 8, 16, 32, 64)
CPU_CONTEXT = 200  # tokens of context of the measured table
# DESIGN.md, "Engine facts": verify ms by rows at 200 tokens of context, 2-core AVX-512 machine.
CPU_TABLE = {
    "cpu-smollm2-q4_1": (5.9, 12.6, 17.5, 24.7, 27.1, 46.3, 88.8, 163.8),
    "cpu-smollm2-q4_0": (4.7, 7.9, 10.3, 16.0, 14.5, 21.4, 39.2, 76.1),
    "cpu-smollm2-q8_0": (6.3, 15.5, 22.3, 27.9, 26.6, 32.7, 59.7, 100.0),
    "cpu-gemma3-270m-q4km": (10.5, 24.0, 33.9, 54.3, 42.2, 59.7, 102.5, 191.8),
}


def cpu_curve(name: str, ms_at_200: tuple[float, ...], widths: tuple[int, ...] = CPU_WIDTHS) -> CostCurve:
    """A measured CPU table made into a curve. The table has one context (200 tokens); the slope is
    set so that 1,500 tokens cost 1.5x the 200-token time for n >= 8 rows and 1.3x below (wide
    verifies attend more). With T(200) = m and T(1500) = f m: beta = (f - 1) m / 1.3 per 1k tokens
    and alpha = m - 0.2 beta."""
    pts = []
    for n, m in zip(widths, ms_at_200):
        f = 1.5 if n >= 8 else 1.3
        beta = (f - 1.0) * m / 1.3
        pts.append((n, m - beta * CPU_CONTEXT / 1e3, beta))
    return CostCurve(name, LINEAR, tuple(pts))


CURVES: dict[str, CostCurve] = {
    c.name: c
    for c in [_qwen3_4b(), _lfm_26b_q8(), _lfm_moe()]
    + [cpu_curve(name, ms) for name, ms in CPU_TABLE.items()]
}


# --- interference ------------------------------------------------------------------------------


class Interference:
    """One-sided verify noise (Proposition 3): observed = true * (1 + eps), eps = 0 with
    probability ``p_clean``, else exponential with mean ``noise_mean``. Never faster than true."""

    def __init__(self, p_clean: float = 0.7, noise_mean: float = 0.05, seed: int = 0):
        if not 0.0 <= p_clean <= 1.0 or noise_mean < 0:
            raise ValueError("p_clean must be in [0, 1] and noise_mean >= 0")
        self.p_clean = p_clean
        self.noise_mean = noise_mean
        self.rng = _rng("noise", seed)

    def draw(self) -> float:
        """One eps >= 0. Always consumes two draws so the stream does not depend on outcomes."""
        u, e = self.rng.random(), self.rng.expovariate(1.0)
        return 0.0 if u < self.p_clean or self.noise_mean == 0 else e * self.noise_mean


# --- the ground truth --------------------------------------------------------------------------


class SimText:
    """The target's greedy text: a seeded stream of token ids drawn uniformly from
    [TOKEN_LO, TOKEN_HI) without repeats.

    ``truth(pos)`` is the token at absolute position ``pos`` (0 is the first prompt token), so a
    prompt of ``truth(0 .. P-1)`` is continued by ``truth(P), truth(P+1), ...``. With ``eog_at``
    the token at that position is EOG instead. SENTINEL and EOG are never drawn.

    No token repeats, so the scheduler's n-gram source (paper 3.3) never finds an earlier
    occurrence and proposes nothing: the acceptance ground truth is exactly the drafter's, with
    the n-gram fill on or off."""

    def __init__(self, seed: int = 0, eog_at: int | None = None):
        self.seed = seed
        self.eog_at = eog_at
        self._rng = _rng("text", seed)
        self._toks: list[int] = []
        self._seen: set[int] = set()

    def truth(self, pos: int) -> int:
        if pos < 0:
            raise ValueError("positions start at 0")
        if pos == self.eog_at:
            return EOG
        while len(self._toks) <= pos:  # lazily extended, so a position's token never changes
            t = self._rng.randrange(TOKEN_LO, TOKEN_HI)
            if t not in self._seen:
                self._seen.add(t)
                self._toks.append(t)
        return self._toks[pos]

    def span(self, lo: int, hi: int) -> list[int]:
        """truth(lo .. hi-1)."""
        return [self.truth(p) for p in range(lo, hi)]


# --- the target -------------------------------------------------------------------------------


class SimTarget:
    """A Target (engine/base.py) whose greedy next token is ``text.truth`` and whose verify time
    follows ``curve`` with one-sided interference (paper 3.2).

    Row r's argmax is ``truth(n_past + depth[r] + 1)`` when every candidate on its path from the
    anchor is the true token at its position (the anchor sits at position ``n_past`` and is taken
    as committed, so correct), else SENTINEL. Verify advances ``clock`` by the observed time."""

    supports_trees = True
    supports_chains = True

    def __init__(self, curve: CostCurve, text: SimText, clock: VirtualClock, n_ctx: int = 65_536,
                 noise: Interference | None = None, n_vocab: int = TOKEN_HI):
        self.curve = curve
        self.text = text
        self.clock = clock
        self.noise = noise if noise is not None else Interference()
        self.n_ctx = n_ctx
        self.n_vocab = n_vocab
        self.n_past = 0  # committed tokens in the "cache" (all but the anchor)
        self.anchor: int | None = None
        self.last_true_ms = 0.0  # noise-free time of the last verify, for tests
        self.verifies = 0
        self._pending: Layout | None = None  # the last verify, until committed or discarded

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        raise NotImplementedError("a simulated target has no tokenizer; use SimText.span")

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        raise NotImplementedError("a simulated target has no chat template; use SimText.span")

    def piece(self, token: int) -> bytes:
        return f" {token}".encode()

    def is_eog(self, token: int) -> bool:
        return token == EOG

    def start(self, tokens: list[int]) -> None:
        if not tokens or len(tokens) >= self.n_ctx:
            raise ValueError("the prompt must be non-empty and leave room in the context")
        self.n_past = len(tokens) - 1
        self.anchor = tokens[-1]
        self._pending = None

    def room(self) -> int:
        return self.n_ctx - self.n_past - 1

    def verify(self, lay: Layout) -> Verified:
        # The invariants tests/fakes.py and the real engine check: row 0 is the anchor and the
        # tree's cells and positions fit the context.
        assert self.anchor is not None, "verify before start"
        assert lay.token[0] == self.anchor, "row 0 must be the anchor"
        assert self.n_past + lay.width <= self.n_ctx, "the verify's rows overflow the context"
        assert self.n_past + lay.max_depth < self.n_ctx, "a row's position is past the context"
        truth = self.text.truth
        ok = [True] * lay.width  # the row's path from the anchor is the truth
        argmax = []
        for r in range(lay.width):
            if r > 0:  # depth-first rows: the parent row precedes the row
                ok[r] = ok[lay.parent_row[r]] and lay.token[r] == truth(self.n_past + lay.depth[r])
            argmax.append(truth(self.n_past + lay.depth[r] + 1) if ok[r] else SENTINEL)
        # Time: the class of the width at the context the scheduler records (anchor included).
        true_ms = self.curve.true_ms(lay.width, self.n_past + 1)
        ms = true_ms * (1.0 + self.noise.draw())
        self.last_true_ms = true_ms
        self.verifies += 1
        self.clock.advance_ms(ms)
        self._pending = lay
        return Verified(argmax, ms, ms, 0.0)

    def commit(self, lay: Layout, keep_rows: list[int], next_anchor: int) -> float:
        assert lay is self._pending, "commit of a layout that was not the last verify"
        row = 0
        for r in keep_rows:  # keep_rows must be a path from the anchor
            assert lay.parent_row[r] == row, "kept rows are not a path from the anchor"
            row = r
        self.n_past += 1 + len(keep_rows)  # the anchor and the kept rows enter the cache
        self.anchor = next_anchor
        self._pending = None
        return 0.0

    def discard(self, lay: Layout) -> None:
        """Drop a verify's rows without committing anything (nothing is cached, so a no-op)."""
        self._pending = None


# --- the drafter ------------------------------------------------------------------------------


def sibling_shares(k: int) -> tuple[float, ...]:
    """r_k proportional to 1/k over the K-1 sibling slots, summing to 1."""
    w = [1.0 / j for j in range(1, k)]
    total = sum(w)
    return tuple(x / total for x in w)


@dataclass(frozen=True)
class DraftParams:
    """The drafter's acceptance ground truth (paper 2.2).

    Given its parent is right, the pick at depth i is right with probability ``accept[i-1]`` (the
    last value repeats for deeper positions); when the pick is wrong the true token is among the
    K-1 siblings with probability ``sibling_hit``, at slot k with probability ``shares[k-1]``."""

    block: int = 7  # B: positions per block
    k: int = 8  # K: candidates per position (the pick and K-1 siblings)
    accept: tuple[float, ...] = (0.8, 0.7, 0.65, 0.6, 0.55, 0.5, 0.45, 0.4, 0.35)
    sibling_hit: float = 0.5  # s
    shares: tuple[float, ...] | None = None  # r_k; None: proportional to 1/k

    def __post_init__(self) -> None:
        if self.block < 1 or self.k < 1:
            raise ValueError("block and k must be at least 1")
        if self.shares is None:
            object.__setattr__(self, "shares", sibling_shares(self.k))
        if len(self.shares) != self.k - 1 or any(x < 0 for x in self.shares) or sum(self.shares) > 1 + 1e-9:
            raise ValueError("shares must be K-1 non-negative values summing to at most 1")
        if not all(0.0 <= a <= 1.0 for a in self.accept) or not self.accept or not 0 <= self.sibling_hit <= 1:
            raise ValueError("probabilities must lie in [0, 1]")

    def a(self, depth: int) -> float:
        return self.accept[min(depth, len(self.accept)) - 1]


def tree_shape(params: DraftParams, depth_limit: int) -> list[Candidate]:
    """The candidates of one block with their features and no tokens (token 0), depth by depth:
    at each depth the pick, then its K-1 siblings (paper 2.2, Figure 1).

    The features make the head-based estimate (``tree.head_q``) the true conditional
    probability: pick.h = a_i, so q = a_i; sibling.sigma = a_i (the pick's share) and sibling.share
    = s r_k, so q = share (1 - sigma) = (1 - a_i) s r_k = P(sibling right | parent right)."""
    cands: list[Candidate] = []
    parent = ANCHOR
    for i in range(1, min(params.block, depth_limit) + 1):
        a = params.a(i)
        pick = child_of(cands, parent, 0, PICK, h=a, share=None)
        cands.append(pick)
        for r in params.shares:
            cands.append(child_of(cands, parent, 0, SIBLING, h=a, share=params.sibling_hit * r, sigma=a))
        parent = len(cands) - 1 - len(params.shares)  # the pick of this depth
    return cands


class SimDrafter:
    """A Proposer (candidates/base.py) proposing a DSpark-shaped block (paper 2.2) with known acceptance.

    Draws depend only on (seed, anchor position, depth), so arms decoding the same text see the
    same proposals at the same position (common random numbers), whatever their depth limit.
    The spine continues below a wrong pick (nothing there can be accepted). ``propose`` advances
    the clock by ``draft_ms``, the drafter's fixed cost D; with ``position_ms`` it is a draft
    model instead, drafting position by position while ``go_on`` says to (learn/depth.py), each
    position advancing the clock by ``position_ms`` (its forwards are ``last_draft``)."""

    name = "sim"

    def __init__(self, text: SimText, clock: VirtualClock, params: DraftParams | None = None,
                 draft_ms: float = 2.0, seed: int = 0, position_ms: float | None = None):
        self.text = text
        self.clock = clock
        self.params = params if params is not None else DraftParams()
        self.draft_ms = draft_ms
        self.position_ms = position_ms
        self.sequential = position_ms is not None  # drafts position by position (Generation)
        self.last_draft: dict | None = None
        self.seed = seed
        self.pos = -1  # absolute position of the anchor

    def begin(self, tokens: list[int]) -> None:
        self.pos = len(tokens) - 1

    def accept(self, committed: list[int], verified=(), accepted=()) -> None:
        self.pos += len(committed)

    def end(self, reply: list[int]) -> None:
        pass

    def propose(self, cands: list[Candidate], depth_limit: int, go_on=None) -> None:
        append_proposal(cands, self.block(depth_limit, go_on))

    def block(self, depth_limit: int, go_on=None) -> list[Candidate]:
        """This round's block, indexed from 0."""
        p = self.params
        if self.position_ms is None:
            self.clock.advance_ms(self.draft_ms)
        else:  # position by position, as far as go_on allows: the picks' h are their depths' a
            depth, hs, n = 0, [], min(p.block, depth_limit)
            while depth < n and (go_on is None or go_on(hs, n)):
                depth += 1
                hs.append(p.a(depth))
                self.clock.advance_ms(self.position_ms)
            self.last_draft = {"forwards": [self.position_ms] * depth, "rows": 1 if depth else 0, "limit": n}
            depth_limit = depth
        cands = tree_shape(p, depth_limit)
        per_depth = p.k  # candidates per depth: the pick, then its siblings
        for d0 in range(0, len(cands), per_depth):
            depth = d0 // per_depth + 1
            true = self.text.truth(self.pos + depth)
            rng = _rng("draft", self.seed, self.pos, depth)
            # Outcome: 0 = the pick is right, k = sibling slot k is right, None = none is.
            # Given a wrong pick, slot k is right with probability s r_k (cumulative walk, so
            # shares summing below 1 leave the rest to "no sibling is right").
            u, v = rng.random(), rng.random()
            right = 0 if u < p.a(depth) else None
            cum = 0.0
            for slot, r in enumerate(p.shares, start=1):
                cum += p.sibling_hit * r
                if right is None and v < cum:
                    right = slot
            used = {true}
            for slot in range(per_depth):
                if slot == right:
                    tok = true
                else:  # a wrong token: distinct from the truth and from its siblings
                    tok = rng.randrange(TOKEN_LO, TOKEN_HI)
                    while tok in used:
                        tok = rng.randrange(TOKEN_LO, TOKEN_HI)
                    used.add(tok)
                cands[d0 + slot].token = tok
        return cands


# --- exact long-run rates ----------------------------------------------------------------------


def expected_tokens(params: DraftParams, width: int) -> float:
    """Expected committed tokens per round at a pinned width: 1 (the bonus) + S(n), the sum of Q
    over the best-first prefix of n-1 candidates (Eq. 1, Proposition 1), with q the true
    conditional probabilities (which ``head_q`` reproduces) and the scheduler's order and ties."""
    cands = tree_shape(params, width - 1)
    for c in cands:
        c.q = head_q(c.to_dict(), 0.5)
    big_q = path_products(cands)
    order = best_first(big_q)
    return 1.0 + sum(big_q[j] for j in order[: width - 1])


def rows_verified(params: DraftParams, width: int) -> int:
    """Rows a pinned width actually verifies: every candidate when the block has fewer than
    width - 1 (round.RoundDecision.chosen), e.g. 57 for a 64-row pin with B = 7, K = 8."""
    return min(width, 1 + len(tree_shape(params, width - 1)))


def expected_rate(curve: CostCurve, params: DraftParams, width: int, context: int, draft_ms: float,
                  p_clean: float = 0.7, noise_mean: float = 0.05) -> float:
    """The exact long-run tokens per ms of a pinned width at a fixed context: expected tokens per
    round over expected time per round, draft_ms + T(rows, c) * E[1 + eps]. The drafter is charged
    at every width; the ``ar`` arm never calls it, so model ``ar`` with draft_ms = 0."""
    n = rows_verified(params, width)
    ms = draft_ms + curve.true_ms(n, context) * (1.0 + (1.0 - p_clean) * noise_mean)
    return expected_tokens(params, width) / ms


def best_pinned(curve: CostCurve, params: DraftParams, widths, context: int, draft_ms: float,
                p_clean: float = 0.7, noise_mean: float = 0.05) -> tuple[int, float]:
    """(width, tokens per ms) of the fastest pinned width among ``widths``, ties to the narrower."""
    rates = [(expected_rate(curve, params, n, context, draft_ms, p_clean, noise_mean), -n) for n in widths]
    rate, neg_n = max(rates)
    return -neg_n, rate


# --- everything at once -------------------------------------------------------------------------


def make_sim(curve_name: str, seed: int = 0, prompt_len: int = 200, n_ctx: int = 65_536,
             params: DraftParams | None = None, draft_ms: float = 2.0, p_clean: float = 0.7,
             noise_mean: float = 0.05, eog_at: int | None = None, curve: CostCurve | None = None,
             position_ms: float | None = None):
    """(target, drafter, clock, prompt tokens) for ``Generation(target, prompt, arm, max_tokens,
    clock=clock, drafter=drafter)``. SimText never repeats a token, so the n-gram fill finds
    nothing. ``curve`` overrides the preset ``curve_name``. The prompt is truth(0 .. prompt_len-1),
    so the reply should be truth(prompt_len ...). ``position_ms``: a draft model's cost a
    position (SimDrafter), instead of a block drafter's ``draft_ms``."""
    curve = curve if curve is not None else CURVES[curve_name]
    clock = VirtualClock()
    text = SimText(seed, eog_at=eog_at)
    target = SimTarget(curve, text, clock, n_ctx=n_ctx, noise=Interference(p_clean, noise_mean, seed))
    drafter = SimDrafter(text, clock, params, draft_ms=draft_ms, seed=seed, position_ms=position_ms)
    return target, drafter, clock, text.span(0, prompt_len)
