"""Online solvers shared by the learners: FTRL-Proximal and decayed averages.

FTRL-Proximal is McMahan et al. (2013), per coordinate, with the paper's two additions (Table 14):
the accumulated squared gradient is capped (a floor on the learning rate, so a law can follow a
machine that drifts) and coordinates can be bounded below (non-negative context coefficients).
"""

from __future__ import annotations

import math
from operator import mul

from .checks import count, fields, mapping, number, numbers


class FTRL:
    """Per-coordinate FTRL-Proximal on a linear model w . x.

    ``alpha``, ``beta``: learning rate and stabiliser; ``l1``, ``l2``: penalties; ``n_cap``: cap on
    each coordinate's accumulated squared gradient; ``lower``: per-coordinate lower bounds (None
    for unbounded), applied by projection when the weights are read.
    """

    def __init__(self, dim: int, alpha: float = 0.05, beta: float = 1.0, l1: float = 0.0, l2: float = 0.0,
                 n_cap: float = 400.0, lower: list[float | None] | None = None, center: list[float] | None = None):
        self.alpha, self.beta, self.l1, self.l2, self.n_cap = alpha, beta, l1, l2, n_cap
        self.lower = list(lower) if lower is not None else [None] * dim
        # The penalties pull toward ``center`` (a prior), not toward zero: FTRL runs on the
        # deviation from it.
        self.center = list(center) if center is not None else [0.0] * dim
        self.z = [0.0] * dim
        self.n = [0.0] * dim
        self._w: list[float] | None = None

    def weights(self) -> list[float]:
        if self._w is None:
            w = []
            for z, n, lo, c in zip(self.z, self.n, self.lower, self.center):
                wi = c
                if abs(z) > self.l1:
                    wi -= (z - math.copysign(self.l1, z)) / ((self.beta + math.sqrt(n)) / self.alpha + self.l2)
                if lo is not None and wi < lo:
                    wi = lo
                w.append(wi)
            self._w = w
        return self._w

    def predict(self, x: list[float]) -> float:
        return sum(map(mul, self.weights(), x))

    def update(self, x: list[float], dloss_dpred: float) -> None:
        """One step on a loss whose derivative with respect to the prediction is ``dloss_dpred``."""
        w = self.weights()
        for i, xi in enumerate(x):
            if xi == 0.0:
                continue
            g = dloss_dpred * xi
            n_old = self.n[i]
            n_new = min(n_old + g * g, self.n_cap)
            sigma = (math.sqrt(n_new) - math.sqrt(n_old)) / self.alpha
            self.z[i] += g - sigma * (w[i] - self.center[i])
            self.n[i] = n_new
        self._w = None

    def state(self) -> dict:
        return {"z": list(self.z), "n": list(self.n)}

    def load(self, state: dict, path: str = "ftrl") -> "FTRL":
        """Restore a ``state()``, checked (checks.py): one z and one n per coordinate (a shorter
        vector fails at the next update), n an accumulated squared gradient, so in [0, n_cap]."""
        fields(state, path, ("z", "n"))
        dim = len(self.z)
        z = numbers(state["z"], f"{path}.z", length=dim)
        n = numbers(state["n"], f"{path}.n", 0.0, self.n_cap, length=dim)
        self.z, self.n, self._w = z, n, None
        return self


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


