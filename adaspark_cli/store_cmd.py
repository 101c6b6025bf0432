"""``adaspark store show|reset|export|import`` and the alias ``adaspark inspect-store``.

Thin: find the store, call the core (store.Store, store_report.summarize), print.

Which store: ``--store PATH`` names the file; otherwise it is the default store of ``--model``
(default: the default model) with ``--drafter``, on this machine and the device layout the device
options name (``--rpc`` ...: the servers are not reached), as ``adaspark decode`` picks it.
``show`` and ``export`` given only ``--store`` accept a store of any model (they read it, they do
not learn into it); with ``--model`` or ``--drafter`` as well the store must be that model's.
``import`` always checks the file against a model's fingerprint (``--model``, default: the
default model). A store that is corrupt, of an unknown schema or of another model is one error
line, exit code 2, and is never modified; so is one whose learned state is damaged or has a field
this version does not know (``show`` and ``import`` restore it with learned.Learners.from_store).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, Optional

import orjson
import typer
from tabulate import tabulate

from adaspark_cli import console
from adaspark_cli.console import fail, reported
from adaspark_core.base.errors import InputError, StoreError
from adaspark_core.base.files import read_regular
from adaspark_core.base.paths import is_sim
from adaspark_core.candidates.memory import GRAM, MAX_CORPUS_BYTES
from adaspark_core.candidates.memory_file import load as load_memory
from adaspark_core.candidates.memory_file import memory_path
from adaspark_core.candidates.memory_file import save as save_memory
from adaspark_core.decode.runtime import open_model
from adaspark_core.engine import devices
from adaspark_core.engine.devices import DeviceLayout
from adaspark_core.engine.models import DEFAULT_MODEL, KNOWN, default_model_file, resolve_model
from adaspark_core.evaluate.store_report import CONTEXTS, summarize
from adaspark_core.learn.learned import Learners
from adaspark_core.store import store as sm
from adaspark_core.store.fingerprint import fingerprint, fingerprint_key
from adaspark_core.store.store import Store, default_store_path

store_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Show, reset, export or import the learned state. One store per model and machine.",
)

_STORE_HELP = "The store file (default: the store of --model on this machine, in the cache)."
_MODEL_HELP = "GGUF model whose default store to use, and whose fingerprint the store must have (default: the default model)."
_DRAFTER_HELP = "The drafter the store was learned with, as for decode: none, dspark:FILE or model:FILE."
_NO_STORE_HINT = "a store is written by the first decode with a learning arm (adaspark, pinned:N, cost)"


# --- finding and reading a store -------------------------------------------------------------------


def _existing_file(p: Path, what: str) -> Path:
    if not p.is_file():
        raise InputError(f"{what} not found: {p}")
    return p


def _model_file(spec: str, what: str) -> Path:
    """A GGUF file, or a known model's name (adaspark models): its file in the cache, the default's
    only once prepared (a store command runs no llama.cpp to requantise it)."""
    if not os.path.exists(spec) and spec in KNOWN:
        return _default_model_file() if spec == DEFAULT_MODEL else resolve_model(spec)
    return _existing_file(Path(spec), what)


def _default_model_file() -> Path:
    """The default model file if it was prepared (``models.default_model`` requantises it into the
    cache on first use; a store command does not run llama.cpp to make it)."""
    p = default_model_file()
    if not p.is_file():
        raise InputError(f"the default model has not been prepared yet ({p} is missing), so it has no store: "
                         f"run a decode first, or name the store with --store or the model with --model")
    return p


def _drafter_file(spec: Optional[str]) -> Optional[Path]:
    if spec in (None, "", "none"):
        return None
    kind, _, path = spec.partition(":")
    if kind in ("dspark", "model") and path:
        return _model_file(path, "drafter file")
    raise InputError(f"unknown drafter {spec!r}: use none, dspark:FILE or model:FILE")


def locate(store: Optional[Path], model: Optional[str], drafter: Optional[str],
           need_fingerprint: bool = False, layout: DeviceLayout = DeviceLayout()) -> tuple[Path, Optional[dict]]:
    """(store file, the fingerprint it must have, or None for any). ``layout``: where the model's
    layers ran (the device options, as decode takes them; the RPC servers are not reached)."""
    if store is not None and model is None and drafter in (None, "", "none") and layout.local_cpu \
            and not need_fingerprint:
        return store, None
    drafter_file = _drafter_file(drafter)
    if model is not None and is_sim(model):
        model_file = model
    else:
        model_file = _model_file(model, "model file") if model is not None else _default_model_file()
    fp = fingerprint(model_file, drafter_file, layout=devices.recorded(layout).fingerprint())
    return (store if store is not None else default_store_path(fp)), fp


def read_store(path: Path, fp: Optional[dict], hint: str):
    """(Store, the schema of the file on disk), never writing it (store.Store.read)."""
    return Store.read(path, fp, hint)


def _require(path: Path, what: str) -> None:
    if path.is_dir():
        raise InputError(f"{path} is a directory, not a store file")
    if not path.exists():
        raise InputError(f"no store yet at {path}; {what}")


# --- show -----------------------------------------------------------------------------------------


def inspect_store(
    store: Optional[Path] = typer.Option(None, "--store", help=_STORE_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    drafter: Optional[str] = typer.Option(None, "--drafter", help=_DRAFTER_HELP),
    n_gpu_layers: Optional[str] = console.N_GPU_LAYERS,
    device: Optional[str] = console.DEVICE,
    tensor_split: Optional[str] = console.TENSOR_SPLIT,
    rpc: Optional[str] = console.RPC,
    as_json: bool = typer.Option(False, "--json", help="Print the whole summary as one JSON object (every bucket weight)."),
    context: Optional[List[int]] = typer.Option(None, "--context", "-c", min=1, help="A context (tokens) to price the laws at; repeat it (default: 443, 1596 and 8444, the paper's Table 1)."),
    top: int = typer.Option(12, "--top", min=0, help="How many bucket weights the table lists (largest |weight| first)."),
) -> None:
    """Show what a store has learned.

    It lists widths and their classes, each class's context law priced
    as in the paper's Table 1 with its affine fit, levels, the fixed cost D, band rates,
    acceptance coefficients and bucket weights, counts, and the fingerprint it is keyed by."""
    with reported():
        path, fp = locate(store, model, drafter, layout=console.layout(n_gpu_layers, device, tensor_split, rpc))
        _require(path, _NO_STORE_HINT)
        st, file_schema = read_store(path, fp, hint="it was left as is: move it away or run `adaspark store reset`")
        learners = Learners.from_store(st)
        try:
            summary = summarize(st, learners, contexts=context or CONTEXTS, file_schema=file_schema)
        except (ValueError, TypeError, KeyError, ArithmeticError) as e:
            raise StoreError(f"the store {path} holds learned state this version cannot summarise "
                             f"({type(e).__name__}: {e}); it was left as is") from None
        try:
            size = path.stat().st_size
        except OSError:
            size = None
        summary["file_bytes"] = size
        summary["memory"] = _memory_summary(path, st.fingerprint)
        if as_json:
            sys.stdout.write(orjson.dumps(summary).decode() + "\n")
        else:
            sys.stdout.write(render(summary, top=top))


store_app.command("show")(inspect_store)


def _memory_summary(path: Path, fp: dict) -> Optional[dict]:
    """The n-gram memory beside the store (None: there is none); a bad one is reported."""
    if not os.path.lexists(memory_path(path)):
        return None
    summary = load_memory(path, fingerprint_key(fp), cap_mb=None).summary()
    summary["file_bytes"] = memory_path(path).stat().st_size
    return summary


# --- reset, export, import ------------------------------------------------------------------------


@store_app.command("reset")
def reset(
    store: Optional[Path] = typer.Option(None, "--store", help=_STORE_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    drafter: Optional[str] = typer.Option(None, "--drafter", help=_DRAFTER_HELP),
    n_gpu_layers: Optional[str] = console.N_GPU_LAYERS,
    device: Optional[str] = console.DEVICE,
    tensor_split: Optional[str] = console.TENSOR_SPLIT,
    rpc: Optional[str] = console.RPC,
    yes: bool = typer.Option(False, "--yes", "-y", help="Remove it (required: this forgets what was learned)."),
    memory_only: bool = typer.Option(False, "--memory", help="Remove only the n-gram memory beside the store (earlier replies); keep the learners."),
) -> None:
    """Remove the store file and its n-gram memory.

    Whatever they hold goes (corrupt ones too); the learners start from empty on the next decode. Nothing else is touched. With --memory, only
    the n-gram memory goes."""
    with reported():
        layout = console.layout(n_gpu_layers, device, tensor_split, rpc)
        path, _ = locate(store, model, drafter, layout=layout) if store is None else (store, None)
        if path.is_dir():
            raise InputError(f"{path} is a directory, not a store file")
        mem_file = memory_path(path)
        if mem_file.is_dir() and not mem_file.is_symlink():  # a folder's contents are not ours to delete
            raise InputError(f"cannot remove the n-gram memory {mem_file}: it is a directory, which reset "
                             f"leaves to you; nothing was removed")
        targets = [p for p in ([mem_file] if memory_only else [path, mem_file]) if p.exists()]
        what = "n-gram memory" if memory_only else "store"
        if not targets:
            typer.echo(f"no {what} at {mem_file if memory_only else path}; nothing removed")
            return
        if not yes:
            fail(f"this would remove the {'n-gram memory' if memory_only else 'learned state'} at "
                 f"{' and '.join(map(str, targets))}; run again with --yes to remove it")
        try:
            Store.reset(path, extra=[mem_file] if mem_file in targets else [],
                        keep_store=memory_only)
        except OSError as e:  # the file that could not go: the memory goes first, then the store
            raise InputError(f"cannot remove {e.filename or path}: {e.strerror or e}") from None
        typer.echo("removed " + " and ".join(map(str, targets)))


@store_app.command("memorize")
def memorize(
    files: List[Path] = typer.Argument(..., help="UTF-8 text files: each becomes one document of the memory."),
    store: Optional[Path] = typer.Option(None, "--store", help=_STORE_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    drafter: Optional[str] = typer.Option(None, "--drafter", help=_DRAFTER_HELP),
    n_gpu_layers: Optional[str] = console.N_GPU_LAYERS,
    device: Optional[str] = console.DEVICE,
    tensor_split: Optional[str] = console.TENSOR_SPLIT,
    rpc: Optional[str] = console.RPC,
    memory_mb: float = typer.Option(64.0, "--memory-mb", min=0.0, help="The memory's cap: the oldest documents go first when it is full."),
) -> None:
    """Add a corpus to the store's n-gram memory, once.

    As with llama.cpp's static n-gram cache, the fill then proposes continuations of text like it where a request's own text has none. The
    model tokenizes it; the memory is written atomically beside the store."""
    with reported():
        if memory_mb <= 0:
            raise InputError("--memory-mb must be positive to keep anything")
        texts = []
        for f in files:
            try:
                texts.append(read_regular(f, "the corpus file", MAX_CORPUS_BYTES).decode("utf-8"))
            except FileNotFoundError:
                raise InputError(f"the corpus file {f} was not found") from None
            except UnicodeDecodeError:
                raise InputError(f"cannot read the corpus file {f} as UTF-8 text") from None
        path, fp = locate(store, model, drafter, need_fingerprint=True,
                          layout=console.layout(n_gpu_layers, device, tensor_split, rpc))
        lm = open_model(model)
        with Store.open(path, fp) as st:  # the lock: never under a process that is learning into the store
            if not path.exists():
                st.save()  # an empty store, so the memory has its store (store show, reset)
            memory = load_memory(path, fingerprint_key(fp), memory_mb, lm.n_vocab)
            evicted = memory.evicted
            documents = [lm.tokenize(text, False) for text in texts]
            memory.add_many(documents)
            save_memory(memory, path, fingerprint_key(fp))
        lm.close()
        added = sum(len(d) for d in documents if len(d) > GRAM)  # shorter ones hold no n-gram: not kept
        evicted = memory.evicted - evicted
        typer.echo(f"memorized {len(files)} file{'s' if len(files) > 1 else ''}: {added:,} tokens added, "
                   f"{memory.n_tokens:,} in {memory_path(path)}"
                   + (f"; the {memory_mb:g} MB cap evicted the oldest {evicted:,}" if evicted else ""))


@store_app.command("export")
def export(
    file: Path = typer.Argument(..., help="Where to write the copy (replaced if it exists)."),
    store: Optional[Path] = typer.Option(None, "--store", help=_STORE_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    drafter: Optional[str] = typer.Option(None, "--drafter", help=_DRAFTER_HELP),
    n_gpu_layers: Optional[str] = console.N_GPU_LAYERS,
    device: Optional[str] = console.DEVICE,
    tensor_split: Optional[str] = console.TENSOR_SPLIT,
    rpc: Optional[str] = console.RPC,
) -> None:
    """Copy the store to FILE, atomically. It is checked to be a readable store first."""
    hint = "nothing was exported"
    with reported():
        path, fp = locate(store, model, drafter, layout=console.layout(n_gpu_layers, device, tensor_split, rpc))
        _require(path, hint)
        st, _ = read_store(path, fp, hint=hint)
        if file.is_dir():
            raise InputError(f"{file} is a directory; name the file to write")
        for what, own in (("the store itself", path), ("the store's n-gram memory", memory_path(path))):
            if os.path.realpath(file) == os.path.realpath(own):
                raise InputError(f"{file} is {what}; {hint}")
        try:
            Store.export(path, file)  # reads once more: what it checks is what it copies
        except OSError as e:
            raise InputError(f"cannot write {file}: {e.strerror or e}; {hint}") from None
        typer.echo(f"exported {path} to {file} ({_counts(st)})")


@store_app.command("import")
def import_(
    file: Path = typer.Argument(..., help="A store file, e.g. written by `adaspark store export`."),
    store: Optional[Path] = typer.Option(None, "--store", help=_STORE_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m", help=_MODEL_HELP),
    drafter: Optional[str] = typer.Option(None, "--drafter", help=_DRAFTER_HELP),
    n_gpu_layers: Optional[str] = console.N_GPU_LAYERS,
    device: Optional[str] = console.DEVICE,
    tensor_split: Optional[str] = console.TENSOR_SPLIT,
    rpc: Optional[str] = console.RPC,
    force: bool = typer.Option(False, "--force", help="Import a store of another model or machine (its fingerprint is rewritten), and replace a different store already there."),
) -> None:
    """Install FILE as the store of a model on this machine. FILE must be a readable store with the
    same fingerprint (model, drafter, machine); a different store already in place is kept. --force
    overrides both. Written atomically; FILE is not modified."""
    hint = "nothing was imported"
    with reported():
        path, fp = locate(store, model, drafter, need_fingerprint=True,
                          layout=console.layout(n_gpu_layers, device, tensor_split, rpc))
        if file.is_dir():
            raise InputError(f"{file} is a directory, not a store file; {hint}")
        src, _ = read_store(file, None, hint=hint)
        Learners.from_store(src, hint=hint)  # a damaged learner section is refused here, not at the next decode
        foreign = not sm.same_fingerprint(src.fingerprint, fp)
        if foreign and not force:  # read it again against fp: the mismatch error names the fields
            read_store(file, fp, hint=hint + " (use --force to import it anyway)")
        if path.is_dir():
            raise InputError(f"{path} is a directory, not a store file; {hint}")
        if path.exists():
            if file.resolve() == path.resolve() and not foreign:
                typer.echo(f"{file} is already the store at {path}; nothing changed")
                return
            try:
                cur, _ = read_store(path, None, hint=hint)
            except StoreError:
                cur = None
            if cur is not None and _same(cur, fp, src):
                typer.echo(f"the store at {path} already holds this state; nothing changed")
                return
            if not force:
                fail(f"a different store is already at {path} ({_counts(cur)}); {hint}: export it first, "
                     f"or use --force to replace it" if cur is not None else
                     f"{path} exists and is not a readable store; {hint} (use --force to replace it)")
        try:
            sm.Store.import_(file, path, fp, force=force)
        except OSError as e:
            raise InputError(f"cannot write {path}: {e.strerror or e}; {hint}") from None
        note = " (its fingerprint was rewritten to this model and machine)" if foreign else ""
        typer.echo(f"imported {file} into {path} ({_counts(src)}){note}")


def _same(cur, fp: dict, src) -> bool:
    return sm.same_fingerprint(cur.fingerprint, fp) and cur.counts == src.counts and cur.sections == src.sections


def _counts(st) -> str:
    return f"{st.counts['requests']} requests, {st.counts['rounds']} rounds"


# --- the human report ---------------------------------------------------------------------------------


def _f(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _ctx(c) -> str:
    return f"{int(c):,}"


def _band(b: dict) -> str:
    lo, hi = b["contexts"]
    return f"{b['band']} ({lo:,}-{hi:,})"


def _table(rows: list, head: list, left: int = 1) -> str:
    """A table whose first ``left`` columns are text (left-aligned) and the rest numbers (right)."""
    return tabulate(rows, head, disable_numparse=True, colalign=("left",) * left + ("right",) * (len(head) - left))


def render(s: dict, top: int = 12) -> str:
    """``adaspark store show``'s text: the summary of inspect.summarize as tables."""
    out: list[str] = []
    fp = s["fingerprint"]
    size = f", {s['file_bytes']:,} bytes" if s.get("file_bytes") is not None else ""
    upgrade = (f", file schema {s['file_schema']} (upgraded on the next save)"
               if s.get("file_schema") not in (None, s["schema"]) else "")
    out.append(f"Store {s['path']}")
    mach = fp.get("machine") or {}
    drafter = fp.get("drafter")
    ident = [
        ["file", f"schema {s['schema']}{upgrade}, updated {s['updated'] or '-'}{size}"],
        ["key", fp["key"]],
        ["model", _ident(fp.get("model"))],
        ["drafter", _ident(drafter) if drafter else "none (n-gram candidates only)"],
        ["machine", f"{mach.get('cpu', '-')}, {mach.get('cpus', '-')} CPUs, {mach.get('arch', '-')}, "
                    f"llama-cpp-python {mach.get('llama_cpp_python') or '-'}"],
        ["layout", devices.describe(fp.get("layout"))],
    ]
    out.append(tabulate(ident, tablefmt="plain", disable_numparse=True))
    n = s["counts"]
    out.append(f"Seen: {n['requests']} requests, {n['rounds']} rounds (cost model {n['cost_rounds']} rounds, "
               f"chooser {n['chooser_rounds']} rounds, acceptance model {n['acceptance_requests']} requests)")

    cost, ch = s["cost"], s["chooser"]
    ctxs = cost["contexts"]
    measuring = f"measuring {cost['measuring']}" if cost["measuring"] is not None else "none measuring"
    inc = f"incumbent {ch['incumbent']}, held {ch['held']} rounds" if ch["incumbent"] is not None else "no incumbent yet"
    out.append(f"\nLearned widths: {' '.join(map(str, cost['widths']))} ({inc}; {measuring})")
    out.append(f"Round fixed cost D now: {cost['d_now_ms']:.3f} ms (median of the last {len(cost['d_recent_ms'])} rounds)")

    lo, hi = ctxs[0], ctxs[-1]
    fit_note = f" and its fit T(c) = alpha + beta c over {_ctx(lo)}-{_ctx(hi)} tokens" if lo < hi else ""
    out.append(f"\nVerify-cost classes: the law's time (ms) at {len(ctxs)} contexts{fit_note} (paper Table 1)")
    rows = []
    for k in cost["classes"]:
        law, fit = k["law"], k["law"]["fit"]
        r0, r1 = k["rows"]
        bank = law["bank"]["contexts"]
        rows.append([k["width"], f"{r0}-{r1}" if r0 < r1 else str(r1), k["count"], law["samples"],
                     *[_f(law["time_ms"][str(c)]) for c in ctxs],
                     _f(fit and fit["alpha_ms"]), _f(fit and fit["beta_ms_per_1k"], ".3f"), _pct(fit and fit["max_residual"]),
                     _f(law["lowest_ms"]), f"{bank[0]:,}-{bank[1]:,}" if bank else "-"])
    head = ["width", "rows", "verifies", "samples", *[f"T({_ctx(c)})" for c in ctxs],
            "alpha (ms)", "beta (ms/1k)", "max resid", "lowest", "bank contexts"]
    out.append(_table(rows, head, left=2))

    out.append("\nPrices the chooser reads (Eq. 5: law x level x D clock), ms; "
               "'a -> b': a wider class is cheaper, so the width is offered at b")
    rows = []
    for k in cost["classes"]:
        cells = []
        for c in ctxs:
            own, offered = k["price_ms"][str(c)], k["offered_price_ms"][str(c)]
            cells.append(_f(own) if offered is None or own is None or abs(own - offered) < 1e-9
                         else f"{own:.2f} -> {offered:.2f}")
        rows.append([k["width"], "yes" if k["measured"] else "no", _f(k["d_ref_ms"], ".3f"), *cells])
    out.append(_table(rows, ["width", "measured", "D_k (ms)", *[f"price({_ctx(c)})" for c in ctxs]], left=2))

    rows = [[k["width"], _band(lv), len(lv["window"]), _f(lv["factor"], ".3f"), _f(lv["window"][-1] if lv["window"] else None, ".3f")]
            for k in cost["classes"] for lv in k["levels"]]
    out.append("\nLevels per context band (measured / law over the last verifies; the factor is their minimum, clamped)")
    out.append(_table(rows, ["width", "band (contexts)", "verifies", "factor", "newest"], left=2)
               if rows else "(none yet)")

    out.append(f"\nBand rates rho (committed tokens over time, decayed; used once a band has {ch['band_min_rounds']} rounds)")
    rows = [[_band(b), b["rounds"], _f(b["rho_tokens_per_ms"], ".4f"), _f(1000 * b["rho_tokens_per_ms"], ".1f"),
             "yes" if b["in_use"] else "no"] for b in ch["bands"]]
    out.append(_table(rows, ["band (contexts)", "rounds", "rho (tok/ms)", "rho (tok/s)", "in use"])
               if rows else "(none yet)")

    a = s["acceptance"]
    out.append(f"\nAcceptance model: {a['requests']} requests; {_guard(a['guard'])}")
    learned = [c for c in a["coefficients"] if c["labels"] or c["left_prior"]]
    if learned:
        out.append(_table([[c["name"], c["meaning"], _f(c["weight"], ".4f"), _f(c["prior"], ".4f"), c["labels"]]
                           for c in learned], ["coefficient", "term", "weight", "prior", "labels"], left=2))
    idle = [c["name"] for c in a["coefficients"] if not (c["labels"] or c["left_prior"])]
    if idle:
        out.append(f"at their prior, no labels: {' '.join(idle)}")
    out += _buckets(a, top)
    r = s.get("sampled")
    if r is None:
        out.append("\nSampled regime: none yet (the learners of sampled requests, copied from these at the first)")
    else:
        n = r["counts"]
        out.append(f"\nSampled regime (temperature > 0, copied from the greedy learners at the first sampled "
                   f"request): acceptance model {n['acceptance_requests']} requests, cost model {n['cost_rounds']} "
                   f"rounds; {_guard(r['acceptance']['guard'])}")
        out += _buckets(r["acceptance"], top)
    m = s.get("memory")
    if m is None:
        out.append("\nN-gram memory: none yet (it keeps the replies of learning arms with n-gram candidates)")
    else:
        out.append(f"\nN-gram memory: {m['documents']:,} documents, {m['tokens']:,} tokens, {m['ngrams']:,} n-grams "
                   f"({m['distinct_ngrams']:,} distinct), {m['mb']:.1f} MB in memory, "
                   f"{m['file_bytes']:,} bytes on disk, {m['evicted_tokens']:,} tokens evicted")
        out.append(f"  lookups {m['lookups']:,}, found a continuation {_pct(m['hit_rate'])}; memory nodes verified "
                   f"{m['rows']:,}, accepted {m['accepted']:,} ({_pct(m['acceptance'])})")
    return "\n".join(out) + "\n"


def _guard(gd: dict) -> str:
    return (f"guard: priced by {gd['priced_by']} (log loss per node: head-based {_f(gd['head_loss_per_node'], '.4f')}, "
            f"fitted {_f(gd['fitted_loss_per_node'], '.4f')}, over {gd['labelled_parents']} labelled parents)")


def _buckets(a: dict, top: int) -> list[str]:
    """An acceptance model's bucket weights, the ``top`` largest by |weight|."""
    b = a["buckets"]
    shown = b[:top]
    out = [f"\nBucket weights: {len(b)} buckets, {a['buckets_moved']} moved from 0"
           + (f"; the {len(shown)} largest by |weight| (--json lists all)" if len(shown) < len(b) else "")]
    if shown:
        out.append(_table([[x["key"], x["kind"], _f(x["weight"], "+.4f"), x["labels"]] for x in shown],
                          ["bucket", "kind", "weight", "labels"], left=2))
    return out


def _ident(x) -> str:
    if not isinstance(x, dict):
        return "-"
    size = x.get("size")
    return f"{size:,} bytes, sha256 {x.get('sha256')}" if isinstance(size, int) else f"sha256 {x.get('sha256')}"
