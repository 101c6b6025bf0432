"""``adaspark compare``: arms side by side over the shared test set (adaspark_core/evaluate/compare.py),
the paper's statistics (adaspark_core/evaluate/stats.py) as tables, a PNG and a JSON file."""

from __future__ import annotations

import dataclasses
import functools
import platform
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import List, Optional

import orjson
import typer
from tqdm import tqdm

from adaspark_cli import console
from adaspark_cli.compare_report import figure, tables
from adaspark_cli.console import reported
from adaspark_cli.plot import missing
from adaspark_core.base.errors import InputError
from adaspark_core.base.files import landing, read_regular, replace
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.runtime import EngineOptions, Runtime
from adaspark_core.engine.devices import DeviceLayout, parse_layout
from adaspark_core.engine.simlm import SimModel
from adaspark_core.evaluate import compare as cmp
from adaspark_core.evaluate import testset, tracesim
from adaspark_core.evaluate.json_workload import extraction_set
from adaspark_core.evaluate.stats import summarize
from adaspark_core.serve.tool_calls import format_of, openai_reply
from adaspark_core.store.fingerprint import fingerprint

RESULTS = "compare.json"
DEFAULT_ARMS = "ar,pld:3,pld:10,chain:3,tree:16,cost,adaspark,pinned:4,pinned:8,pinned:16"