class GatedFTRL:
    """Per-coordinate FTRL-Proximal over named coordinates, on the deviation from a prior.

    The acceptance model's solver (paper 3.3, Table 14). Coordinates are created on first use (a
    new n-gram bucket is just a new key) and start at their prior ``center`` (0 if absent). A
    coordinate leaves its prior only once its accumulated gradient exceeds ``gate`` times the
    square root of its accumulated squared gradient: the L1 threshold of FTRL-Proximal grows like
    the noise of a sum of m gradients, so a coordinate whose gradients are noise around zero stays
    at the prior and one with a consistent sign leaves it, continuously (soft threshold, no jump).

    The paper states the gate as 3 sqrt(m) after m updates, which is this test for gradients of
    unit size. Log-loss gradients of a node are |q - y| <= 1 and typically 0.3-0.5, so the literal
    form is a 6-10 sigma test: on a real run of the default model (16 ConvFinQA replies, ~2,000
    labels) it held every n-gram bucket at its prior, the deepest copy bucket at 154 labels with a
    gradient sum of -26 against a gate of 37, while those nodes were accepted 0.8 of the time
    against 0.65 predicted. Measuring the noise by the gradients themselves keeps the 3-sigma
    meaning at any gradient scale.
    """

    def __init__(self, alpha: float, beta: float = 1.0, l2: float = 0.01, n_cap: float = 400.0,
                 gate: float = 3.0, center: dict[str, float] | None = None):
        self.alpha, self.beta, self.l2, self.n_cap, self.gate = alpha, beta, l2, n_cap, gate
        self.center = dict(center or {})
        self.z: dict[str, float] = {}
        self.n: dict[str, float] = {}  # squared gradients, capped: the FTRL rate
        self.v: dict[str, float] = {}  # squared gradients, uncapped: the gate's noise scale
        self.m: dict[str, int] = {}  # updates (labels, for the acceptance model's exploration)
        self._w: dict[str, float] = {}  # weights of coordinates updated since, read lazily

    def weight(self, key: str) -> float:
        w = self._w.get(key)
        if w is None:
            w = self.center.get(key, 0.0)
            z = self.z.get(key, 0.0)
            threshold = self.gate * math.sqrt(self.v.get(key, 0.0))
            if abs(z) > threshold:
                w -= (z - math.copysign(threshold, z)) / ((self.beta + math.sqrt(self.n[key])) / self.alpha + self.l2)
            self._w[key] = w
        return w

    def update(self, grads: dict[str, float]) -> None:
        """One step: ``grads`` maps each touched coordinate to its loss gradient."""
        for key, g in grads.items():
            w = self.weight(key)
            n_old = self.n.get(key, 0.0)
            n_new = min(n_old + g * g, self.n_cap)
            sigma = (math.sqrt(n_new) - math.sqrt(n_old)) / self.alpha
            self.z[key] = self.z.get(key, 0.0) + g - sigma * (w - self.center.get(key, 0.0))
            self.n[key] = n_new
            self.v[key] = self.v.get(key, 0.0) + g * g
            self.m[key] = self.m.get(key, 0) + 1
            self._w.pop(key, None)

    def state(self) -> dict:
        return {"z": dict(self.z), "n": dict(self.n), "v": dict(self.v), "m": dict(self.m)}

    def load(self, state: dict, path: str = "gated") -> "GatedFTRL":
        """Restore a ``state()``, checked: an update sets all four of a coordinate's entries, so
        z, n, v and m have the same keys (``weight`` reads n of every key of z); n is the capped
        sum of squared gradients, in [0, n_cap], v the uncapped one, >= 0; m counts the
        coordinate's updates, >= 1 since it exists."""
        fields(state, path, ("z", "n", "v", "m"))
        keys = set(mapping(state["z"], f"{path}.z"))
        for name in ("n", "v", "m"):
            other = set(mapping(state[name], f"{path}.{name}"))
            if other != keys:
                k = min(other ^ keys)
                raise ValueError(f"{path}.{name if k in other else 'z'} has the coordinate {k!r}, "
                                 f"{path}.{'z' if k in other else name} has not")
        self.z = {k: number(x, f"{path}.z.{k}") for k, x in state["z"].items()}
        self.n = {k: number(x, f"{path}.n.{k}", 0.0, self.n_cap) for k, x in state["n"].items()}
        self.v = {k: number(x, f"{path}.v.{k}", 0.0) for k, x in state["v"].items()}
        self.m = {k: count(x, f"{path}.m.{k}", 1) for k, x in state["m"].items()}
        self._w = {}
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
