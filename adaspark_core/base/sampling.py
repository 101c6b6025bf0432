"""Sampling that speculation cannot change.

A sampled request's token at position ``pos`` is drawn from the target's distribution at that
position (top-k, then top-p, then min-p, then temperature, in the order of llama.cpp's sampler
chain) by the Gumbel-max trick: the kept token with the largest ``logit / T + g``, where ``g`` is
Gumbel noise keyed by (seed, position, token id) alone. So the token a verify row yields is a
function of the row's logits and its position, never of the tree around it: a candidate is
accepted iff it equals its parent row's draw, and a speculative decode emits exactly the tokens a
one-row-per-round decode with the same seed emits. Where kernels of other shapes give slightly
other logits, a draw can differ only where the two best perturbed scores nearly tie: the greedy
near-tie rule (paper 3.5) applied to the perturbed scores. (Inverse-CDF sampling would split
wherever any two tokens swap rank, far more often: ARCHITECTURE.md, section 5.) For deterministic
proposals (n-gram nodes, top-K picks) this accepts each child x of an accepted parent with
probability p(x), as recursive rejection sampling with q = 1 on the proposed token does, and the
output distribution is the target's own.

Everything here is pure numpy; the scheduler draws from its verify rows (round.Draws).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

_MASK = (1 << 64) - 1
_PREFILTER = 1024  # top-p looks at the most likely tokens first; the whole vocabulary only if they fall short



@dataclass(frozen=True, slots=True)
class Sampling:
    """A sampled request's settings, applied in the order of llama.cpp's sampler chain: top-k,
    top-p, min-p, then temperature, then a draw keyed by ``seed`` (None: a random seed) and the
    position (``draw`` below)."""

    temperature: float
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None

    def describe(self) -> str:
        parts = [f"temperature {self.temperature:g}"]
        if self.top_k:
            parts.append(f"top_k {self.top_k}")
        if self.top_p < 1:
            parts.append(f"top_p {self.top_p:g}")
        if self.min_p > 0:
            parts.append(f"min_p {self.min_p:g}")
        return ", ".join(parts)


def _mix_int(z: int) -> int:
    """splitmix64 (increment and finaliser) on one Python int."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _fmix32(z: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser, elementwise on uint32 (wrapping arithmetic). 32-bit lanes: a
    64-bit multiply has no AVX2 instruction, so numpy's uint64 path is slow (ARCHITECTURE.md,
    section 5)."""
    z = z ^ (z >> np.uint32(16))
    z = z * np.uint32(0x85EBCA6B)
    z = z ^ (z >> np.uint32(13))
    z = z * np.uint32(0xC2B2AE35)
    return z ^ (z >> np.uint32(16))


@functools.lru_cache(maxsize=4)
def _vocab_keys(n: int) -> np.ndarray:
    """Every token id's own 32-bit key (``_token_keys`` of 0 .. n - 1), computed once per vocabulary."""
    keys = _token_keys(np.arange(n, dtype=np.uint64))
    keys.flags.writeable = False
    return keys


def _token_keys(ids: np.ndarray) -> np.ndarray:
    """Each token id's own 32-bit key: one splitmix64 multiply of the id, folded to 32 bits."""
    z = (np.asarray(ids, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)) * np.uint64(0xBF58476D1CE4E5B9)
    return (z >> np.uint64(32)).astype(np.uint32) ^ _fmix32(z.astype(np.uint32))


def _noise(keys: np.ndarray, seed: int, pos: int) -> np.ndarray:
    # the position's key, mixed first (no linear relation between positions' keys), in two halves
    # for two rounds, so no two positions' noise is a permuted copy of the other's
    k = _mix_int((_mix_int(seed & _MASK) + pos) & _MASK)
    z = _fmix32(_fmix32(keys ^ np.uint32(k & 0xFFFFFFFF)) ^ np.uint32(k >> 32))
    u = (z.astype(np.float64) + 0.5) * (1.0 / 4294967296.0)  # in (0, 1)
    return -np.log(-np.log(u))


def gumbel(seed: int, pos: int, ids: np.ndarray) -> np.ndarray:
    """Standard Gumbel noise for tokens ``ids`` at position ``pos`` of a request seeded ``seed``:
    a counter-based hash of (seed, position, token), so any row at that position draws the same."""
    return _noise(_token_keys(ids), seed, pos)