def compare(
    model: Optional[str] = console.MODEL,
    drafter: str = console.DRAFTER,
    block: Optional[int] = console.BLOCK,
    draft_top_k: int = console.DRAFT_TOP_K,
    arms: str = typer.Option(DEFAULT_ARMS, "--arms", help="Comma-separated: ar (always run: the baseline), pld:N, chain:N, block-chain, tree:N, cost, adaspark, pinned:N, and llama.cpp's llama-server (make peer) as llama:ar, llama:SPEC[:N:M] or llama:draft:N[:P] (docs/comparing.md)."),
    sets: Optional[List[Path]] = typer.Option(None, "--sets", help="A folder of conversation sets, set files (.json) or prompt files; repeat it (default: ../shared/testset, else fixtures/testset)."),
    subset: str = typer.Option("eval", "--subset", help="eval (the paper's evaluation subset rule), short (first two turns of each source's first conversation) or all."),
    max_turns: Optional[int] = typer.Option(None, "--max-turns", min=1, help="Keep only the first K turns of every conversation (1: first turns only)."),
    json_workload: bool = typer.Option(False, "--json-workload", help="Answer JSON extraction requests made from the workload's documents instead, each under its JSON schema in every arm (pld:N takes no grammar); counts the replies that follow their schema (docs/comparing.md)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="Reply cap; capped replies count in the first-N ratio and are left out of the paper's."),
    repeat: int = typer.Option(1, "--repeat", min=1, help="Decode every reply K times and keep the median speed."),
    out: Optional[Path] = typer.Option(None, "--out", help="Folder for compare.json (every reply, the summary, machine, model hash, versions) and ratios.png."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object instead of tables."),
    n_ctx: Optional[int] = console.N_CTX,
    threads: Optional[int] = console.THREADS,
    n_gpu_layers: Optional[str] = console.N_GPU_LAYERS,
    device: Optional[str] = console.DEVICE,
    tensor_split: Optional[str] = console.TENSOR_SPLIT,
    rpc: Optional[str] = console.RPC,
    rpc_timeout: float = console.RPC_TIMEOUT,
    resamples: int = typer.Option(2000, "--resamples", min=100, help="Bootstrap resamples (seeded)."),
    warm: int = typer.Option(0, "--warm", min=0, help="Run the learning arms over the workload K times, untimed, before measuring (0: a cold store)."),
    logs: Optional[Path] = typer.Option(None, "--logs", help="Folder for a round log per AdaSpark arm (adaspark.jsonl, ...; warm passes: warm-<arm>.jsonl), for replay."),
    warm_on: str = typer.Option("all", "--warm-on", help="all, or first-half: warm on the first half of each source's conversations and report the seen and unseen halves apart."),
    memory_mb: float = typer.Option(64.0, "--memory-mb", min=0.0, help="Cap of each learning arm's n-gram memory of its own earlier replies; 0: none."),
    temperature: float = console.TEMPERATURE,
    sample_top_k: int = console.SAMPLE_TOP_K,
    top_p: float = console.TOP_P,
    min_p: float = console.MIN_P,
    seed: int = typer.Option(0, "--seed", callback=console.seed_in_range, help="Sampling: the seed every arm samples with (so arms sample the same text)."),
    reuse_prefix: bool = typer.Option(True, "--reuse-prefix/--no-reuse-prefix", help="Prefill only what follows the KV the last reply left (the AdaSpark arms; decode speed is timed after the prefill either way)."),
    chat_template_file: Optional[Path] = console.CHAT_TEMPLATE_FILE,
    peer_rpc: Optional[List[str]] = typer.Option(None, "--peer-rpc", help="With --rpc: the RPC servers (HOST:PORT,...) of one llama: arm, repeated for each in order. A llama.cpp RPC server serves one client at a time, so every llama-server arm needs servers of its own (docs/devices.md)."),
) -> None:
    """Run arms side by side over the same conversations.

    Each arm carries its own replies as history; the report gives decode speed over ar per source, overall and by context band with 95% bootstrap
    intervals over conversations (paper 4.1, Tables 3, 4, 6, 8, 10, Figure 8)."""
    with reported():
        if subset not in cmp.SUBSETS:
            raise InputError(f"unknown subset {subset!r}: use {', '.join(cmp.SUBSETS)}")
        how = console.sampling(temperature, sample_top_k, top_p, min_p, seed)
        _check_warm_on(warm_on)
        convs = load_workload(sets, subset, max_turns, json_workload)
        warm_convs = testset.first_halves(convs) if warm_on == "first-half" else None
        if logs is not None and logs.exists() and not logs.is_dir():
            raise InputError(f"--logs wants a folder: {logs} is a file")
        if out is not None:  # found unwritable now, not after the whole run
            landing(out / RESULTS)
        with Runtime.open(EngineOptions(model=model, n_ctx=n_ctx, threads=threads,
                                        layout=console.layout(n_gpu_layers, device, tensor_split, rpc, rpc_timeout), drafter=drafter, block=block,
                                          draft_top_k=draft_top_k, reuse_prefix=reuse_prefix,
                                          chat_template=console.chat_template(chat_template_file))) as rt:
            names, replies = _run(rt, arms, convs, max_tokens, repeat, warm, logs, memory_mb, warm_convs, how,
                                  schemas=json_workload, peer_rpc=peer_rpc)
            turns, skipped = sum(len(c.turns) for c in convs), cmp.left_out(convs, replies, names[0])
            fit = (f"the context of {rt.target.n_ctx} tokens (a prompt plus --max-tokens {max_tokens} must fit: "
                   f"raise --n-ctx or lower --max-tokens)")
            if skipped == turns:
                raise InputError(f"no turn of the workload fits {fit}")
            if skipped:
                sys.stderr.write(f"adaspark: note: {skipped} of {turns} turns left out: their conversations "
                                 f"outgrew {fit}\n")
            summary = _summary(replies, names, resamples, held_out=warm_convs is not None and warm > 0)
            if out is not None:
                write_results(out, replies, summary, rt.model, rt.drafter, names,
                              {"max_tokens": max_tokens, "subset": subset, "repeat": repeat, "n_ctx": rt.target.n_ctx,
                               "warm": warm, "warm_on": warm_on, "logs": str(logs) if logs is not None else None, "reuse_prefix": reuse_prefix,
                               "memory_mb": memory_mb, "sampling": how.describe() if how else None, "seed": seed if how else None,
                               "json_workload": json_workload,
                               "sets": [str(s) for s in sets or []] or [str(testset.default_dir())]})
                png = out / "ratios.png"
                skipped = missing()  # matplotlib is an optional extra: without it, a note instead of the figure
                if skipped or figure(summary, png, title=f"{rt.model.path.name}: decode speed over ar") is None:
                    png.unlink(missing_ok=True)  # an older run's figure would pass for this one's
                    sys.stderr.write(f"adaspark: {skipped or 'no ratio to plot'}: {png} not written\n")
        if as_json:
            sys.stdout.write(orjson.dumps(summary).decode() + "\n")
        else:
            store = f"warm store ({warm} untimed pass{'es' if warm > 1 else ''} first)" if warm else "cold store"
            what = "JSON extraction requests" if json_workload else "conversations"
            sys.stdout.write(f"model {rt.model.path.name}, {len(convs)} {what}, replies capped at {max_tokens} "
                             f"tokens, subset {subset}, learning arms from a {store}\n")
            sys.stdout.write(_tables(summary, replies))


def _check_warm_on(warm_on: str) -> None:
    if warm_on not in ("all", "first-half"):
        raise InputError(f"unknown --warm-on {warm_on!r}: use all or first-half")


def _summary(replies: list[dict], names: list[str], resamples: int, held_out: bool) -> dict:
    """compare's and simulate's summary; with ``held_out``, the halves the warm passes saw and
    did not see (``--warm-on first-half``) apart as well."""
    summary = summarize(replies, names, baseline="ar", resamples=resamples, band_by="midpoint")
    if held_out:
        summary["held_out"] = {half: summarize(part, names, baseline="ar", resamples=resamples, band_by="midpoint")
                               for half, seen in (("seen", True), ("unseen", False))
                               if (part := [r for r in replies if r["warmed"] == seen])}
    return summary


def _tables(summary: dict, replies: list[dict]) -> str:
    out = tables(summary)
    for half, what in (("seen", "the warm passes saw"), ("unseen", "the warm passes did not see (held out)")):
        if half in summary.get("held_out", {}):
            n = len({r["conversation"] for r in replies if r["warmed"] == (half == "seen")})
            out += f"\nThe {n} conversations {what}\n" + tables(summary["held_out"][half])
    return out


def _run(rt: Runtime, arms: str, convs, max_tokens: int, repeat: int, warm: int, logs, memory_mb: float = 0.0,
         warm_convs=None, sampling=None, schemas: bool = False, peer_rpc: Optional[List[str]] = None):
    """Every arm over ``convs`` on the runtime's target and drafter: (arm names, replies).
    ``schemas``: the replies follow JSON schemas (``cmp.make_arms``); ``peer_rpc``: each
    llama-server arm's own RPC servers (``--peer-rpc``)."""
    lm, target = rt.model, rt.target
    layout = getattr(lm, "layout", DeviceLayout())
    peer_args = None
    if layout.rpc and any(a.strip().startswith("llama:") for a in arms.split(",")):
        if not peer_rpc:
            raise InputError("--rpc with llama: arms needs --peer-rpc: a llama.cpp RPC server serves one client at "
                             "a time, so each llama-server arm needs servers of its own")
        peer_args = [tuple(dataclasses.replace(layout, rpc=parse_layout(rpc=e).rpc).server_args()) for e in peer_rpc]
    elif peer_rpc:
        raise InputError("--peer-rpc goes with --rpc and llama: arms")

    def prompt_lookup():
        if isinstance(lm, SimModel):
            raise InputError(f"pld arms run llama-cpp-python's own decoder: they need a GGUF model, not {lm.path}")
        if not lm.layout.local_cpu:
            raise InputError("pld arms run llama-cpp-python's own decoder on the CPU: not with --n-gpu-layers, "
                             "--device, --tensor-split or --rpc")
        from adaspark_core.engine.prompt_lookup import PromptLookupDecoder  # a simulated run never loads llama.cpp

        return PromptLookupDecoder(lm.path, target.n_ctx, target.threads)

    if isinstance(lm, SimModel) and any(a.strip().startswith("llama:") for a in arms.split(",")):
        raise InputError(f"llama: arms run llama.cpp's llama-server: they need a GGUF model, not {lm.path}")
    arm_list = cmp.make_arms(arms.split(","), target, rt.drafter, prompt_lookup, lm.is_eog, model_path=lm.path,
                             n_ctx=target.n_ctx, threads=rt.threads, memory_mb=memory_mb,
                             sampling=sampling, schemas=schemas,
                             device_args=tuple(layout.server_args()), peer_device_args=peer_args)
    try:
        with tqdm(total=cmp.steps(convs, arm_list, warm, warm_convs), desc="compare", unit="reply", file=sys.stderr,
                  disable=None) as bar:
            replies = cmp.run(convs, arm_list, chat(lm), target.n_ctx, max_tokens, repeat,
                              progress=bar.update, warm=warm, log_dir=logs, warm_convs=warm_convs)
    finally:
        cmp.close_arms(arm_list)  # stop the llama-server peers
    return [a.name for a in arm_list], replies


def chat(lm) -> cmp.Chat:
    """The model's chat template, and where it takes tools, the server's way with them: a tool
    conversation's tools and calls go through the template, our arms hold its calls to their
    schema (the lazy grammar of ``tool_choice: auto``) and calls are read in its format."""
    fmt = format_of(lm.chat_template) if lm.takes_tools() else None
    if fmt is None:
        return cmp.Chat(lm.chat_prompt)
    return cmp.Chat(lm.chat_prompt, functools.partial(openai_reply, fmt=fmt),
                    lambda tools: (fmt.value_start, fmt.calls_schema([t["function"] for t in tools])))


def load_workload(sets: Optional[List[Path]], which: str, max_turns: Optional[int] = None,
                  json_requests: bool = False):
    """Conversations of the given folders, set files and prompt files (default: testset.default_dir()),
    each source cut to the subset, each conversation to its first ``max_turns`` turns; with ``json_requests``,
    the JSON extraction requests their documents give (json_workload.extraction_set)."""
    paths = list(sets or [testset.default_dir()])
    convs = []
    for p in paths:
        if p.is_dir():
            files = sorted(p.glob("*.json"), key=lambda f: testset.SOURCE_ORDER.index(f.stem)
                           if f.stem in testset.SOURCE_ORDER else len(testset.SOURCE_ORDER))
            if not files:
                raise InputError(f"no conversation sets (*.json) in {p}")
        elif not p.exists():
            raise InputError(f"no such set or prompt file: {p}")
        else:  # a file, or what is there instead (a device, a FIFO): its reader refuses it by name
            files = [p]
        for f in files:
            if f.suffix == ".json":
                in_set, already_eval = testset.read_set(f)
                convs += cmp.subset(in_set, which, already_eval)
                continue
            try:
                raw = read_regular(f, "the prompt file", console.MAX_PROMPT_BYTES)
            except FileNotFoundError:
                raise InputError(f"no such set or prompt file: {f}") from None
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InputError(f"cannot read the prompt file {f} as UTF-8 text") from None
            if not text.strip():
                raise InputError(f"prompt file is empty: {f}")
            convs.append(cmp.prompt_conversation(f, text))
    if not convs:
        raise InputError("the workload is empty")
    if max_turns is not None:
        convs = [dataclasses.replace(c, turns=c.turns[:max_turns]) for c in convs]
    if json_requests:
        convs = extraction_set(convs)
        if not convs:
            raise InputError("--json-workload: the workload holds no document to extract from (the convfinqa, "
                             "toolace, longbench and specbench sets hold them)")
    return convs


def write_results(out: Path, replies, summary, lm, drafter, arms, settings) -> None:
    """compare.json: enough to report the run and re-plot it."""
    def ver(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    fp = fingerprint(lm.path, drafter.model.path if drafter is not None else None)
    doc = {
        "model": {"path": str(lm.path), **fp["model"]},
        "drafter": {"path": str(drafter.model.path), **fp["drafter"]} if drafter is not None else None,
        "machine": {**fp["machine"], "python": platform.python_version()},
        "packages": {p: ver(p) for p in ("adaspark", "llama-cpp-python", "numpy")},
        "arms": arms,
        "settings": settings,
        "summary": summary,
        "replies": replies,
    }
    replace(out / RESULTS, orjson.dumps(doc, option=orjson.OPT_INDENT_2))


def simulate(
    traces: List[Path] = typer.Argument(..., help="Trace files (JSON lines): compare --logs DIR writes DIR/traces.jsonl, the baseline's prompts and replies."),
    costs: List[Path] = typer.Option(..., "--costs", help="Round logs whose verify times price the simulated verifies (repeat it; a bench's logs of several arms measure several widths)."),
    arms: str = typer.Option("ar,chain:3,pinned:4,adaspark", "--arms", help="Comma-separated scheduler arms: ar, chain:N, tree:N, pinned:N, cost, adaspark (ar always runs: it is the baseline)."),
    warm: int = typer.Option(0, "--warm", min=0, help="Run the learning arms over the traces K times first, untimed: a warm store."),
    warm_on: str = typer.Option("all", "--warm-on", help="all, or first-half: warm on the traces of the first half of each source's conversations and report the seen and unseen halves apart."),
    logs: Optional[Path] = typer.Option(None, "--logs", help="Folder for one round log per arm (for adaspark replay --regret)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the simulated verify-time interference."),
    resamples: int = typer.Option(2000, "--resamples", min=100, help="Bootstrap resamples (seeded)."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object instead of tables."),
) -> None:
    """Decode recorded greedy replies on a virtual clock.

    The scheduler and learners are the real ones, the verify times measured ones: what each arm's choices earn on the machine the cost logs
    came from, in seconds instead of a bench's minutes (host time left out). Same tables as
    compare."""
    with reported():
        names = [parse_arm(a).name for a in arms.split(",") if a.strip()]
        names = ["ar"] + [a for a in names if a != "ar"]
        if len(set(names)) != len(names):
            raise InputError(f"an arm is named twice in --arms {arms!r}")
        if logs is not None and logs.exists() and not logs.is_dir():
            raise InputError(f"--logs wants a folder: {logs} is a file")
        _check_warm_on(warm_on)
        cost_table = tracesim.MeasuredCosts(costs)
        workload = tracesim.read_traces(traces)
        seen = tracesim.first_half_conversations(workload) if warm_on == "first-half" else None
        replies = tracesim.simulate(workload, names, cost_table, warm=warm, log_dir=logs, seed=seed, warm_on=seen)
        summary = _summary(replies, names, resamples, held_out=seen is not None and warm > 0)
        if as_json:
            sys.stdout.write(orjson.dumps(summary).decode() + "\n")
        else:
            store = f"warm store ({warm} untimed pass{'es' if warm > 1 else ''} first)" if warm else "cold store"
            sys.stdout.write(f"simulated: {len(workload)} traced replies, verify times from {len(costs)} log(s) "
                             f"(widths {', '.join(map(str, cost_table.table.widths))}), learning arms from a {store}; "
                             f"host time not simulated\n")
            sys.stdout.write(_tables(summary, replies))
