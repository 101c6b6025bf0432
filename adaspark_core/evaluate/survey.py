"""The verify-time survey of paper section 3.2 (Figure 3, Table 1), on this machine.

Pinned-width chain verifies at a few contexts, in two passes of opposite order (the second pass
visits the (context, width) cells in the reverse order of the first, so widths run ascending in
pass 1 and descending in pass 2, and so do the contexts) to cancel the machine's drift; per cell
and pass the median over the verifies after the first two (warm-ups dropped); per cell the median
over the passes of those per-pass medians; per width the least-squares fit of Eq. (3),
T(c) = alpha + beta * c, over the contexts, with its residuals.

This is a measurement only: nothing here reads or writes the learned store, and nothing prints.
The survey takes any object with the target's ``start``/``verify``/``discard``/``anchor``/``n_ctx``
(the llama.cpp ``LlamaTarget``, or a fake in tests).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from adaspark_core.base import tree
from adaspark_core.base.errors import InputError
from adaspark_core.base.tree import ANCHOR, MAX_WIDTH, NGRAM
from adaspark_core.store import fingerprint

# Table 1's contexts and Figure 3's widths (1 row added: plain decoding is a width on a CPU).
DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONTEXTS = (443, 1596, 8444)
WARMUP = 2  # verifies dropped at the start of every (cell, pass): caches, allocator, frequency ramp
PASSES = 2

# Filler for the KV cache: attention cost does not depend on which tokens are cached, so any
# text does; real text keeps the tokens valid for any vocabulary.
FILLER_TEXT = (
    "The verify time of a speculative decoder depends on how many rows it checks at once and on "
    "how much context every row attends over. This paragraph only fills the cache; it is repeated "
    "until the survey has the number of tokens it asked for. "
)


# --- timing one cell ------------------------------------------------------------------------------

def chain_layout(anchor: int, width: int, n_vocab: int | None = None):
    """A chain of ``width`` rows below ``anchor`` (the anchor is row 0), laid out for a verify.
    Tokens are arbitrary: a chain verify's cost does not depend on them."""
    cands: list = []
    for k in range(width - 1):
        tok = 500 + k if n_vocab is None else (500 + k) % n_vocab
        cands.append(tree.child_of(cands, ANCHOR if k == 0 else k - 1, tok, NGRAM))
    return tree.layout(anchor, cands, list(range(len(cands))))


def verify_samples(target, width: int, n: int) -> list:
    """``n`` chain verifies of ``width`` rows at the target's current context, each discarded so
    all run at the same context. Returns the ``Verified`` of each, in order (warm-ups included)."""
    lay = chain_layout(target.anchor, width, getattr(target, "n_vocab", None))
    out = []
    for _ in range(n):
        out.append(target.verify(lay))
        target.discard(lay)
    return out


def kept(samples: Sequence[float], warmup: int = WARMUP) -> list[float]:
    """The samples after the warm-ups (all of them if there are no more than the warm-ups:
    a median of nothing is not an answer)."""
    return list(samples[warmup:]) if len(samples) > warmup else list(samples)


def warm_median(samples: Sequence[float], warmup: int = WARMUP) -> float:
    """Median over the rounds after the first ``warmup`` (paper 3.2: "after the first two")."""
    if not samples:
        raise ValueError("no samples")
    return statistics.median(kept(samples, warmup))


def pinned_verify_ms(target, width: int, reps: int) -> tuple[float, float]:
    """Median llama_decode time and median engine host time (ms) of a chain verify of ``width``
    rows at the target's current context, over ``reps`` verifies after two warm-ups. Each verify
    is discarded, so all run at the same context. Host time = batch build + argmax read."""
    vs = verify_samples(target, width, reps + WARMUP)
    return warm_median([v.decode_ms for v in vs]), warm_median([v.host_ms for v in vs])


# --- the survey plan ------------------------------------------------------------------------------

def pass_order(widths: Sequence[int], contexts: Sequence[int], passes: int = PASSES) -> list[list[tuple[int, int]]]:
    """The (context, width) cells of each pass. Pass 1 runs contexts ascending and, at each,
    widths ascending; every later pass runs the reverse of the pass before it."""
    first = [(c, w) for c in sorted(contexts) for w in sorted(widths)]
    return [first if p % 2 == 0 else first[::-1] for p in range(passes)]


