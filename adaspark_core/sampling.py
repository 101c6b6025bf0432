"""Sampling that speculation cannot change (issue 17, first part).

A sampled request's token at position ``pos`` is drawn from the target's distribution at that
position (top-k, then top-p, then min-p, then temperature, in the order of llama.cpp's sampler
chain) by the Gumbel-max trick: the kept token with the largest ``logit / T + g``, where ``g`` is
Gumbel noise keyed by (seed, position, token id) alone. So the token a verify row yields is a
function of the row's logits and its position, never of the tree around it: a candidate is
accepted iff it equals its parent row's draw, and a speculative decode emits exactly the tokens a
one-row-per-round decode with the same seed emits. Where kernels of other shapes give slightly
other logits, a draw can differ only where the two best perturbed scores nearly tie: the greedy
near-tie rule (paper 3.5) applied to the perturbed scores. (Inverse-CDF sampling was tried first:
it splits wherever any two tokens swap rank, far more often.) For deterministic proposals
(n-gram nodes, top-K picks) this accepts each child x of an accepted parent with probability
p(x), as recursive rejection sampling with q = 1 on the proposed token does, and the output
distribution is the target's own.

Everything here is pure numpy; the scheduler draws from its verify rows (scheduler.Draws).
"""

from __future__ import annotations

import functools
import math

import numpy as np

from .engine.base import Sampling

_MASK = (1 << 64) - 1
_PREFILTER = 1024  # top-p looks at the most likely tokens first; the whole vocabulary only if they fall short


def _mix_int(z: int) -> int:
    """splitmix64 (increment and finaliser) on one Python int."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _fmix32(z: np.ndarray) -> np.ndarray:
    """murmur3's 32-bit finaliser, elementwise on uint32 (wrapping arithmetic). 32-bit lanes: a
    64-bit multiply has no AVX2 instruction, and numpy's uint64 path made the noise of a whole
    vocabulary cost 0.55 ms."""
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
    costs 0.4 ms a row here; the k largest lie within a few logits of the maximum, so they are
    partitioned out of the tokens above a threshold that widens until at least k pass it
    (every token not above it is below all that are: the k largest are among them)."""
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


def distribution(logits: np.ndarray, s: Sampling) -> tuple[np.ndarray, np.ndarray]:
    """(the kept token ids, their probabilities): the distribution a draw follows."""
    ids = kept(logits, s)
    return ids, _softmax(np.asarray(logits, dtype=np.float64)[ids] / s.temperature)


def scores(logits: np.ndarray, s: Sampling, seed: int, pos: int) -> tuple[np.ndarray, np.ndarray]:
    """(kept ids, their perturbed scores logit / T + Gumbel noise): the draw is the best."""
    ids = kept(logits, s)
    return ids, np.asarray(logits, dtype=np.float64)[ids] / s.temperature + gumbel(seed, pos, ids)


def draw(logits: np.ndarray, s: Sampling, seed: int, pos: int) -> int:
    """The token at position ``pos``: the best perturbed score among the tokens the chain keeps.

    With top-k the kept set is small and is built (``scores``). Without it, building the top-p
    set would sort the vocabulary (2 ms a row here); instead the perturbed scores of every token
    are ranked and the first one the chain keeps wins, each checked on its own: min-p against the
    top logit, top-p by the mass of the tokens ranked before it (llama.cpp's order: higher logit,
    then lower id) being under p. The first or second is nearly always kept."""
    if 0 < s.top_k < len(logits):
        ids, sc = scores(logits, s, seed, pos)
        return int(ids[int(np.argmax(sc))])
    x = np.asarray(logits, dtype=np.float64)
    sc = x / s.temperature + gumbel_all(seed, pos, len(x))
    top = x.max()
    floor = top + math.log(s.min_p) if s.min_p > 0.0 else -math.inf
    e = np.exp(x - top) if s.top_p < 1.0 else None
    total = e.sum() if e is not None else 0.0
    while True:
        t = int(np.argmax(sc))
        kept = x[t] >= floor
        if kept and e is not None:
            before = e[x > x[t]].sum() + e[:t][x[:t] == x[t]].sum()
            kept = before / total < s.top_p
        if kept:
            return t
        sc[t] = -np.inf


# --- a request's sampling fields (serve-stdin and serve) ---------------------------------------------

FIELDS = ("temperature", "top_p", "top_k", "min_p", "seed")


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
    top_k, seed = body.get("top_k"), body.get("seed")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise FieldError("top_k", "top_k must be an integer of at least 0 (0: off)")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise FieldError("seed", "seed must be an integer")
    if temperature == 0.0:
        return None
    return Sampling(temperature, top_p, top_k or 0, min_p, seed)

