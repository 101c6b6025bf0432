"""What a store holds, as a plain summary (``adaspark store show``): pure functions, no printing.

``summarize(store)`` restores the learners from the store and reads them:

- the learned widths and their classes (a class is the interval of widths above the next narrower
  learned width, priced at its top, paper 3.2); each class's context law priced at a few contexts
  as in the paper's Table 1, with an affine least-squares fit ``alpha + beta c`` of the law over
  the contexts' range; the class's price as the chooser reads it (Eq. 5: law x level x D clock);
  its per-band level windows;
- the round's fixed cost D (``CostModel.d_now()``), the chooser's band rates rho and its
  incumbent (paper 3.4);
- the acceptance model's coefficients and bucket weights with their label counts, and its guard
  (paper 3.3);
- the store's counts and the fingerprint it is keyed by.

Everything in the summary is JSON-ready: str keys, no infinities (None instead).
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

from adaspark_core.learn.acceptance import AcceptanceModel
from adaspark_core.learn.chooser import Chooser
from adaspark_core.learn.cost import CostModel
from adaspark_core.learn.learned import Learners
from adaspark_core.store.fingerprint import fingerprint_key
from adaspark_core.store.store import SCHEMA, Store

CONTEXTS = (443, 1596, 8444)  # the paper's Table 1 contexts
FIT_POINTS = 64  # grid of the affine fit over [min, max] of the contexts

COEFFICIENTS = ("a0", "a1", "a2", "a3", "a4", "a5", "a6", "a7", "ctx", *(f"depth{d}" for d in range(2, 9)))
COEFFICIENT_MEANING = {
    "a0": "pick intercept", "a1": "pick logit h", "a2": "pick logit share",
    "a3": "sibling intercept", "a4": "sibling log r", "a5": "sibling logit h", "a6": "sibling logit sigma",
    "a7": "n-gram logit p_src",
    "ctx": "context, ln(c / 1024)", **{f"depth{d}": f"depth {d}" + (" and deeper" if d == 8 else "") for d in range(2, 9)},
}
BUCKET_KINDS = {"ng": "n-gram bucket", "ngk": "n-gram kind/evidence margin", "nga": "n-gram kind/above margin",
                "agree": "agreed", "contra": "contradiction"}


def _num(x: float | None) -> float | None:
    """A JSON-safe number: None for None, NaN and the infinities."""
    if x is None or not math.isfinite(x):
        return None
    return float(x)


def band_range(b: int) -> list[int]:
    """The contexts of band ``b`` (a context's bit length): [2^(b-1), 2^b - 1]; band 0 is context 0."""
    return [0, 0] if b <= 0 else [1 << (b - 1), (1 << b) - 1]


def affine_fit(f: Callable[[float], float], lo: float, hi: float, points: int = FIT_POINTS) -> dict | None:
    """Least-squares ``alpha + beta c`` of ``f`` on ``points`` evenly spaced contexts in [lo, hi]
    (Eq. 3). Returns alpha (ms), beta (ms per 1,000 tokens) and the largest residual relative to
    f (Table 1's "max residual"), or None when f is not finite there."""
    n = max(points, 2)
    xs = [lo + (hi - lo) * i / (n - 1) for i in range(n)]
    ys = [f(x) for x in xs]
    if not all(math.isfinite(y) for y in ys):
        return None
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    beta = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    alpha = my - beta * mx
    resid = max((abs(y - (alpha + beta * x)) / abs(y) for x, y in zip(xs, ys) if y), default=0.0)
    return {"alpha_ms": alpha, "beta_ms_per_1k": beta * 1000.0, "max_residual": resid, "contexts": [lo, hi]}


# --- the verify-cost model ------------------------------------------------------------------------


def cost_summary(cost: CostModel, contexts: Iterable[int] = CONTEXTS, fit_points: int = FIT_POINTS) -> dict:
    """The learned widths and, per class, its law at ``contexts`` with its affine fit, its price
    (Eq. 5), the price the chooser is offered (the cheapest class at least as wide), its levels."""
    contexts = sorted(set(int(c) for c in contexts))
    offered = {c: cost.prices(c) for c in contexts}
    lo_level, hi_level = cost.p.level_clamp
    classes = []
    below = 0
    for w in cost.widths:
        k = cost.classes[w]
        law = k.law
        bank = [c for s in law.bank.values() for c, _ in s]
        fit = affine_fit(lambda c: law.value(int(round(c))), contexts[0], contexts[-1], fit_points) \
            if law.samples and len(contexts) >= 2 and contexts[0] < contexts[-1] else None
        levels = []
        for b in sorted(k.level):
            window = list(k.level[b])
            levels.append({"band": b, "contexts": band_range(b), "window": window,
                           "factor": min(max(min(window), lo_level), hi_level) if window else None})
        classes.append({
            "width": w,
            "rows": [below + 1, w],  # the widths this class stands for, priced at its top
            "count": k.count,
            "measured": k.count >= cost.p.measurements,
            "d_ref_ms": k.d_ref,
            "law": {
                "samples": law.samples,
                "priced_by_law": law.samples >= law.p.min_samples,  # else: its lowest time
                "scale_ms": law.scale if law.first else None,
                "lowest_ms": _num(law.lowest),
                "theta": list(law.ftrl.weights()),
                "bank": {"samples": len(bank), "contexts": [min(bank), max(bank)] if bank else None},
                "time_ms": {str(c): _num(law.value(c)) if law.samples else None for c in contexts},
                "fit": fit,
            },
            "price_ms": {str(c): _num(cost.class_price(w, c)) if law.samples else None for c in contexts},
            "offered_price_ms": {str(c): _num(offered[c].get(w)) for c in contexts},
            "levels": levels,
        })
        below = w
    return {
        "widths": cost.widths,
        "measuring": cost.measuring(),
        "rounds": cost.rounds,
        "d_now_ms": cost.d_now(),
        "d_recent_ms": list(cost.d_recent),
        "contexts": contexts,
        "classes": classes,
    }


# --- the chooser -----------------------------------------------------------------------------------


def chooser_summary(ch: Chooser) -> dict:
    """Band rates rho (committed tokens per ms, decayed; in use once a band has its minimum of
    rounds) and the incumbent."""
    bands = []
    for b in sorted(ch.bands):
        d = ch.bands[b]
        bands.append({"band": b, "contexts": band_range(b), "rounds": d.count,
                      "in_use": d.count >= ch.p.band_min_rounds,
                      "rho_tokens_per_ms": d.ratio, "tokens": d.x, "ms": d.y})
    return {"incumbent": ch.incumbent, "held": ch.held, "band_min_rounds": ch.p.band_min_rounds, "bands": bands}


# --- the acceptance model ---------------------------------------------------------------------------


def bucket_kind(key: str) -> str:
    return BUCKET_KINDS.get(key.split(":", 1)[0], "other")


def acceptance_summary(m: AcceptanceModel) -> dict:
    """The coefficients (every one, at its prior until it learned), every bucket weight touched so
    far, sorted by |weight| (ties: more labels first, then the key), and the guard."""
    coef = m.coef
    names = list(COEFFICIENTS) + sorted(k for k in coef.z if k not in COEFFICIENTS)
    coefficients = []
    for k in names:
        w, prior = coef.weight(k), coef.center.get(k, 0.0)
        coefficients.append({"name": k, "meaning": COEFFICIENT_MEANING.get(k, ""), "weight": w, "prior": prior,
                             "labels": coef.m.get(k, 0), "gradient_sum": coef.z.get(k, 0.0),
                             "left_prior": w != prior})
    buckets = [{"key": k, "kind": bucket_kind(k), "weight": m.buckets.weight(k), "labels": m.buckets.m.get(k, 0),
                "gradient_sum": m.buckets.z.get(k, 0.0)} for k in m.buckets.z]
    buckets.sort(key=lambda b: (-abs(b["weight"]), -b["labels"], b["key"]))
    gh, gf = m.guard_head, m.guard_fitted
    return {
        "requests": m.requests,
        "guard": {"priced_by": "fitted" if m.fitted_wins else "head",
                  "head_loss_per_node": gh.x / gh.y if gh.y > 0 else None,
                  "fitted_loss_per_node": gf.x / gf.y if gf.y > 0 else None,
                  "labelled_parents": gh.count},
        "coefficients": coefficients,
        "buckets": buckets,
        "buckets_moved": sum(1 for b in buckets if b["weight"] != 0.0),
    }


# --- the whole store --------------------------------------------------------------------------------


def fingerprint_summary(fp: dict) -> dict:
    return {**fp, "key": fingerprint_key(fp)}


def summarize(store: Store, learners: Learners | None = None, contexts: Iterable[int] = CONTEXTS,
              fit_points: int = FIT_POINTS, file_schema: int | None = None) -> dict:
    """The summary of ``store`` (its learners restored from it unless given). ``file_schema``: the
    schema of the file on disk, when the caller read it (the store itself is upgraded in memory)."""
    learners = learners if learners is not None else Learners.from_store(store)
    policy = learners.policy
    return {
        "path": str(store.path),
        "schema": SCHEMA,
        "file_schema": file_schema,
        "updated": store.updated,
        "fingerprint": fingerprint_summary(store.fingerprint),
        "counts": {"requests": store.counts["requests"], "rounds": store.counts["rounds"], **_learned_counts(learners)},
        "sections": sorted(store.sections),
        "cost": cost_summary(policy.cost, contexts, fit_points),
        "chooser": chooser_summary(policy.chooser),
        "acceptance": acceptance_summary(learners.acceptance),
        "sampled": _regime_summary(learners.sampled) if learners.sampled is not None else None,
    }


def _learned_counts(ls: Learners) -> dict:
    """What a regime's learners have seen: cost-model and chooser rounds, acceptance requests."""
    return {"cost_rounds": ls.policy.cost.rounds,
            "chooser_rounds": sum(d.count for d in ls.policy.chooser.bands.values()),
            "acceptance_requests": ls.acceptance.requests}


def _regime_summary(ls: Learners) -> dict:
    """The sampled regime: its counts, chooser and acceptance model (its cost model learns the
    same verify times the greedy one does)."""
    return {"counts": _learned_counts(ls), "chooser": chooser_summary(ls.policy.chooser),
            "acceptance": acceptance_summary(ls.acceptance)}
