"""``adaspark profile``: the paper's verify-time survey (section 3.2, Figure 3, Table 1) on this
machine. It measures only; it never reads or writes the learned store.

Registered in main.py with ``app.command()(profile)``.

``--json`` prints one object:

    {
      "schema": 1,
      "machine": {"cpu": str, "cpus": int, "arch": str, "llama_cpp_python": str, "threads": int},
      "model": {"path": str, "size_bytes": int, "desc": str, "n_ctx_train": int},
      "n_ctx": int,                      # the context created for the survey
      "widths": [int, ...],              # rows, ascending
      "contexts": [int, ...],            # committed tokens (anchor included), ascending
      "rounds": int, "warmup": int, "passes": int,
      "notes": [str, ...],               # e.g. a default context clamped to the model's context
      "time": "verify_ms: batch build + llama_decode + argmax read (what the cost model learns)",
      "cells": [{                        # one per (width, context), width-major
          "width": int, "context": int,
          "ms": float,                   # median over passes of the per-pass medians (verify_ms)
          "pass_ms": [float, ...],       # per pass: median over its rounds after the warm-ups
          "decode_ms": float,            # the same statistic for llama_decode alone
          "samples": [[float, ...], ...],        # per pass, every round's verify_ms, warm-ups first
          "decode_samples": [[float, ...], ...]  # per pass, every round's llama_decode ms
      }, ...],
      "fits": [{                         # one per width: T(c) = alpha + beta * c over the contexts
          "width": int, "alpha_ms": float|null, "beta_ms_per_token": float|null,
          "residuals_ms": [float|null, ...],     # measured - fitted, per context
          "residuals_rel": [float|null, ...],    # residual / measured
          "max_abs_residual_ms": float|null
      }, ...]
    }

alpha, beta and residuals are null when only one context is surveyed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import orjson
import typer
from tabulate import tabulate
from tqdm import tqdm

from adaspark_cli import console
from adaspark_cli.console import fail, reported
from adaspark_cli.plot import line_plot, require_matplotlib
from adaspark_core.base.errors import InputError
from adaspark_core.base.files import landing
from adaspark_core.decode.runtime import EngineOptions, Runtime, open_model
from adaspark_core.engine.simlm import SimModel
from adaspark_core.evaluate import survey as prof

SCHEMA = 1
TIME_NOTE = "verify_ms: batch build + llama_decode + argmax read (what the cost model learns)"


def profile(
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF model file (default: SmolLM2-135M-Instruct, Q4_0)."),
    widths: str = typer.Option("1,2,4,8,16,32,64", "--widths", help="Rows per verify, comma-separated, each 1 to 64."),
    contexts: Optional[str] = typer.Option(None, "--contexts", help="Contexts in tokens, comma-separated (default: Table 1's 443,1596,8444, the largest clamped to what the model's context holds with the widest verify)."),
    rounds: int = typer.Option(7, "--rounds", min=3, help="Verifies per (width, context) and pass; the first 2 are warm-ups, left out of the medians."),
    threads: Optional[int] = console.THREADS,
    n_gpu_layers: Optional[str] = console.N_GPU_LAYERS,
    device: Optional[str] = console.DEVICE,
    tensor_split: Optional[str] = console.TENSOR_SPLIT,
    rpc: Optional[str] = console.RPC,
    rpc_timeout: float = console.RPC_TIMEOUT,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (machine, model, every sample, the fits) instead of a table."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Also write a PNG of verify time against rows, one line per context (needs matplotlib: pip install 'adaspark[plot]')."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar on stderr."),
) -> None:
    """Measure this machine's verify time by rows and context.

    The paper's survey (3.2, Figure 3, Table 1): pinned-width chain verifies at each context, in two passes of opposite order (pass 1 widths
    ascending, pass 2 descending); per cell the median over passes of the per-pass median after
    two warm-up rounds; per width the fit T(c) = alpha + beta*c over the contexts with its
    residuals. Measures only: the learned store is not touched."""
    if plot is not None and plot.suffix.lower() != ".png":
        fail(f"--plot must name a .png file, got {plot}")
    if plot is not None and not plot.resolve().parent.is_dir():
        fail(f"--plot: no such directory: {plot.resolve().parent}")
    with reported():
        if plot is not None:  # no matplotlib, a device, a FIFO or a folder there: said now, not after the survey
            require_matplotlib()
            landing(plot)
        ws = prof.check_widths(prof.parse_ints(widths, "widths"))  # before the model loads
        cs = prof.parse_ints(contexts, "contexts") if contexts else None
        lm = open_model(model, layout=console.layout(n_gpu_layers, device, tensor_split, rpc, rpc_timeout))
        if isinstance(lm, SimModel):
            raise InputError(f"profile measures llama.cpp's verify time: {lm.path} is a simulated model")
        ws, cs, n_ctx, notes = prof.plan(ws, cs, lm.n_ctx_train)
        for note in notes:
            typer.echo(f"adaspark: note: {note}", err=True)
        with Runtime.open(EngineOptions(model=model, n_ctx=n_ctx, threads=threads), model=lm) as rt:  # measures only: no arm, no store
            n_threads = rt.target.threads
            survey = run_with_progress(rt.target, ws, cs, rounds, disable=no_progress)

        out = {
            "schema": SCHEMA,
            "machine": prof.machine(n_threads),
            "model": {"path": str(lm.path.resolve()), "size_bytes": lm.path.stat().st_size, "desc": lm.desc,
                      "n_ctx_train": lm.n_ctx_train},
            "n_ctx": n_ctx,
            "notes": notes,
            "time": TIME_NOTE,
            **survey.to_json(),
        }
        if plot is not None:
            try:
                write_plot(plot, survey, lm.path.name)
            except OSError as e:
                raise InputError(f"cannot write the plot {plot}: {e.strerror}") from None
        if as_json:
            sys.stdout.write(orjson.dumps(out).decode() + "\n")
        else:
            sys.stdout.write(table(out))
        if plot is not None:
            typer.echo(f"adaspark: wrote {plot}", err=True)


def run_with_progress(target, ws, cs, rounds, disable=False):
    """The survey with a tqdm bar on stderr: one step per (pass, context, width) cell."""
    total = prof.PASSES * len(ws) * len(cs)
    with tqdm(total=total, desc="profile", unit="cell", file=sys.stderr, disable=disable, leave=False) as bar:
        def on_prefill(p, c):
            bar.set_postfix_str(f"pass {p + 1}: filling {c} tokens")

        def on_cell(p, w, c):
            bar.set_postfix_str(f"pass {p + 1}: ctx {c}, {w} rows")
            bar.update(1)

        return prof.survey(target, ws, cs, rounds=rounds, on_cell=on_cell, on_prefill=on_prefill)


def table(out: dict) -> str:
    """Rows = widths; columns = median ms at each context, alpha, beta (per 1k tokens), max |residual|."""
    cs = out["contexts"]
    cell = {(c["width"], c["context"]): c for c in out["cells"]}
    rows = []
    for f in out["fits"]:
        w = f["width"]
        meds = [cell[(w, c)]["ms"] for c in cs]
        if f["alpha_ms"] is None:
            fit_cols = ["-", "-", "-"]
        else:
            rel = max(abs(r) for r in f["residuals_rel"])
            fit_cols = [f"{f['alpha_ms']:.2f}", f"{f['beta_ms_per_token'] * 1e3:.3f}",
                        f"{f['max_abs_residual_ms']:.2f} ({rel:.1%})"]
        rows.append([w, *[f"{m:.2f}" for m in meds], *fit_cols])
    headers = ["rows", *[f"T({c}) ms" for c in cs], "alpha ms", "beta ms/1k tok", "max |residual| ms"]
    m = out["model"]
    n = out["machine"]["threads"]
    head = (f"verify time on {out['machine']['cpu']} ({n} thread{'s' if n != 1 else ''}), "
            f"{Path(m['path']).name} ({m['size_bytes'] / 2**20:.1f} MiB)\n"
            f"median over {out['passes']} passes of the per-pass median of {out['rounds'] - out['warmup']} verifies "
            f"after {out['warmup']} warm-ups; fit T(c) = alpha + beta*c over the contexts\n")
    return head + tabulate(rows, headers=headers, disable_numparse=True, stralign="right") + "\n"


def write_plot(path: Path, survey, model_name: str) -> None:
    """Verify time against rows, one line per context; the bars span the passes' medians."""
    series = {}
    for c in survey.contexts:
        cells = [survey.cells[(w, c)] for w in survey.widths]
        per_pass = [cell.pass_medians(survey.warmup) for cell in cells]
        series[f"ctx {c}"] = (survey.widths, [cell.median(survey.warmup) for cell in cells],
                              [min(p) for p in per_pass], [max(p) for p in per_pass])
    line_plot(path, series, x_label="rows verified", y_label="verify ms",
              title=f"verify time, {model_name}", y_zero=True)
