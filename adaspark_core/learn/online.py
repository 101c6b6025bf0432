"""Online solvers shared by the learners: FTRL-Proximal and decayed averages.

FTRL-Proximal is McMahan et al. (2013), per coordinate, with the paper's additions (Table 14):
the accumulated squared gradient is capped (a floor on the learning rate, so a law can follow a
machine that drifts), coordinates can be bounded below (non-negative context coefficients), and
the L1 threshold can grow with the gradients' own noise (the acceptance model's gate). One class
serves the cost model's laws (dense coordinates) and the acceptance model (named ones).
"""

from __future__ import annotations

import math
from operator import mul

from adaspark_core.base.checks import count, fields, mapping, number, numbers


class FTRL:
    """Per-coordinate FTRL-Proximal on the deviation from a prior, with an optional gate.

    Two shapes of coordinates, one update:

    - dense (``dim=N``): coordinates 0..N-1 of a linear model w . x, read by ``weights`` and
      ``predict``, stepped by ``update_linear``; stored as lists. The cost model's context laws.
    - named (``dim=None``): coordinates created on first use (a new n-gram bucket is just a new
      key), each counting its updates in ``m``; stored as objects. The acceptance model's
      coefficients and buckets (paper 3.3, Table 14).

    ``alpha``, ``beta``: learning rate and stabiliser; ``l1``, ``l2``: penalties; ``n_cap``: cap on
    each coordinate's accumulated squared gradient; ``lower``: per-coordinate lower bounds (None or
    absent for unbounded), applied by projection when a weight is read; ``center``: the prior the
    penalties pull toward (0 where absent), so FTRL runs on the deviation from it.

    ``gate``: a coordinate leaves its prior only once its accumulated gradient exceeds
    ``l1 + gate * sqrt(v)``, v the uncapped sum of its squared gradients (None: the plain L1
    threshold). The threshold grows like the noise of a sum of m gradients, so a coordinate whose
    gradients are noise around zero stays at the prior and one with a consistent sign leaves it,
    continuously (soft threshold, no jump). The paper states the gate as 3 sqrt(m) after m updates,
    which is this test for gradients of unit size. Log-loss gradients of a node are |q - y| <= 1
    and typically well under 1, so the literal form is a test of many sigma that holds even a
    mispriced bucket at its prior (ARCHITECTURE.md, section 5). Measuring the noise by the
    gradients themselves keeps the 3-sigma meaning at any gradient scale.
    """

    def __init__(self, dim: int | None = None, alpha: float = 0.05, beta: float = 1.0, l1: float = 0.0,
                 l2: float = 0.0, n_cap: float = 400.0, lower: list | dict | None = None,
                 center: list | dict | None = None, gate: float | None = None):
        self.dim = dim
        self.alpha, self.beta, self.l1, self.l2, self.n_cap, self.gate = alpha, beta, l1, l2, n_cap, gate
        # Coordinates are always keys (dense: the indices), so one ``weight`` serves both shapes.
        self.center = _keyed(center)
        self.lower = {k: lo for k, lo in _keyed(lower).items() if lo is not None}
        zeros = {} if dim is None else dict.fromkeys(range(dim), 0.0)
        self.z = dict(zeros)
        self.n = dict(zeros)  # squared gradients, capped: the FTRL rate
        self.v = None if gate is None else dict(zeros)  # squared gradients, uncapped: the gate's noise scale
        # updates of each named coordinate (labels, for the acceptance model's exploration)
        self.m: dict | None = {} if dim is None else None
        self._w: dict = {}  # weights of coordinates not updated since, read lazily
        self._dense: list[float] | None = None  # weights() as a list, for predict

    def weight(self, key) -> float:
        # The hot path of the acceptance model's estimates: a cached weight is one dict lookup.
        w = self._w.get(key)
        if w is None:
            self._resolve((key,))
            w = self._w[key]
        return w

    def weights(self) -> list[float]:
        """The dense weights, in index order."""
        if self._dense is None:
            cached = self._w
            missing = [i for i in range(self.dim) if i not in cached]
            if missing:  # the coordinates the last step touched
                self._resolve(missing)
            self._dense = [cached[i] for i in range(self.dim)]
        return self._dense

    def _resolve(self, keys) -> None:
        """Compute and cache the weights of ``keys``: the closed form of FTRL-Proximal, the
        threshold l1 (+ gate sqrt(v)), then the lower bound. One loop for many keys: the cost laws
        re-read every coordinate after each step, thousands of times a replay."""
        center, zs, ns, v, lower, cache = self.center, self.z, self.n, self.v, self.lower, self._w
        l1, gate, alpha, beta, l2 = self.l1, self.gate, self.alpha, self.beta, self.l2
        for key in keys:
            w = center.get(key, 0.0)
            z = zs.get(key, 0.0)
            t = l1 if gate is None else l1 + gate * math.sqrt(v.get(key, 0.0))
            if abs(z) > t:
                w -= (z - math.copysign(t, z)) / ((beta + math.sqrt(ns[key])) / alpha + l2)
            lo = lower.get(key)
            if lo is not None and w < lo:
                w = lo
            cache[key] = w

    def predict(self, x: list[float]) -> float:
        return sum(map(mul, self.weights(), x))

    def update_linear(self, x: list[float], dloss_dpred: float) -> None:
        """One step of the dense linear model on a loss whose derivative with respect to the
        prediction is ``dloss_dpred``; a coordinate with x_i = 0 has no gradient and is not stepped."""
        self.update({i: dloss_dpred * xi for i, xi in enumerate(x) if xi != 0.0})

    def update(self, grads: dict) -> None:
        """One step: ``grads`` maps each touched coordinate to its loss gradient."""
        z, n, v, m, center = self.z, self.n, self.v, self.m, self.center
        # Every weight as it stood before this step (each key is stepped once); dense: the list.
        weight = self.weight if m is not None else self.weights().__getitem__
        for key, g in grads.items():
            d = weight(key) - center.get(key, 0.0)
            n_old = n.get(key, 0.0)
            n_new = min(n_old + g * g, self.n_cap)
            sigma = (math.sqrt(n_new) - math.sqrt(n_old)) / self.alpha
            # Dense sums z + (g - sigma d), named (z + g) - sigma d: the orders of the two classes
            # this one replaced (FTRL, GatedFTRL), kept so that the laws and the acceptance weights,
            # and so stores and replays of logged rounds, stay bit for bit what they were.
            if m is None:
                z[key] += g - sigma * d  # a KeyError outside 0..dim-1
            else:
                z[key] = z.get(key, 0.0) + g - sigma * d
                m[key] = m.get(key, 0) + 1
            n[key] = n_new
            if v is not None:
                v[key] = v.get(key, 0.0) + g * g
            self._w.pop(key, None)
        self._dense = None

    def quantile_steps(self, samples: list[tuple[list[float], float]], tau: float) -> None:
        """Dense only: for each ``(x, y)`` in order, one step on the pinball loss at quantile
        ``tau``, exactly ``update_linear(x, (1.0 if y < predict(x) else 0.0) - tau)``, bit for
        bit, in one loop over plain lists instead of a predict, a resolve and an update through
        dicts per sample. A law's refit is 256 such steps and runs when a reply ends, before the
        reply's last chunk goes out and, batched, while every other request in the batch waits
        (a reply's refits took 4.6 ms so, 1.9 ms this way, on the default model: ARCHITECTURE.md,
        section 5)."""
        dim = self.dim
        keys = range(dim)
        z, n = [self.z[i] for i in keys], [self.n[i] for i in keys]
        v = None if self.v is None else [self.v[i] for i in keys]
        center = [self.center.get(i, 0.0) for i in keys]
        lower = [self.lower.get(i) for i in keys]
        alpha, beta, l1, l2, cap, gate = self.alpha, self.beta, self.l1, self.l2, self.n_cap, self.gate
        w = list(self.weights())
        sqrt, copysign = math.sqrt, math.copysign
        for x, y in samples:
            g0 = (1.0 if y < sum(map(mul, w, x)) else 0.0) - tau
            for i in keys:
                xi = x[i]
                if xi == 0.0:  # no gradient: not stepped (update_linear)
                    continue
                g = g0 * xi
                # update(): the step from the weight before it
                d = w[i] - center[i]
                n_old = n[i]
                n_new = min(n_old + g * g, cap)
                sigma = (sqrt(n_new) - sqrt(n_old)) / alpha
                z[i] += g - sigma * d
                n[i] = n_new
                if v is not None:
                    v[i] += g * g
                # _resolve(): the stepped coordinate's weight, read by the next sample
                wi, zi = center[i], z[i]
                t = l1 if gate is None else l1 + gate * sqrt(v[i])
                if abs(zi) > t:
                    wi -= (zi - copysign(t, zi)) / ((beta + sqrt(n[i])) / alpha + l2)
                lo = lower[i]
                if lo is not None and wi < lo:
                    wi = lo
                w[i] = wi
        self.z, self.n = dict(enumerate(z)), dict(enumerate(n))
        if v is not None:
            self.v = dict(enumerate(v))
        self._w, self._dense = dict(enumerate(w)), None

    def _fields(self) -> tuple[str, ...]:
        return ("z", "n") + (("v",) if self.v is not None else ()) + (("m",) if self.m is not None else ())

    def state(self) -> dict:
        """Dense: {"z": [...], "n": [...]} by index; named: {"z": {...}, "n": {...}, "v": {...},
        "m": {...}} by key (v only with a gate, in either shape)."""
        if self.dim is None:
            return {f: dict(getattr(self, f)) for f in self._fields()}
        return {f: [getattr(self, f)[i] for i in range(self.dim)] for f in self._fields()}

    def load(self, state: dict, path: str = "ftrl") -> "FTRL":
        """Restore a ``state()``, checked (checks.py), and only if all of it passes. Dense: one
        entry per coordinate (a shorter vector fails at the next update). Named: an update sets
        every entry of its coordinate, so z, n, v and m have the same keys (``weight`` reads n of
        every key of z), and m counts the coordinate's updates, >= 1 since it exists. n is the
        capped sum of squared gradients, in [0, n_cap], v the uncapped one, >= 0."""
        names = self._fields()
        fields(state, path, names)
        gated = self.v is not None
        if self.dim is None:
            keys = set(mapping(state["z"], f"{path}.z"))
            for name in names[1:]:
                other = set(mapping(state[name], f"{path}.{name}"))
                if other != keys:
                    k = min(other ^ keys)
                    raise ValueError(f"{path}.{name if k in other else 'z'} has the coordinate {k!r}, "
                                     f"{path}.{'z' if k in other else name} has not")
            z = {k: number(x, f"{path}.z.{k}") for k, x in state["z"].items()}
            n = {k: number(x, f"{path}.n.{k}", 0.0, self.n_cap) for k, x in state["n"].items()}
            v = {k: number(x, f"{path}.v.{k}", 0.0) for k, x in state["v"].items()} if gated else None
            m = {k: count(x, f"{path}.m.{k}", 1) for k, x in state["m"].items()}
        else:
            dim = self.dim
            z = dict(enumerate(numbers(state["z"], f"{path}.z", length=dim)))
            n = dict(enumerate(numbers(state["n"], f"{path}.n", 0.0, self.n_cap, length=dim)))
            v = dict(enumerate(numbers(state["v"], f"{path}.v", 0.0, length=dim))) if gated else None
            m = None
        self.z, self.n, self.v, self.m = z, n, v, m
        self._w, self._dense = {}, None
        return self