def gumbel_all(seed: int, pos: int, n: int) -> np.ndarray:
    """``gumbel`` of every token id 0 .. n - 1 (the token keys cached per vocabulary)."""
    return _noise(_vocab_keys(n), seed, pos)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _top(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest of ``x`` (any order). A partition of the whole vocabulary
    is slow per row (ARCHITECTURE.md, section 5); the k largest lie within a few logits of the
    maximum, so they are partitioned out of the tokens above a threshold that widens until at
    least k pass it (every token not above it is below all that are: the k largest are among
    them)."""
    n = len(x)
    top, gap = x.max(), 2.0
    while True:
        ids = np.flatnonzero(x >= top - gap)
        if len(ids) >= k:
            break
        if gap > 1e4:  # fewer than k finite logits: no threshold reaches the -inf ones
            return np.argpartition(x, n - k)[n - k :]
        gap *= 1.5  # a threshold a little past the k-th: few more ids to partition
    if len(ids) == k:
        return ids
    return ids[np.argpartition(x[ids], len(ids) - k)[len(ids) - k :]]


def kept(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """The token ids the chain keeps (top-k, top-p over what is left, min-p), by decreasing logit
    when anything is cut, else every id in order."""
    x = np.asarray(logits, dtype=np.float64)
    n = len(x)
    if s.top_k <= 0 and s.top_p >= 1.0 and s.min_p <= 0.0:
        return np.arange(n)
    if 0 < s.top_k < n:
        ids = _top(x, s.top_k)
    elif s.top_p < 1.0 and n > _PREFILTER:
        ids = _top(x, _PREFILTER)
    else:
        ids = np.arange(n)
    ids = ids[np.argsort(-x[ids], kind="stable")]
    if s.top_p < 1.0:
        # llama.cpp's top-p: the softmax of the candidates left so far; keep the shortest prefix
        # whose mass reaches p (at least one token)
        if 0 < s.top_k < n:
            p = _softmax(x[ids])
        else:
            p = np.exp(x[ids] - x[ids[0]]) / np.exp(x - x[ids[0]]).sum()  # over the whole vocabulary
        cum = np.cumsum(p)
        if cum[-1] < s.top_p and len(ids) < n:  # the prefilter fell short: sort everything
            ids = np.argsort(-x, kind="stable")
            cum = np.cumsum(_softmax(x[ids]))
        ids = ids[: int(np.searchsorted(cum, s.top_p, side="left")) + 1]
    if s.min_p > 0.0:
        ids = ids[x[ids] >= x[ids[0]] + math.log(s.min_p)]
    return ids


def _scaled(x: np.ndarray, temperature: float) -> np.ndarray:
    """``x / T`` up to a constant: ``(x - max) / T``, which stays finite at the top however small T
    is (``x / 1e-300`` is inf for every positive logit, and the draw would take the first of them)."""
    with np.errstate(over="ignore"):  # far tokens go to -inf at a tiny T: right, and no warning
        return (x - x.max()) / temperature


def distribution(logits: np.ndarray, s: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """(the kept token ids, their probabilities): the distribution a draw follows."""
    ids = kept(logits, s)
    return ids, _softmax(_scaled(np.asarray(logits, dtype=np.float64)[ids], s.temperature))


def scores(logits: np.ndarray, s: Sampling, seed: int, pos: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept ids, their perturbed scores logit / T + Gumbel noise, less a constant): the draw is
    the best."""
    ids = kept(logits, s)
    return ids, _scaled(np.asarray(logits, dtype=np.float64)[ids], s.temperature) + gumbel(seed, pos, ids)


def draw(logits: np.ndarray, s: Sampling, seed: int, pos: int) -> int:
    """The token at position ``pos``: the best perturbed score among the tokens the chain keeps.

    With top-k the kept set is small and is built (``scores``). Without it, building the top-p
    set would sort the vocabulary (slow per row: ARCHITECTURE.md, section 5); instead the
    perturbed scores of every token are ranked and the first one the chain keeps wins. Min-p
    refuses every token under its floor at once. Top-p keeps a token iff the mass of the tokens
    before it (llama.cpp's order: higher logit, then lower id) is under p, and always the first
    (llama.cpp's ``min_keep``: at top_p 0 the draw is greedy); a token it refuses refuses every
    less likely one with it, so the loop ends within a few turns however small p is."""
    if 0 < s.top_k < len(logits):
        ids, sc = scores(logits, s, seed, pos)
        return int(ids[int(np.argmax(sc))])
    x = np.asarray(logits, dtype=np.float64)
    sc = _scaled(x, s.temperature) + gumbel_all(seed, pos, len(x))
    top = x.max()
    if s.min_p > 0.0:
        sc[x < top + math.log(s.min_p)] = -np.inf
    if s.top_p >= 1.0:
        return int(np.argmax(sc))
    e = np.exp(x - top)
    total = e.sum()
    for _ in range(len(x)):
        t = int(np.argmax(sc))
        if sc[t] == -np.inf:
            break  # nothing left: NaN logits (NaN compares false everywhere)
        before = e[x > x[t]].sum() + e[:t][x[:t] == x[t]].sum()
        if before == 0.0 or before / total < s.top_p:
            return t
        sc[t] = -np.inf
        sc[x < x[t]] = -np.inf
    return int(np.argmax(x))  # a token, not a hang


# --- a request's sampling fields (serve-stdin and serve) ---------------------------------------------

FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")
# What a round record (JSON: 64-bit integers) can hold: a seed is any signed or unsigned 64-bit
# integer; a top-k past the vocabulary keeps everything, and past 2^31 it is not a count.
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)
TOP_K_MAX = (1 << 31) - 1


class FieldError(ValueError):
    """A sampling field with a wrong value; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _number(body: dict, name: str, lo: float, hi: float, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not lo <= v <= hi:
        raise FieldError(name, f"{name} must be a number from {lo:g} to {hi:g}")
    return float(v)


def from_fields(body: dict, default_temperature: float = 0.0) -> Sampling | None:
    """The sampling a request's fields ask for (``FIELDS``; unset or null: the default), None for
    greedy decoding (temperature 0: the other settings change nothing, the seed seeds nothing);
    FieldError naming the first wrong field."""
    temperature = _number(body, "temperature", 0.0, 2.0, default_temperature)
    top_p = _number(body, "top_p", 0.0, 1.0, 1.0)
    min_p = _number(body, "min_p", 0.0, 1.0, 0.0)
    top_k = _integer(body, "top_k", 0, TOP_K_MAX, "(0: off)")
    seed = _integer(body, "seed", *SEED_RANGE)
    if temperature == 0.0:
        return None
    return Sampling(temperature, top_p, top_k or 0, min_p, seed)


def _integer(body: dict, name: str, lo: int, hi: int, note: str = "") -> int | None:
    v = body.get(name)
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi):
        raise FieldError(name, f"{name} must be an integer from {lo} to {hi}" + (f" {note}" if note else ""))
    return v