def context_limit(n_ctx: int, max_width: int) -> int:
    """The largest context (committed tokens, anchor included) at which a chain of ``max_width``
    rows still fits ``n_ctx`` cells: the anchor sits at position c-1 and the chain's last row at
    c-1 + max_width-1, which must stay below n_ctx - 1 (LlamaTarget.verify's rule)."""
    return n_ctx - max_width


def n_ctx_for(contexts: Sequence[int], widths: Sequence[int]) -> int:
    """Cells a context needs for the survey, rounded up to 256 (an attention view is padded to
    256 cells anyway, and the KV cache's size does not change a verify's cost, its use does)."""
    need = max(contexts) + max(widths) + 1
    return -(-need // 256) * 256


def parse_ints(text: str, what: str) -> list[int]:
    """"1,2,4" -> [1, 2, 4] (sorted, without repeats); InputError on anything else."""
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise InputError(f"--{what} must be comma-separated integers, got {text!r}") from None
    if not vals:
        raise InputError(f"--{what} is empty")
    return sorted(set(vals))


def check_widths(widths: Sequence[int], max_width: int = MAX_WIDTH) -> list[int]:
    """The widths, sorted and without repeats, if every one is 1..max_width rows; InputError otherwise."""
    ws = sorted(set(widths))
    bad = [w for w in ws if not 1 <= w <= max_width]
    if bad:
        raise InputError(f"widths must be between 1 and {max_width} rows, got {bad[0]}")
    return ws


def plan(widths: Sequence[int] | None, contexts: Sequence[int] | None, n_ctx_train: int,
         max_width: int = MAX_WIDTH) -> tuple[list[int], list[int], int, list[str]]:
    """Check the requested widths and contexts against the model and choose the context size.

    Returns (widths, contexts, n_ctx, notes). Widths must be 1..max_width. Contexts the user gave
    must fit the model's training context with the widest width (InputError otherwise); the
    default contexts (Table 1's 443, 1,596, 8,444) are clamped to what fits, and a note says so.
    """
    ws = check_widths(widths if widths else DEFAULT_WIDTHS, max_width)
    limit_ctx = n_ctx_train if n_ctx_train and n_ctx_train > 0 else 4096
    top = context_limit(limit_ctx, max(ws))
    if top < 1:
        raise InputError(f"the model's context ({limit_ctx} tokens) cannot hold a verify of {max(ws)} rows")
    notes: list[str] = []
    if contexts:
        cs = sorted(set(contexts))
        if cs[0] < 1:
            raise InputError(f"contexts must be at least 1 token, got {cs[0]}")
        if cs[-1] > top:
            raise InputError(f"context {cs[-1]} does not fit: the model's context is {limit_ctx} tokens, so with "
                             f"{max(ws)} rows the largest context is {top}")
    else:
        cs = []
        for c in DEFAULT_CONTEXTS:
            if c > top:
                notes.append(f"context {c} does not fit the model's {limit_ctx}-token context with {max(ws)} rows; "
                             f"using {top}")
                c = top
            cs.append(c)
        cs = sorted(set(cs))
    return ws, cs, min(n_ctx_for(cs, ws), limit_ctx), notes


def filler_tokens(target, n: int) -> list[int]:
    """``n`` tokens of repeated filler text (the last one becomes the anchor)."""
    unit = target.tokenize(FILLER_TEXT, special=False)
    if len(unit) < 2:
        raise ValueError("the filler text tokenises to nothing")
    # Tokenise the repeated text as one string, so a BOS the tokenizer adds comes once, first.
    toks = target.tokenize(FILLER_TEXT * (n // (len(unit) - 1) + 2), special=False)
    return toks[:n]


# --- the fit --------------------------------------------------------------------------------------

@dataclass
class Fit:
    """T(c) = alpha + beta * c (Eq. 3), least squares over the contexts. alpha in ms, beta in ms
    per token; residuals are measured - fitted (ms), one per context, in the contexts' order.
    With one context there is no slope: alpha and beta are None."""

    alpha: Optional[float]
    beta: Optional[float]
    residuals: list[Optional[float]]

    def value(self, c: float) -> float:
        return self.alpha + self.beta * c

    def max_abs_residual(self) -> Optional[float]:
        rs = [abs(r) for r in self.residuals if r is not None]
        return max(rs) if rs else None


def fit_affine(contexts: Sequence[float], times: Sequence[float]) -> Fit:
    """Least-squares line through (context, time) points."""
    n = len(contexts)
    if n != len(times):
        raise ValueError("contexts and times differ in length")
    if n < 2 or len(set(contexts)) < 2:
        return Fit(None, None, [None] * n)
    mc = sum(contexts) / n
    mt = sum(times) / n
    sxx = sum((c - mc) ** 2 for c in contexts)
    sxy = sum((c - mc) * (t - mt) for c, t in zip(contexts, times))
    beta = sxy / sxx
    alpha = mt - beta * mc
    return Fit(alpha, beta, [t - (alpha + beta * c) for c, t in zip(contexts, times)])


# --- the survey -----------------------------------------------------------------------------------

@dataclass
class Cell:
    """One (width, context): per pass, every verify's time in ms (warm-ups included, first)."""

    width: int
    context: int
    verify: list[list[float]] = field(default_factory=list)  # batch build + llama_decode + argmax
    decode: list[list[float]] = field(default_factory=list)  # llama_decode alone

    def pass_medians(self, warmup: int = WARMUP, which: str = "verify") -> list[float]:
        return [warm_median(s, warmup) for s in getattr(self, which)]

    def median(self, warmup: int = WARMUP, which: str = "verify") -> float:
        """Median over the passes of the per-pass medians (paper Figure 3)."""
        return statistics.median(self.pass_medians(warmup, which))


@dataclass
class Survey:
    widths: list[int]
    contexts: list[int]
    rounds: int  # verifies per cell and pass, warm-ups included
    warmup: int
    passes: int
    cells: dict[tuple[int, int], Cell]  # (width, context) -> Cell

    def medians(self, width: int, which: str = "verify") -> list[float]:
        return [self.cells[(width, c)].median(self.warmup, which) for c in self.contexts]

    def fit(self, width: int, which: str = "verify") -> Fit:
        return fit_affine(self.contexts, self.medians(width, which))

    def to_json(self) -> dict:
        """The survey's part of ``adaspark profile --json`` (see adaspark_cli/profile_cmd.py)."""
        cells = []
        for (w, c), cell in sorted(self.cells.items()):
            cells.append({
                "width": w, "context": c,
                "ms": cell.median(self.warmup), "pass_ms": cell.pass_medians(self.warmup),
                "decode_ms": cell.median(self.warmup, "decode"),
                "samples": cell.verify, "decode_samples": cell.decode,
            })
        fits = []
        for w in self.widths:
            f = self.fit(w)
            meds = self.medians(w)
            fits.append({
                "width": w, "alpha_ms": f.alpha, "beta_ms_per_token": f.beta,
                "residuals_ms": f.residuals,
                "residuals_rel": [None if r is None else r / m for r, m in zip(f.residuals, meds)],
                "max_abs_residual_ms": f.max_abs_residual(),
            })
        return {"widths": self.widths, "contexts": self.contexts, "rounds": self.rounds, "warmup": self.warmup,
                "passes": self.passes, "cells": cells, "fits": fits}


def survey(target, widths: Sequence[int], contexts: Sequence[int], rounds: int = 7, warmup: int = WARMUP,
           passes: int = PASSES, on_cell: Callable[[int, int, int], None] | None = None,
           on_prefill: Callable[[int, int], None] | None = None) -> Survey:
    """Run the survey on ``target``. ``rounds`` verifies per cell and pass (the first ``warmup``
    of them dropped from the medians). At each context the KV cache is filled once per pass with
    ``context`` filler tokens (``target.start``), and every verify is discarded, so the context
    stays fixed. ``on_prefill(pass, context)`` is called before a fill and ``on_cell(pass, width,
    context)`` after each cell (for a progress bar). Leaves the target's KV cache filled."""
    if rounds <= warmup:
        raise InputError(f"rounds must exceed the {warmup} warm-up verifies, got {rounds}")
    ws, cs = sorted(set(widths)), sorted(set(contexts))
    fill = filler_tokens(target, max(cs))
    cells = {(w, c): Cell(w, c) for w in ws for c in cs}
    for p, order in enumerate(pass_order(ws, cs, passes)):
        current = None
        for c, w in order:
            if c != current:
                if on_prefill:
                    on_prefill(p, c)
                target.start(fill[:c])
                current = c
            vs = verify_samples(target, w, rounds)
            cells[(w, c)].verify.append([v.verify_ms for v in vs])
            cells[(w, c)].decode.append([v.decode_ms for v in vs])
            if on_cell:
                on_cell(p, w, c)
    return Survey(ws, cs, rounds, warmup, passes, cells)


def machine(threads: int) -> dict:
    """The machine a survey ran on: the learned store's machine fingerprint plus the threads used."""
    return {**fingerprint.machine(), "threads": threads}