def _keyed(values: list | dict | None) -> dict:
    """Per-coordinate values by key: a list's by index."""
    if values is None:
        return {}
    return dict(enumerate(values)) if isinstance(values, list) else dict(values)


class Decayed:
    """Exponentially decayed sums with a half-life in updates: a running total of ``x`` and ``y``
    whose ratio is a recency-weighted rate (the chooser's band rate rho: tokens over time)."""

    def __init__(self, half_life: float):
        self.decay = 0.5 ** (1.0 / half_life)
        self.x = 0.0
        self.y = 0.0
        self.count = 0

    def add(self, x: float, y: float) -> None:
        self.x = self.x * self.decay + x
        self.y = self.y * self.decay + y
        self.count += 1

    @property
    def ratio(self) -> float:
        return self.x / self.y if self.y > 0 else 0.0

    def state(self) -> dict:
        return {"x": self.x, "y": self.y, "count": self.count}

    def load(self, state: dict, path: str = "decayed") -> "Decayed":
        """Restore a ``state()``, checked: x and y are decayed sums of non-negative steps (tokens
        and ms, node losses and nodes), so >= 0; count counts updates."""
        fields(state, path, ("x", "y", "count"))
        self.x, self.y = number(state["x"], f"{path}.x", 0.0), number(state["y"], f"{path}.y", 0.0)
        self.count = count(state["count"], f"{path}.count")
        return self


class AdaGradScalar:
    """One AdaGrad-adapted scalar kept in a band: the acceptance model's per-request intercept and
    the head-based estimate's per-request offset (paper 3.3, Table 14). ``cap`` caps the
    accumulated squared gradient (a floor on the step size)."""

    def __init__(self, rate: float, band: float, cap: float = math.inf):
        self.rate, self.band, self.cap = rate, band, cap
        self.value = 0.0
        self.g2 = 0.0

    def reset(self) -> None:
        self.value, self.g2 = 0.0, 0.0

    def update(self, g: float) -> None:
        if g == 0.0:
            return
        self.g2 = min(self.g2 + g * g, self.cap)
        self.value = min(max(self.value - self.rate * g / math.sqrt(self.g2), -self.band), self.band)
