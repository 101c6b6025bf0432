"""Online verify-cost model (paper section 3.2): which widths to offer and what each costs.

The model keeps a learned table of widths. The widths between two neighbours form a class, priced
at its top width, the only width of it the chooser is offered. Each class has a context law
(Eq. 4: a low-quantile fit of its verify time on a basis in the context, solved online by
FTRL-Proximal, with a bank of samples per context band refitted at the end of each request), a
level (the minimum of measured over fitted time over its last verifies) and a D clock (Eq. 5).

Learns only from round records (record.RoundRecord), so a log replays into the same state. Its
section of the store is versioned (``CostModel.VERSION``); ``upgrade_state`` reads every older
layout.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from adaspark_core.base.checks import (
    VERSION_FIELD,
    array,
    count,
    fields,
    int_key,
    mapping,
    number,
    numbers,
    section,
    version,
)
from adaspark_core.base.tree import MAX_WIDTH
from adaspark_core.learn.online import FTRL

LADDER = (1, 2, 4, 8, 16, 32, MAX_WIDTH)  # the paper's ladder plus width 1 (plain decoding on a CPU)
# The ladder's top is the widest width the table can hold: a split falls between two widths
# (CostModel.split), so no width exceeds it.
# A context is a token count in a llama.cpp context, whose size is a uint32_t; its band
# (band_of: its bit length) is then at most 32.
MAX_CONTEXT = 2**32 - 1
MAX_BAND = MAX_CONTEXT.bit_length()


def basis(c: float, unit: float) -> list[float]:
    """phi(u) = [1, u, u^2, sqrt u, ln(1+u)] with u = c / unit (Eq. 4)."""
    u = c / unit
    return [1.0, u, u * u, math.sqrt(u), math.log1p(u)]


def band_of(c: int) -> int:
    """A context band: the bit length of the context (128-255 tokens, 256-511, ...)."""
    return int(c).bit_length()


def quantile_loss(v: float, tau: float) -> float:
    return v * (tau - (1.0 if v < 0 else 0.0))


@dataclass
class LawParams:
    tau: float = 0.15
    unit: float = 8192.0
    l1: float = 0.002
    l2: float = 0.01
    alpha: float = 0.05
    beta: float = 1.0
    n_cap: float = 400.0
    bank_size: int = 16
    refit_steps: int = 256  # the same on a sparse bank as on a full one
    clamp: tuple[float, float] = (0.5, 3.0)
    min_samples: int = 3  # samples before the law prices its class


class Law:
    """One class's context law: time(c) = scale * theta . phi(c / unit), clamped to
    [0.5, 3] x the class's lowest observed time. ``scale`` is the lowest of its first three times,
    so theta starts at the prior [1, 0, 0, 0, 0] (a flat law at the class's own time)."""

    def __init__(self, p: LawParams):
        self.p = p
        self.ftrl = self._solver()
        self.first: list[float] = []  # the first three times, ms
        self.lowest = math.inf
        self.samples = 0
        self.bank: dict[int, list[tuple[int, float]]] = {}  # band -> newest (context, ms)
        self._refit_at = -1  # samples at the last refit (not stored: a refit without new ones is a no-op)

    def _solver(self) -> FTRL:
        p = self.p
        # context coefficients are non-negative: the fitted time never falls as context grows
        return FTRL(5, p.alpha, p.beta, p.l1, p.l2, p.n_cap, lower=[None, 0.0, 0.0, 0.0, 0.0],
                    center=[1.0, 0.0, 0.0, 0.0, 0.0])

    @property
    def scale(self) -> float:
        return min(self.first) if self.first else 1.0

    def observe(self, c: int, ms: float) -> None:
        if len(self.first) < 3:
            self.first.append(ms)
        self.lowest = min(self.lowest, ms)
        self.samples += 1
        self._step(self.ftrl, c, ms)
        b = self.bank.setdefault(band_of(c), [])
        b.append((c, ms))
        del b[: -self.p.bank_size]

    def _step(self, solver: FTRL, c: int, ms: float) -> None:
        x = basis(c, self.p.unit)
        y = ms / self.scale
        solver.update_linear(x, (1.0 if y < solver.predict(x) else 0.0) - self.p.tau)

    def value(self, c: int) -> float:
        """The law's time at context c, in ms (the lowest time until it has enough samples)."""
        if self.samples < self.p.min_samples:
            return self.lowest
        t = self.scale * self.ftrl.predict(basis(c, self.p.unit))
        lo, hi = self.p.clamp
        return min(max(t, lo * self.lowest), hi * self.lowest)

    def _loss(self, solver: FTRL, samples: list[tuple[int, float]]) -> float:
        tau, unit, s = self.p.tau, self.p.unit, self.scale
        return sum(quantile_loss(ms / s - solver.predict(basis(c, unit)), tau) for c, ms in samples)

    def refit(self) -> bool:
        """Batch refit at the end of a request: train a fresh law on the bank, bands interleaved,
        holding out the newest quarter of every band of four samples or more; keep it if its
        quantile loss is lower on the judged samples (the held-out ones plus every sample of a band
        too small to hold any out). Returns whether the refit replaced the online law.

        Without a sample since the last refit, the bank and the online law are as they were, so
        the fresh law would be the same and lose (or tie) again: skipped, which leaves the result
        exactly as it was and spares the end of every request most of its host time (a refit is
        256 FTRL steps, and most widths see no verify in a given request)."""
        if self.samples == self._refit_at:
            return False
        self._refit_at = self.samples
        train: list[list[tuple[int, float]]] = []
        judged: list[tuple[int, float]] = []
        for band in sorted(self.bank):
            s = self.bank[band]
            k = len(s) // 4
            if k:
                train.append(s[:-k])
                judged += s[-k:]
            else:
                train.append(s)
                judged += s
        flat = [x for group in _interleave(train) for x in group]
        if not flat:
            return False
        cand = self._solver()
        # The same steps as _step's, fused (FTRL.quantile_steps): a reply's end waits for them.
        unit, scale = self.p.unit, self.scale
        samples = [(basis(c, unit), ms / scale) for c, ms in flat]
        cand.quantile_steps([samples[i % len(samples)] for i in range(self.p.refit_steps)], self.p.tau)
        if self._loss(cand, judged) < self._loss(self.ftrl, judged):
            self.ftrl = cand
            return True
        return False

    def state(self) -> dict:
        lowest = None if math.isinf(self.lowest) else self.lowest  # JSON has no infinity
        return {"ftrl": self.ftrl.state(), "first": self.first, "lowest": lowest, "samples": self.samples,
                "bank": {str(b): s for b, s in self.bank.items()}}

    def load(self, st: dict, path: str = "law") -> "Law":
        """Restore a ``state()``, checked. Times are verify times in ms, > 0 (a zero would be a
        zero scale, and the law divides by it). ``first`` holds the first three of ``samples``;
        ``lowest`` is null (no time yet: infinity) exactly while there are none. The bank holds
        at most ``bank_size`` (context, ms) per context band."""
        fields(st, path, ("ftrl", "first", "lowest", "samples", "bank"))
        self.ftrl.load(st["ftrl"], f"{path}.ftrl")
        self.samples = count(st["samples"], f"{path}.samples")
        self.first = numbers(st["first"], f"{path}.first", 0.0, positive=True, length=min(self.samples, 3))
        if self.samples == 0:
            if st["lowest"] is not None:
                raise ValueError(f"{path}.lowest is {st['lowest']!r}, not null: {path}.samples is 0")
            self.lowest = math.inf
        else:
            self.lowest = number(st["lowest"], f"{path}.lowest", 0.0, positive=True)
        self.bank = {}
        for b, s in mapping(st["bank"], f"{path}.bank").items():
            at = f"{path}.bank.{b}"
            entries = array(s, at, min_len=1, max_len=self.p.bank_size)
            pairs = [array(x, f"{at}.{i}", length=2) for i, x in enumerate(entries)]
            self.bank[int_key(b, f"{path}.bank", 0, MAX_BAND)] = [
                (count(c, f"{at}.{i}.0", 0, MAX_CONTEXT), number(ms, f"{at}.{i}.1", 0.0, positive=True))
                for i, (c, ms) in enumerate(pairs)]
        return self


def _interleave(groups: list[list]) -> list[list]:
    """[[a1, a2], [b1]] -> [[a1], [b1], [a2]]: one sample of each band in turn."""
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [[g[i]] for g in groups if i < len(g)]
    return out


@dataclass
class CostParams:
    ladder: tuple[int, ...] = LADDER
    measurements: int = 3  # before a width is priced
    level_window: int = 8
    level_clamp: tuple[float, float] = (0.5, 2.0)
    max_widths: int = 24
    steep: float = 0.25  # a class whose top costs this much over its bottom splits next to the held width
    d_clock_min_ms: float = 1.0  # below this D is host noise, not a clock (no model drafter on a CPU)
    d_clock_clamp: tuple[float, float] = (0.5, 2.0)
    # The least share of the measured row price (between the two widest measured narrower widths)
    # an unmeasured width's extra rows are taken to cost (price_floor)
    floor_slope: float = 0.5
    law: LawParams = field(default_factory=LawParams)


class WidthClass:
    """The class whose top is ``top``: its law, level window, measurement count and D stamp."""

    def __init__(self, top: int, p: CostParams):
        self.top = top
        self.law = Law(p.law)
        self.count = 0  # verifies measured at exactly this width
        # measured / law over the last verifies, per context band (band_of). Stored, unlike the
        # paper's: a restart then continues exactly where it stopped, and a replayed log
        # reproduces the live state. Per band, unlike the paper's one window: a level measured at
        # one context corrects the law's error there, which at another context is another error
        # (one window can price a class out for good: ARCHITECTURE.md, section 5).
        self.level: dict[int, deque[float]] = {}
        self.level_window = p.level_window
        self.d_ref = 0.0  # D when last measured


def _levels_per_band(st: dict) -> dict:
    """1 -> 2: a class keeps its level window per context band. A version-1 window is one list
    with no contexts, so it is dropped (8 verifies rebuild it). Sections written before sections
    had versions are version 1 too, and from store schema 2 on they already hold a window per band
    (an object): those are kept as they are."""
    classes = st.get("classes")
    if not isinstance(classes, dict):
        return st  # damaged: from_state names the field
    return {**st, "classes": {w: {**k, "level": {}} if isinstance(k, dict) and isinstance(k.get("level"), list) else k
                              for w, k in classes.items()}}


def _without_reach(st: dict) -> dict:
    """2 -> 3: a class no longer counts the measuring rounds too narrow for it (``short``) nor
    keeps the widest of their trees (``widest_short``): a width is measured only in a round whose
    candidates fill it (chooser.AdaptiveWidth._worth_measuring), so no measured round is narrower
    than its width and the table never moves a width to the sources' reach. Both are dropped
    (absent ones too: a section of the current layout written without versions is version 1)."""
    classes = st.get("classes")
    if not isinstance(classes, dict):
        return st  # damaged: from_state names the field
    return {**st, "classes": {w: {f: v for f, v in k.items() if f not in ("short", "widest_short")}
                              if isinstance(k, dict) else k for w, k in classes.items()}}


# Append-only: UPGRADES[i] turns a section of version i+1 into one of version i+2. Never edit an entry.
UPGRADES = [_levels_per_band, _without_reach]


def upgrade_state(st: dict, path: str = "cost") -> dict:
    """A cost-model section of any version this build reads, brought to ``CostModel.VERSION`` (a
    new dict; ``st`` is left as it is). checks.NewerVersion for a section a newer AdaSpark wrote."""
    for step in UPGRADES[version(st, path, CostModel.VERSION) - 1:]:
        st = step(st)
    return {**st, VERSION_FIELD: CostModel.VERSION}


class CostModel:
    """The learned width table and its prices (paper 3.2, Eq. 4-5)."""

    VERSION = len(UPGRADES) + 1  # of its section (state)

    def __init__(self, params: CostParams | None = None):
        self.p = params or CostParams()
        self.classes: dict[int, WidthClass] = {w: WidthClass(w, self.p) for w in self.p.ladder}
        self.d_recent: deque[float] = deque(maxlen=8)
        self.rounds = 0

    @property
    def widths(self) -> list[int]:
        return sorted(self.classes)

    # --- reading ---------------------------------------------------------------------------------

    def d_now(self) -> float:
        s = sorted(self.d_recent)
        return s[len(s) // 2] if s else 0.0

    def measuring(self) -> int | None:
        """The narrowest width with fewer than 3 measurements (cold start or a new split)."""
        for w in self.widths:
            if self.classes[w].count < self.p.measurements:
                return w
        return None

    def unmeasured(self) -> list[int]:
        """Every width with fewer than 3 measurements, narrowest first."""
        return [w for w in self.widths if self.classes[w].count < self.p.measurements]

    def class_price(self, w: int, c: int) -> float:
        """Eq. 5: law(c) x level x D_now / D_k, for a measured class, in ms; in a context band the
        class has never run in, no less than ``_transfer_floor``."""
        k = self.classes[w]
        t = self._levelled(k, c)
        if band_of(c) not in k.level:
            t = max(t, self._transfer_floor(k, c))
        return t * self._clock(k)

    def _levelled(self, k: WidthClass, c: int) -> float:
        """The class's law at c times its level in c's band (Eq. 5 without the D clock)."""
        t = k.law.value(c)
        level = k.level.get(band_of(c))
        if level:
            lo, hi = self.p.level_clamp
            t *= min(max(min(level), lo), hi)
        return t

    def _transfer_floor(self, k: WidthClass, c: int) -> float:
        """What class ``k`` costs at least at c, where it has never run: the widest narrower
        class that has run in c's band, priced at c, times the ratio of k's price to that
        class's in the band nearest c where both have run (0: no such pair).

        A class's law learns its context slope only from the contexts it ran at, and a cold
        store runs wide classes at short contexts first: extrapolated to a band it has never
        run in, a wide class's slope is too flat. Its level fixes that after one verify, but
        that verify is the one the low price chose: on the default model a first verify of a
        class wider than 4 in a new band took 1.6-1.8x its price (ARCHITECTURE.md, section 5). The
        ratio between two classes' times changes slowly with the context, so a narrower class
        measured here, scaled by it, prices the wide class near its truth."""
        band = band_of(c)
        # (a class has a level only once its law prices: it is measured)
        runs_here = [j for j in self.classes.values() if j.top < k.top and band in j.level]
        if not runs_here:
            return 0.0
        j = max(runs_here, key=lambda x: x.top)
        shared = [b for b in k.level if b in j.level]
        if not shared:
            return 0.0
        ref = min(shared, key=lambda b: (abs(b - band), -b))
        c_ref = 3 << max(ref - 2, 0)  # the band's middle: band b holds 2^(b-1) .. 2^b - 1 tokens
        return self._levelled(j, c) * self._levelled(k, c_ref) / self._levelled(j, c_ref)

    def _clock(self, k: WidthClass) -> float:
        d = self.d_now()
        if d < self.p.d_clock_min_ms or k.d_ref < self.p.d_clock_min_ms:
            return 1.0
        lo, hi = self.p.d_clock_clamp
        return min(max(d / k.d_ref, lo), hi)

    def prices(self, c: int) -> dict[int, float]:
        """The price of every measured width: the cheapest class whose top is at least that width
        (so a cheaper wider class prices the narrower ones, paper 3.2)."""
        ws = [w for w in self.widths if self.classes[w].count >= self.p.measurements]
        out: dict[int, float] = {}
        best = math.inf
        for w in reversed(ws):
            best = min(best, self.class_price(w, c))
            out[w] = best
        return dict(sorted(out.items()))

    def price_floor(self, w: int, c: int) -> float | None:
        """A price an unmeasured width ``w`` is taken not to be under, at context ``c``: the widest
        measured narrower width's, plus ``floor_slope`` of the row price between the two widest
        measured narrower widths for each row beyond it. A kernel whose narrow widths cost alike
        (a GPU below saturation) gives a floor at the narrower price; one whose rows cost in
        proportion (a CPU: about 1.1-1.3 ms a row on the default model from 8 to 64 rows, 2 cores)
        gives a floor well under the truth and well over the narrower price. None: nothing
        narrower is measured."""
        below = [(v, t) for v, t in self.prices(c).items() if v < w]
        if not below:
            return None
        (v1, t1) = below[-1]
        slope = max(t1 - below[-2][1], 0.0) / (v1 - below[-2][0]) if len(below) > 1 else 0.0
        return t1 + self.p.floor_slope * slope * (w - v1)

    # --- learning ----------------------------------------------------------------------------------

    def learn(self, rec) -> None:
        """Fold one round into the table. A request's first round is not learned from: it runs
        cold. Only a verify of exactly a table width measures that class (a measuring round
        verifies the width it measures: the policy measures a width only in a round whose
        candidates fill it)."""
        self.rounds += 1
        if rec.first:
            return
        # D is the host's part of proposing: a draft model's forwards are the depth learner's to
        # price (learn/depth.py), and a D that held them would count them again at every width.
        forwards = sum(rec.drafting.forwards) if rec.drafting else 0.0
        self.d_recent.append(max(rec.times.draft - forwards, 0.0))
        k = self.classes.get(rec.width)
        if k is not None:
            t = rec.times.verify
            if k.law.samples >= k.law.p.min_samples:
                band = band_of(rec.context)
                k.level.setdefault(band, deque(maxlen=k.level_window)).append(t / k.law.value(rec.context))
            k.law.observe(rec.context, t)
            k.count += 1
            k.d_ref = self.d_now()
        if rec.last:
            for k in self.classes.values():
                k.law.refit()

    def split(self, held: int, c: int, passes) -> int | None:
        """Split the class nearest the held width for which ``passes(a, b)`` says a width inside
        (a, b) could beat the incumbent; at the width next to the held one when the class's top
        costs over 25% more than its bottom, else at the midpoint. Returns the new width."""
        if len(self.classes) >= self.p.max_widths:
            return None
        # One split at a time: none while a width inside the measured range waits for its
        # measurements (a ladder width wider than anything measured, which the sources may never
        # fill, does not hold splits back).
        measured = [w for w in self.widths if self.classes[w].count >= self.p.measurements]
        if any(w < max(measured, default=0) for w in self.unmeasured()):
            return None
        ws = self.widths
        pairs = [(a, b) for a, b in zip(ws, ws[1:]) if b - a >= 2]
        pairs.sort(key=lambda ab: (min(abs(ab[0] - held), abs(ab[1] - held)), ab[0]))
        for a, b in pairs:
            if not passes(a, b):
                continue
            ta, tb = self.class_price(a, c), self.class_price(b, c)
            if tb > (1 + self.p.steep) * ta:
                new = b - 1 if held >= b else a + 1
            else:
                new = (a + b) // 2
            self.classes[new] = WidthClass(new, self.p)
            return new
        return None

    # --- persistence -----------------------------------------------------------------------------

    def state(self) -> dict:
        return {
            VERSION_FIELD: self.VERSION,
            "rounds": self.rounds,
            "d_recent": list(self.d_recent),
            "classes": {str(w): {"count": k.count, "d_ref": k.d_ref,
                                 "level": {str(b): list(v) for b, v in k.level.items()}, "law": k.law.state()}
                        for w, k in self.classes.items()},
        }

    @classmethod
    def from_state(cls, st: dict, params: CostParams | None = None, path: str = "cost") -> "CostModel":
        """Restore a ``state()``, checked (checks.py). D times are draft times in ms, >= 0 (with
        no model drafter D is host time and can round to 0), at most the 8 the window keeps. A
        class's width is in 1 .. the ladder's top (see ``MAX_WIDTH``). A level window holds 1 to
        ``level_window`` ratios of a positive time over a positive law. An older section is
        upgraded first (``upgrade_state``)."""
        m = cls(params)
        st = upgrade_state(st, path)
        section(st, path, cls.VERSION, ("rounds", "d_recent", "classes"))
        m.rounds = count(st["rounds"], f"{path}.rounds")
        m.d_recent.extend(numbers(st["d_recent"], f"{path}.d_recent", 0.0, max_len=m.d_recent.maxlen))
        m.classes = {}
        top = max(m.p.ladder)
        for w, ks in mapping(st["classes"], f"{path}.classes").items():
            at = f"{path}.classes.{w}"
            k = WidthClass(int_key(w, f"{path}.classes", 1, top), m.p)
            fields(ks, at, ("count", "d_ref", "level", "law"))
            k.count = count(ks["count"], f"{at}.count")
            k.d_ref = number(ks["d_ref"], f"{at}.d_ref", 0.0)
            k.level = {int_key(b, f"{at}.level", 0, MAX_BAND):
                       deque(numbers(v, f"{at}.level.{b}", 0.0, positive=True, min_len=1, max_len=m.p.level_window),
                             maxlen=m.p.level_window)
                       for b, v in mapping(ks["level"], f"{at}.level").items()}
            k.law.load(ks["law"], f"{at}.law")
            m.classes[k.top] = k
        return m
