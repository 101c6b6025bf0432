"""Benchmarks: speeds measured side by side in one run, printed as tables. Not tests.

    python -m benchmarks.bench smoke [--max-tokens N] [--passes K] [--json]
    python -m benchmarks.bench quant [--json]
    python -m benchmarks.bench memory [--tokens N] [--rounds K]
    python -m benchmarks.bench step [--context C]
    python -m benchmarks.bench load [--clients 1,4] [--requests N] [--repeats K]
    python -m benchmarks.bench onerow LOGS [--json]
    python -m benchmarks.bench rpc [--delays 0,0.5,2] [--arms ...] [--max-tokens N] [--warm K]

A bad argument is one line on stderr and exit code 2, as for adaspark's own commands.

``smoke`` decodes three bundled prompts (one copy-heavy) with ar, chain:4, tree:8 and tree:16,
the arms interleaved and each pass in the opposite order of the last, and reports decode tok/s
(median over passes), the ratio to ar, tokens per round and the engine's host time per round.
``quant`` times pinned-width verifies of the shipped Q4_1 default model against its Q4_0 copy.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Optional

import orjson
import typer
from tabulate import tabulate

from adaspark_cli import console
from adaspark_core.base import tree
from adaspark_core.base.tree import ANCHOR, NGRAM
from adaspark_core.candidates.drafters import make_drafter
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation, run
from adaspark_core.engine.llama import LlamaModel
from adaspark_core.engine.llama_target import LlamaTarget
from adaspark_core.engine.models import default_model, shipped_default
from adaspark_core.evaluate.replay import expected_accepted
from adaspark_core.evaluate.survey import pinned_verify_ms  # chain verify at a fixed context, warm-ups dropped
from adaspark_core.evaluate.testset import load_sources, shared_dir, user_message
from adaspark_core.learn.chooser import AdaptiveWidth
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import RoundLog

PROMPTS = Path(__file__).resolve().parent.parent / "fixtures" / "prompts"


def benchmark_sets() -> Path:
    """The benchmark workload (../shared/testset), never the tests' excerpt: refused if missing."""
    if not shared_dir().is_dir():
        raise SystemExit(f"the benchmark workload {shared_dir()} is missing (fixtures/testset is only the tests' excerpt)")
    return shared_dir()
SMOKE_PROMPTS = ["rewrite.txt", "explain.txt", "story.txt"]  # rewrite.txt is the copy-heavy task
SMOKE_ARMS = ["ar", "chain:4", "tree:8", "tree:16"]
MAX_CLIENTS = 64  # adaspark serve's --parallel at most

app = typer.Typer(add_completion=False, no_args_is_help=True)


@app.callback()
def _main() -> None:
    """AdaSpark benchmarks."""


class TimedPolicy(AdaptiveWidth):
    """The adaptive width policy, timing its own Python work per round (decide + learn), the
    end-of-request refits apart."""

    def __init__(self):
        super().__init__()
        self.ms = 0.0
        self.refit_ms = 0.0
        self.rounds = 0

    def decide(self, *a, **kw):
        t0 = time.perf_counter()
        try:
            return super().decide(*a, **kw)
        finally:
            self.ms += (time.perf_counter() - t0) * 1e3

    def learn(self, rec):
        t0 = time.perf_counter()
        super().learn(rec)
        dt = (time.perf_counter() - t0) * 1e3
        if rec.last:
            self.refit_ms += dt
        else:
            self.ms += dt
            self.rounds += 1


def side_by_side(lm, target, arm_list, prompt_names, passes, max_tokens, learners=None):
    """Decode every prompt with every arm, the arms interleaved and each pass in the opposite
    order of the last. Returns {(prompt, arm): [run, ...]}."""
    runs: dict[tuple[str, str], list[dict]] = {}
    for k in range(passes):
        for name in prompt_names:
            prompt = lm.chat_prompt([{"role": "user", "content": (PROMPTS / name).read_text()}])
            for arm in (arm_list if k % 2 == 0 else arm_list[::-1]):
                gen = run(target, prompt, arm, max_tokens, learners=learners if arm.learns else None)
                st = gen.stats
                runs.setdefault((name, arm.name), []).append(
                    {"tps": st.decode_tps or 0.0, "tpr": st.tokens_per_round, "tokens": gen.tokens,
                     "host_ms": st.host_ms / max(st.rounds, 1), "widths": st.widths})
    return runs


def report(runs, arm_list, prompt_names, title, as_json, extra=None) -> None:
    """One table row per (prompt, arm): median tok/s over passes and the ratio to the first arm."""
    rows, out = [], []
    first = arm_list[0].name
    for name in prompt_names:
        base = statistics.median(r["tps"] for r in runs[(name, first)])
        base_text = runs[(name, first)][0]["tokens"]
        for arm in arm_list:
            rs = runs[(name, arm.name)]
            tps = statistics.median(r["tps"] for r in rs)
            widths = sum((r["widths"] for r in rs), Counter())
            row = {"prompt": name, "arm": arm.name, "tok_s": tps, "vs_first_arm": tps / base if base else None,
                   "tokens_per_round": statistics.median(r["tpr"] for r in rs),
                   "host_ms_per_round": statistics.median(r["host_ms"] for r in rs),
                   "same_text_as_first_arm": rs[0]["tokens"] == base_text, "tokens": len(rs[0]["tokens"]),
                   "widths": {str(w): n for w, n in sorted(widths.items())}}
            out.append(row)
            top = ", ".join(f"{w}:{n}" for w, n in widths.most_common(4))
            rows.append([name, arm.name, f"{tps:.1f}", f"{row['vs_first_arm']:.2f}x", f"{row['tokens_per_round']:.2f}",
                         f"{row['host_ms_per_round']:.3f}", row["tokens"], "yes" if row["same_text_as_first_arm"] else "no", top])
    if as_json:
        print(orjson.dumps({"title": title, "rows": out, **(extra or {})}).decode())
        return
    print(title)
    print(tabulate(rows, headers=["prompt", "arm", "tok/s", f"vs {first}", "tok/round", "host ms/round", "tokens",
                                  f"same text as {first}", "widths (rows:rounds)"]))
    for k, v in (extra or {}).items():
        print(f"{k}: {v}")


@app.command()
def smoke(
    max_tokens: int = typer.Option(192, "--max-tokens"),
    passes: int = typer.Option(2, "--passes", min=1),
    arms: str = typer.Option(",".join(SMOKE_ARMS), "--arms"),
    model: Optional[Path] = typer.Option(None, "--model"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Decode tok/s of several arms on three bundled prompts, side by side."""
    arm_list = [parse_arm(a) for a in arms.split(",")]
    lm = LlamaModel(model or default_model())
    runs = side_by_side(lm, LlamaTarget(lm), arm_list, SMOKE_PROMPTS, passes, max_tokens)
    report(runs, arm_list, SMOKE_PROMPTS,
           f"model {lm.path.name}, {passes} passes, up to {max_tokens} tokens, median decode tok/s (client clock)", as_json)


@app.command()
def adaptive(
    max_tokens: int = typer.Option(256, "--max-tokens"),
    passes: int = typer.Option(2, "--passes", min=1),
    model: Optional[Path] = typer.Option(None, "--model"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """``adaspark`` against ``ar`` on an open-ended and a copy-heavy prompt, side by side. The
    adaspark arm starts from an empty store and learns while it serves: first a learning request
    on each of three other prompts (its cold start), then the measured passes."""
    arm_list = [parse_arm("ar"), parse_arm("adaspark")]
    lm = LlamaModel(model or default_model())
    target = LlamaTarget(lm)
    policy = TimedPolicy()
    learners = Learners(policy=policy)
    learning = side_by_side(lm, target, arm_list[1:], ["code.txt", "summary.txt", "story.txt"], 1, max_tokens, learners)
    cold = {name: runs[0]["tps"] for (name, _), runs in learning.items()}
    prompts = ["explain.txt", "list.txt", "rewrite.txt"]  # open-ended, a list, copy-heavy
    runs = side_by_side(lm, target, arm_list, prompts, passes, max_tokens, learners)
    extra = {"learned widths": policy.cost.widths,
             "cold-start requests tok/s": {k: round(v, 1) for k, v in cold.items()},
             "policy ms/round (decide + learn)": round(policy.ms / max(policy.rounds, 1), 4),
             "refit ms per request": round(policy.refit_ms / max(len(prompts) * passes + 3, 1), 2)}
    report(runs, arm_list, prompts, f"model {lm.path.name}, {passes} passes, up to {max_tokens} tokens, median decode tok/s",
           as_json, extra)


NGRAM_SOURCES = ["convfinqa", "longbench", "specbench:rag,summarization"]  # copy-heavy and multi-turn


@app.command()
def ngram(
    max_tokens: int = typer.Option(320, "--max-tokens"),
    sources: str = typer.Option(" ".join(NGRAM_SOURCES), "--sources", help="Space-separated set[:kind,...] names."),
    model: Optional[Path] = typer.Option(None, "--model"),
    log: Optional[Path] = typer.Option(None, "--log", help="Write adaspark's round log here (for `adaspark replay`)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """``adaspark`` (n-gram candidates only, the CPU default) against ``ar`` on the copy-heavy and
    multi-turn conversations of ../shared/testset, side by side turn by turn, each arm carrying its
    own replies as history; adaspark serves every conversation in order with one set of learners
    from empty. Per source: geometric mean of per-reply decode-speed ratios (replies that hit the
    cap in either arm left out and counted) and realised over expected accepted nodes (paper 4.7)."""
    arms = [parse_arm("ar"), parse_arm("adaspark")]
    lm = LlamaModel(model or default_model())
    target = LlamaTarget(lm)
    learners = Learners()
    round_log = RoundLog(log) if log else None
    per: dict[str, dict] = {}
    convs = load_sources(sources.split(), benchmark_sets())
    for ci, conv in enumerate(convs):
        hist = {a.name: [] for a in arms}
        acc = per.setdefault(conv.set, {"ratios": [], "all_ratios": [], "capped": 0, "expected": 0.0, "accepted": 0,
                                        "replies": 0, "rounds": 0, "tokens": 0})
        for ti, turn in enumerate(conv.turns):
            tps = {}
            capped = False
            for arm in (arms if (ci + ti) % 2 == 0 else arms[::-1]):  # alternate which arm runs first
                messages = hist[arm.name] + [user_message(turn)]
                prompt = lm.chat_prompt(messages)
                if len(prompt) + max_tokens >= target.n_ctx:
                    break
                records = []
                gen = Generation(target, prompt, arm, max_tokens, request_id=f"{conv.name}/{ti}",
                                 learners=learners if arm.learns else None, log=round_log if arm.learns else None)
                for _ in gen:
                    records.append(gen.last_record)
                text = b"".join(map(lm.piece, gen.tokens)).decode("utf-8", "replace")
                hist[arm.name] = messages + [{"role": "assistant", "content": text}]
                tps[arm.name] = gen.stats.decode_tps
                capped |= gen.finish == "length"
                if arm.adaptive:
                    acc["rounds"] += len(records)
                    acc["tokens"] += gen.stats.generated
                    for rec in records:
                        s = expected_accepted(rec)
                        if s is not None:
                            acc["expected"] += s
                            acc["accepted"] += len(rec.path)
            if len(tps) < 2:
                continue
            acc["replies"] += 1
            ratio = tps["adaspark"] / tps["ar"] if tps["ar"] and tps["adaspark"] else None
            if ratio is not None:
                acc["all_ratios"].append(ratio)
            if capped:
                acc["capped"] += 1
            elif ratio is not None:
                acc["ratios"].append(ratio)
    if round_log:
        round_log.close()
    rows, out = [], {}
    all_ratios = []
    for name, a in per.items():
        gm = statistics.geometric_mean(a["ratios"]) if a["ratios"] else None
        gm_all = statistics.geometric_mean(a["all_ratios"]) if a["all_ratios"] else None
        all_ratios += a["ratios"]
        cal = a["accepted"] / a["expected"] if a["expected"] else None
        out[name] = {**a, "speed_ratio": gm, "speed_ratio_all_replies": gm_all, "calibration": cal}
        rows.append([name, a["replies"], a["capped"], f"{gm:.3f}x" if gm else "-", f"{gm_all:.3f}x" if gm_all else "-",
                     f"{cal:.3f}" if cal else "-", f"{a['tokens'] / a['rounds']:.2f}" if a["rounds"] else "-"])
    overall = statistics.geometric_mean(all_ratios) if all_ratios else None
    if as_json:
        print(orjson.dumps({"sources": out, "overall": overall, "max_tokens": max_tokens}).decode())
        return
    print(f"model {lm.path.name}, up to {max_tokens} tokens per reply, adaspark (n-gram only) vs ar, decode speed on the client clock")
    print(tabulate(rows, headers=["source", "replies", "capped", "adaspark / ar", "incl. capped", "accepted / expected",
                                  "adaspark tokens/round"], disable_numparse=True))
    print(f"overall adaspark / ar: {overall:.3f}x over {len(all_ratios)} replies" if overall else "overall: -")


DRAFTER_PROMPTS = ["explain.txt", "list.txt", "rewrite.txt"]  # open-ended, a list, copy-heavy


@app.command()
def drafters(
    max_tokens: int = typer.Option(128, "--max-tokens"),
    arms: str = typer.Option("tree:8,adaspark", "--arms", help="Arms run with each drafter, against ar."),
    model: Optional[Path] = typer.Option(None, "--model"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Model drafters on the default model, side by side with ``ar`` on three prompts: the model
    drafting for itself, the shipped Q4_1 copy drafting for the Q4_0 target, and a synthetic DSpark
    GGUF (random weights: its rows show the cost of a DSpark block on this machine, not its
    acceptance). D is the round's time before the verify (draft, n-gram fill, pricing, width)."""
    path = model or default_model()
    lm = LlamaModel(path)
    tmp = Path(tempfile.mkdtemp(prefix="adaspark-bench-"))
    dspark = tmp / "dspark-synthetic.gguf"
    subprocess.run([sys.executable, str(PROMPTS.parent / "make_dspark_gguf.py"), "--target", str(path),
                    "--out", str(dspark)], check=True, capture_output=True)
    specs = [("none", None), ("model:self", f"model:{path}"), ("model:q4_1", f"model:{shipped_default()}"),
             ("dspark:synthetic", f"dspark:{dspark}")]
    arm_list = [parse_arm(a) for a in arms.split(",")]
    rows, out = [], []
    for label, spec in specs:
        target = LlamaTarget(lm)  # a DSpark drafter switches on its target's hidden-state capture
        drafter = make_drafter(spec, target)
        for name in DRAFTER_PROMPTS:
            prompt = lm.chat_prompt([{"role": "user", "content": (PROMPTS / name).read_text()}])
            base = run(target, prompt, parse_arm("ar"), max_tokens).stats
            for arm in arm_list:
                st = run(target, prompt, arm, max_tokens, drafter=drafter,
                         learners=Learners() if arm.learns else None).stats
                ratio = st.decode_tps / base.decode_tps if st.decode_tps and base.decode_tps else None
                d_ms = st.draft_ms / max(st.rounds, 1)
                out.append({"drafter": label, "prompt": name, "arm": arm.name, "tok_s": st.decode_tps,
                            "ar_tok_s": base.decode_tps, "vs_ar": ratio, "tokens_per_round": st.tokens_per_round,
                            "d_ms": d_ms, "verify_ms_per_round": st.verify_ms / max(st.rounds, 1)})
                rows.append([label, name, arm.name, f"{st.decode_tps or 0:.1f}", f"{base.decode_tps or 0:.1f}",
                             f"{ratio:.2f}x" if ratio else "-", f"{st.tokens_per_round:.2f}", f"{d_ms:.2f}",
                             f"{st.verify_ms / max(st.rounds, 1):.2f}"])
        if drafter is not None:
            drafter.close()
        target.close()
    if as_json:
        print(orjson.dumps({"model": lm.path.name, "max_tokens": max_tokens, "rows": out}).decode())
        return
    print(f"model {lm.path.name}, up to {max_tokens} tokens, one pass, adaspark arms from an empty store")
    print(tabulate(rows, headers=["drafter", "prompt", "arm", "tok/s", "ar tok/s", "vs ar", "tok/round",
                                  "D ms/round", "verify ms/round"], disable_numparse=True))


@app.command()
def quant(
    widths: str = typer.Option("1,2,4,8,16,32", "--widths"),
    contexts: str = typer.Option("200,1500", "--contexts"),
    reps: int = typer.Option(7, "--reps"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Verify time by width of the shipped Q4_1 default model and its Q4_0 copy, side by side."""
    ws = [int(w) for w in widths.split(",")]
    cs = [int(c) for c in contexts.split(",")]
    files = {"Q4_1 (shipped)": shipped_default(), "Q4_0 (default)": default_model()}
    targets = {k: LlamaTarget(LlamaModel(p), n_ctx=4096) for k, p in files.items()}
    times: dict[tuple[str, int, int], list[float]] = {}
    for k in range(2):  # two passes in opposite order
        for c in cs:
            ctx_tokens = [(i * 7919) % 30000 + 100 for i in range(c)]
            for name in (list(targets) if k == 0 else list(targets)[::-1]):
                targets[name].start(ctx_tokens)
                for w in (ws if k == 0 else ws[::-1]):
                    times.setdefault((name, c, w), []).append(pinned_verify_ms(targets[name], w, reps)[0])
    table, out = [], []
    for c in cs:
        for name in targets:
            med = [statistics.median(times[(name, c, w)]) for w in ws]
            table.append([c, name, *[f"{m:.1f}" for m in med]])
            out.append({"context": c, "model": name, "ms": dict(zip(ws, med))})
        ratio = [statistics.median(times[(list(targets)[0], c, w)]) / statistics.median(times[(list(targets)[1], c, w)]) for w in ws]
        table.append([c, "Q4_1 / Q4_0", *[f"{r:.2f}x" for r in ratio]])
    if as_json:
        print(orjson.dumps(out).decode())
        return
    print("verify time (ms, median) by rows")
    print(tabulate(table, headers=["context", "model", *map(str, ws)]))


@app.command()
def ttft(
    arm: str = typer.Option("chain:3", "--arm"),
    reps: int = typer.Option(3, "--reps", min=1),
    max_tokens: int = typer.Option(48, "--max-tokens", "-n", min=1),
    model: Optional[Path] = typer.Option(None, "--model"),
) -> None:
    """Time to first token (prefill and first round) of a 4-turn conversation over rewrite.txt,
    with and without prompt-prefix reuse: two targets of one model, the arms interleaved turn by
    turn, their order alternating; every reply fed back as history, each arm its own."""
    lm = LlamaModel(model or default_model())
    questions = [(PROMPTS / "rewrite.txt").read_text(), "Now make it shorter.", "Give it a title.",
                 "Translate the title to French."]
    seen: dict[tuple[bool, int], list] = {}
    for rep in range(reps):
        targets = {reuse: LlamaTarget(lm, n_ctx=4096, reuse_prefix=reuse) for reuse in (False, True)}
        history: dict[bool, list[dict]] = {False: [], True: []}
        for turn, question in enumerate(questions):
            for reuse in ((True, False) if (rep + turn) % 2 == 0 else (False, True)):
                history[reuse].append({"role": "user", "content": question})
                prompt = lm.chat_prompt(history[reuse])
                gen = Generation(targets[reuse], prompt, parse_arm(arm), max_tokens)
                rounds = iter(gen)
                t0 = time.perf_counter()
                next(rounds)
                ms = (time.perf_counter() - t0) * 1e3
                for _ in rounds:
                    pass
                seen.setdefault((reuse, turn), []).append((len(prompt), targets[reuse].reused, ms))
                reply = b"".join(map(lm.piece, gen.tokens)).decode("utf-8", "replace")
                history[reuse].append({"role": "assistant", "content": reply})
        for t in targets.values():
            t.close()
    table = []
    for turn in range(len(questions)):
        fresh, kept = ([ms for *_, ms in seen[(reuse, turn)]] for reuse in (False, True))
        table.append([turn + 1, seen[(False, turn)][0][0], seen[(True, turn)][0][1],
                      f"{statistics.median(fresh):.0f} ({min(fresh):.0f}-{max(fresh):.0f})",
                      f"{statistics.median(kept):.0f} ({min(kept):.0f}-{max(kept):.0f})",
                      f"{statistics.median(fresh) / statistics.median(kept):.1f}x"])
    print(f"model {lm.path.name}, arm {arm}, {reps} interleaved repetitions: time to first token, ms median (range)")
    print(tabulate(table, headers=["turn", "prompt tokens", "reused", "fresh prefill", "prefix reuse", "speed-up"],
                   disable_numparse=True))


@app.command()
def host(
    widths: str = typer.Option("1,2,4,8,16,32,64", "--widths"),
    reps: int = typer.Option(50, "--reps"),
) -> None:
    """The engine's own Python time per verify outside llama_decode, by width, for a chain and for
    a bushy tree (batch build, KV sequence copies, argmax read, commit-equivalent discard)."""
    lm = LlamaModel(default_model())
    target = LlamaTarget(lm)
    ctx_tokens = [(i * 7919) % 30000 + 100 for i in range(1000)]
    table = []
    target.start(ctx_tokens)
    for w in [int(x) for x in widths.split(",")]:
        chain_dec, chain_host = pinned_verify_ms(target, w, reps)
        # a bushy tree: every node below the anchor a leaf, so w-1 sequences to copy and drop
        cands: list = []
        for k in range(w - 1):
            cands.append(tree.child_of(cands, ANCHOR, 500 + k, NGRAM))
        lay = tree.layout(target.anchor, cands, list(range(len(cands))))
        hosts = []
        for _ in range(reps + 2):
            v = target.verify(lay)
            t0 = time.perf_counter()
            target.discard(lay)
            hosts.append(v.host_ms + (time.perf_counter() - t0) * 1e3)
        table.append([w, f"{chain_dec:.2f}", f"{chain_host:.3f}", f"{statistics.median(hosts[2:]):.3f}", lay.n_leaves])
    print("engine host time per verify (ms, median), context 1000 tokens")
    print(tabulate(table, headers=["rows", "llama_decode", "host: chain", "host: bushy tree", "leaves"]))


@app.command()
def step(
    context: int = typer.Option(500, "--context", help="Committed tokens of every slot's request."),
    repeats: int = typer.Option(12, "--repeats", help="Timed verifies per cell (the first two dropped)."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """What one batched step costs (issue 29): a verify of N slots x W rows each on a LlamaBatch of
    N slots (each slot's request at CONTEXT tokens), against a lone target's verify of N x W rows
    at the same context, and against N lone one-row verifies one after another (plain decoding of
    N requests in turn). Every row attends every cell in use (unified KV, flash attention off),
    so a step pays for every slot's context on every row. Cells in random order, medians."""
    import random

    from adaspark_core.base.tree import PICK, Candidate
    from adaspark_core.engine.llama_batch import LlamaBatch

    rng = random.Random(0)
    lm = LlamaModel(default_model())
    prompt = [rng.randrange(1000, lm.n_vocab) for _ in range(context + 1)]
    engines = {n: LlamaBatch(lm, n, n_ctx=context + 100) for n in (1, 2, 4, 8)}
    for engine in engines.values():
        for slot in engine.slots:
            slot.start(prompt)
    alone = LlamaTarget(lm, n_ctx=context + 100)
    alone.start(prompt)

    def star(t, w):  # the anchor and w - 1 children: w rows, w - 1 leaves
        cands = [Candidate(rng.randrange(1000, lm.n_vocab), ANCHOR, PICK, 1) for _ in range(w - 1)]
        return tree.layout(t.anchor, cands, list(range(w - 1)))

    def timed(verify, items) -> float:
        t0 = time.perf_counter()
        verify(items)
        ms = (time.perf_counter() - t0) * 1e3
        for t, lay in items:
            t.discard(lay)
        return ms

    cells = {}
    for n, engine in engines.items():
        for w in (1, 2, 4, 8):
            if n * w <= 64:
                cells[("batch", n, w)] = lambda e=engine, w=w: timed(e.verify, [(s, star(s, w)) for s in e.slots])
    for rows in (1, 2, 4, 8, 16, 32, 64):
        cells[("alone", rows, 1)] = lambda r=rows: timed(lambda its: [t.verify(lay) for t, lay in its], [(alone, star(alone, r))])
    times = {k: [] for k in cells}
    for _ in range(repeats):
        order = list(cells)
        rng.shuffle(order)
        for k in order:
            times[k].append(cells[k]())
    med = {k: statistics.median(v[2:] if len(v) > 4 else v) for k, v in times.items()}
    rows = []
    for (kind, n, w), ms in med.items():
        if kind == "batch":
            lone = med[("alone", n * w, 1)]
            one_by_one = n * med[("alone", 1, 1)]
            rows.append([f"{n} x {w}", n * w, f"{ms:.1f}", f"{lone:.1f}", f"{ms / lone:.2f}", f"{one_by_one:.1f}",
                         f"{ms / one_by_one:.2f}"])
    print(f"one step at {context} tokens of context per request ({alone.threads} threads), medians of {repeats - 2}")
    print(tabulate(rows, headers=["slots x rows", "rows", "step ms", "lone target, same rows", "ratio",
                                  "N lone 1-row verifies", "ratio"]))
    if as_json:
        print(orjson.dumps({f"{k[0]}:{k[1]}x{k[2]}": v for k, v in med.items()}).decode())
    for engine in engines.values():
        engine.close()
    alone.close()


def _adaspark_server(args: list[str], store_dir: Path):
    """``adaspark serve`` on a free loopback port with a cold store of its own: (process, base URL)."""
    import re

    cmd = [sys.executable, "-m", "adaspark_cli.main", "serve", "--host", "127.0.0.1", "--port", "0",
           "--store", str(store_dir / "store.json"), *args]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if m := re.search(r"listening on (http://\S+:\d+) \(", line):
            return proc, m.group(1)
    raise SystemExit(f"adaspark serve did not start: {' '.join(cmd)}")


def _llama_server(clients: int, spec: str, n_ctx: int, threads: int, model: Path):
    """llama.cpp's llama-server with ``clients`` slots (-np) of ``n_ctx`` each: (server, base URL)."""
    from adaspark_core.engine import llama_server as ls
    from adaspark_core.evaluate.peer import parse_peer

    port = ls.free_port()
    cmd = [str(ls.server_binary()), "-m", str(model), "-c", str(n_ctx * clients), "-np", str(clients),
           "-t", str(threads), "-tb", str(threads), "--host", ls.HOST, "--port", str(port), "--no-ui",
           "-fa", "off", *parse_peer(spec).server_args()]
    srv = ls.LlamaServer(cmd, port, spec)
    srv.start()
    return srv, f"http://{ls.HOST}:{port}"


def _drive(url: str, prompts: list, clients: int, max_tokens: int, deadline_s: float) -> dict:
    """``clients`` threads, each sending the next prompt of the queue through the openai client
    (streamed, greedy) until the queue is empty or the deadline passes: aggregate completion
    tokens per wall second, time to first token, per-request decode speed and latency. A prompt
    is a chat's messages (the chat route) or a text (the completions route, for a base model)."""
    import queue as queue_mod
    import threading

    from openai import OpenAI

    todo: queue_mod.Queue = queue_mod.Queue()
    for p in prompts:
        todo.put(p)
    results, lock = [], threading.Lock()
    t_end = time.perf_counter() + deadline_s

    def client() -> None:
        api = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=deadline_s)
        while time.perf_counter() < t_end:
            try:
                messages = todo.get_nowait()
            except queue_mod.Empty:
                return
            t0 = time.perf_counter()
            first = last = None
            tokens = 0
            how = dict(model="m", max_tokens=max_tokens, temperature=0.0, stream=True,
                       stream_options={"include_usage": True})
            if isinstance(messages, str):
                stream = api.completions.create(prompt=messages, **how)
            else:
                stream = api.chat.completions.create(messages=messages, **how)
            for chunk in stream:
                now = time.perf_counter()
                choice = chunk.choices[0] if chunk.choices else None
                if choice is not None and (choice.text if isinstance(messages, str) else choice.delta.content):
                    first = first if first is not None else now
                    last = now
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            if first is not None and not tokens:
                raise SystemExit(f"{url} streamed a reply without its usage (stream_options.include_usage)")
            done = time.perf_counter()
            with lock:
                results.append({"tokens": tokens, "ttft": (first or done) - t0, "latency": done - t0,
                                "decode_tps": (tokens - 1) / (last - first) if first and last and last > first else None})

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0

    def q(xs, f):
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(f * len(xs)))] if xs else None

    return {"requests": len(results), "tokens": sum(r["tokens"] for r in results), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": q([r["ttft"] for r in results], 0.5),
            "decode_tps_median": q([r["decode_tps"] for r in results if r["decode_tps"]], 0.5),
            "latency_p50": q([r["latency"] for r in results], 0.5), "latency_p95": q([r["latency"] for r in results], 0.95)}


@app.command()
def load(
    clients: str = typer.Option("1,4", "--clients", help="Concurrent clients, comma-separated (each server gets -np C / --parallel C)."),
    requests: int = typer.Option(16, "--requests", help="Requests per run: first turns of the test set's conversations."),
    max_tokens: int = typer.Option(128, "--max-tokens"),
    repeats: int = typer.Option(2, "--repeats", help="Runs of every server, in alternating order."),
    n_ctx: int = typer.Option(2048, "--n-ctx", help="Context per slot."),
    deadline_s: float = typer.Option(600.0, "--deadline", help="Seconds a run may take at most."),
    model: Optional[Path] = typer.Option(None, "--model", help="GGUF model for every server (default: the embedded one)."),
    completions: bool = typer.Option(False, "--completions", help="Send each first turn as a text to /v1/completions (a base model, which has no chat template)."),
    out: Path = typer.Option(Path("bench-out-load.json"), "--out"),
) -> None:
    """Many clients at once, loopback only (issue 29): for each C, llama.cpp's llama-server -np C
    with no speculation and with ngram-mod, and adaspark serve --parallel C with chain:3 and the
    adaspark arm (cold), plus today's one-at-a-time adaspark server; the same requests through the
    real openai client, servers in alternating order across repeats. Prints aggregate tokens/s,
    time to first token, per-request decode tokens/s and latency percentiles; writes JSON."""
    import shutil

    from adaspark_core.engine.bindings import thread_count

    cs = _client_counts(clients)
    convs = load_sources(["specbench", "speedbench", "wildchat", "toolace", "convfinqa", "longbench"], benchmark_sets())
    prompts = [user_message(c.turns[0])["content"] + "\n\n" if completions else [user_message(c.turns[0])]
               for c in convs][:requests]
    model = model or default_model()
    threads = thread_count(None)
    runs: list[dict] = []
    for rep in range(repeats):
        for c in cs:
            kinds = [("llama-server -np C", "llama:ar"), ("llama-server -np C ngram-mod", "llama:ngram-mod"),
                     ("adaspark --parallel C chain:3", ["--arm", "chain:3", "--parallel", str(c)]),
                     ("adaspark --parallel C", ["--arm", "adaspark", "--parallel", str(c)]),
                     ("adaspark one at a time", ["--arm", "adaspark", "--queue", str(max(8, c))])]
            if rep % 2:
                kinds.reverse()
            for name, how in kinds:
                store_dir = Path(tempfile.mkdtemp(prefix="adaspark-load-"))
                if isinstance(how, str):
                    srv, url = _llama_server(c, how, n_ctx, threads, model)
                    stop = srv.stop
                else:
                    proc, url = _adaspark_server([*how, "--model", str(model), "--n-ctx", str(n_ctx), "--threads",
                                                  str(threads)], store_dir)

                    def stop(proc=proc):
                        proc.terminate()
                        proc.wait(timeout=60)
                try:
                    res = _drive(url, prompts, c, max_tokens, deadline_s)
                finally:
                    stop()
                    shutil.rmtree(store_dir, ignore_errors=True)
                runs.append({"server": name, "clients": c, "repeat": rep, **res})
                print(f"  {name:32s} C={c}: {res['tokens_per_s']:.1f} tok/s ({res['requests']} requests)", file=sys.stderr)
    rows = []
    for c in cs:
        for name in dict.fromkeys(r["server"] for r in runs):
            mine = [r for r in runs if r["server"] == name and r["clients"] == c]
            tps = [r["tokens_per_s"] for r in mine]

            def med(key):
                vals = [r[key] for r in mine if r[key] is not None]
                return statistics.median(vals) if vals else float("nan")

            rows.append([name.replace(" C", f" {c}"), c, f"{min(tps):.1f}-{max(tps):.1f}", f"{med('ttft_p50'):.2f}",
                         f"{med('decode_tps_median'):.1f}", f"{med('latency_p50'):.2f}", f"{med('latency_p95'):.2f}"])
    print(tabulate(rows, headers=["server", "clients", "aggregate tok/s (range)", "TTFT p50 s", "decode tok/s",
                                  "latency p50 s", "p95 s"]))
    out.write_bytes(orjson.dumps({"requests": requests, "max_tokens": max_tokens, "n_ctx": n_ctx, "model": str(model),
                                  "route": "completions" if completions else "chat", "runs": runs},
                                 option=orjson.OPT_INDENT_2))


def _client_counts(value: str) -> list[int]:
    """``--clients``: the comma-separated client counts, each also a server's slots."""
    try:
        counts = [int(c) for c in value.split(",")]
    except ValueError:
        counts = []
    if not counts or not all(1 <= c <= MAX_CLIENTS for c in counts):
        raise typer.BadParameter(f"{value!r}: give comma-separated counts from 1 to {MAX_CLIENTS}, e.g. 1,4",
                                 param_hint="--clients")
    return counts


@app.command()
def memory(
    size: int = typer.Option(1_000_000, "--tokens", help="Tokens in the n-gram memory."),
    rounds: int = typer.Option(2000, "--rounds", help="Fill calls timed per arm."),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """The n-gram fill's host time per round with and without an n-gram memory of SIZE tokens
    (issue 16: under 0.1 ms added), and the memory's build, save and load times. The memory holds
    the test set's texts, tokenized by the default model, repeated with 3% of tokens changed to
    fill it (so every gram recurs often: the lookup's worst case); the requests are the test set's
    first turns, each followed by another text read as its reply, one token a round. The arms
    (no memory, memory) alternate round by round."""
    import random

    from adaspark_core.base.tree import MAX_CHAIN_DEPTH
    from adaspark_core.candidates import memory as mem
    from adaspark_core.candidates import memory_file
    from adaspark_core.candidates.ngram import SuffixIndex, fill

    rng = random.Random(seed)
    lm = LlamaModel(default_model())
    convs = load_sources(["specbench", "speedbench", "wildchat", "toolace", "convfinqa", "longbench"], benchmark_sets())
    texts = [lm.tokenize(t["text"], False) for c in convs for t in c.turns]
    texts = [t for t in texts if len(t) > 8]
    docs, total = [], 0
    while total < size:
        base = rng.choice(texts)
        doc = [tok if rng.random() > 0.03 else rng.randrange(lm.n_vocab) for tok in base]
        docs.append(doc)
        total += len(doc)
    t0 = time.perf_counter()
    memory = mem.NgramMemory(cap_mb=1e4)
    memory.add_many(docs)
    build_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        store = Path(d) / "store.json"
        t0 = time.perf_counter()
        memory_file.save(memory, store, "bench")
        save_s = time.perf_counter() - t0
        file_mb = memory_file.memory_path(store).stat().st_size / 1e6
        t0 = time.perf_counter()
        memory_file.load(store, "bench", cap_mb=1e4)
        load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    memory.add(texts[0])
    add_ms = (time.perf_counter() - t0) * 1e3
    times: dict[str, list[float]] = {"none": [], "memory": []}
    lookup_ms: list[float] = []  # the memory's lookup alone, from the anchor
    found = 0
    done = 0
    while done < rounds:
        prompt, reply = rng.choice(texts), rng.choice(texts)
        index = SuffixIndex()
        index.extend(prompt)
        for tok in reply:
            for arm in (("none", "memory") if done % 2 == 0 else ("memory", "none")):
                t0 = time.perf_counter()
                cands = []
                fill(cands, index, MAX_CHAIN_DEPTH, 3, memory if arm == "memory" else None)
                times[arm].append((time.perf_counter() - t0) * 1e3)
                if arm == "memory":
                    found += any(c.kind == "memory" for c in cands)
            tail = index.tail([], index.max_match)
            t0 = time.perf_counter()
            memory.lookup(tail)
            lookup_ms.append((time.perf_counter() - t0) * 1e3)
            index.extend([tok])
            done += 1
            if done >= rounds:
                break

    def q(xs, f):
        return sorted(xs)[min(len(xs) - 1, int(f * len(xs)))]

    rows = [[arm, f"{statistics.median(xs):.4f}", f"{statistics.mean(xs):.4f}", f"{q(xs, 0.9):.4f}", f"{q(xs, 0.99):.4f}"]
            for arm, xs in times.items()]
    print(f"n-gram memory of {memory.n_tokens:,} tokens ({memory.nbytes / 1e6:.1f} MB in memory, {file_mb:.1f} MB on disk): "
          f"built in {build_s:.2f} s, saved in {save_s:.2f} s, loaded (index rebuilt) in {load_s:.2f} s, "
          f"one reply added in {add_ms:.1f} ms")
    print(f"fill host time per round (ms), {rounds} rounds each, arms alternating; memory nodes in "
          f"{found / rounds:.0%} of the memory arm's rounds")
    print(tabulate(rows, headers=["arm", "median", "mean", "p90", "p99"], disable_numparse=True))
    print(f"the lookup alone (hash, binary search, up to {mem.SCAN} occurrences compared): median "
          f"{statistics.median(lookup_ms):.4f} ms, p99 {q(lookup_ms, 0.99):.4f} ms; the rest of the memory arm's "
          "time is building the candidate nodes a found chain gives, as for a chain from the request's own text")
    print(f"added by the memory: median {statistics.median(times['memory']) - statistics.median(times['none']):.4f} ms, "
          f"mean {statistics.mean(times['memory']) - statistics.mean(times['none']):.4f} ms")


@app.command()
def onerow(
    logs: Path = typer.Argument(..., help="The round logs of one compare run: ar.jsonl and the arms' logs."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Is width 1 plain decoding? Each speculating arm's one-row decodes over ar's at the same
    request and context (evaluate/onerow.py): after a one-row round, and right after a wider
    verify (llama.cpp's graph rebuild), side by side."""
    from dataclasses import asdict

    from adaspark_core.evaluate.onerow import one_row
    from adaspark_core.store.record import read_log

    if not (logs / "ar.jsonl").is_file():
        raise SystemExit(f"no ar.jsonl in {logs}: give the --logs folder of a compare run with the ar arm")
    ar = list(read_log(logs / "ar.jsonl"))
    arms = sorted(f for f in logs.glob("*.jsonl") if f.stem not in ("ar", "traces") and not f.stem.startswith("warm-"))
    results = {f.stem.replace("_", ":"): one_row(ar, read_log(f)) for f in arms}
    if as_json:
        print(orjson.dumps({a: asdict(r) for a, r in results.items()}).decode())
        return

    def num(x, fmt="{:.4f}"):
        return "-" if x is None else fmt.format(x)

    rows = [[a, r.pairs, num(r.median), f"{num(r.reply_median)} [{num(r.lo)}, {num(r.hi)}] ({r.replies})",
             r.after_wider, num(r.after_wider_median), num(r.rebuild_share, "{:.2%}")] for a, r in results.items()]
    print(f"one-row llama_decode time over ar's at the same request and context ({logs})")
    print(tabulate(rows, headers=["arm", "pairs after 1 row", "median", "median of replies [95%] (replies)",
                                  "pairs after a wider verify", "median", "its share of decode time"],
                   disable_numparse=True))


# --- a model over two RPC servers, the network dialed -----------------------------------------------

RPC_ARMS = "ar,chain:3,adaspark,llama:ar,llama:ngram-mod"


def _mean_width(replies: list[dict], arm: str) -> float | None:
    """An arm's mean verified width over its rounds in ``replies`` (compare.json's)."""
    rounds = Counter()
    for r in replies:
        if r["arm"] == arm:
            rounds.update({int(w): n for w, n in (r.get("widths") or {}).items()})
    total = sum(rounds.values())
    return sum(w * n for w, n in rounds.items()) / total if total else None


@app.command()
def rpc(
    delays: str = typer.Option("0,0.5,2", "--delays", help="Added delay per message each way, ms, comma-separated."),
    arms: str = typer.Option(RPC_ARMS, "--arms", help="compare's arms; every llama: arm gets servers of its own."),
    subset: str = typer.Option("eval", "--subset", help="compare's --subset."),
    max_turns: int = typer.Option(1, "--max-turns", min=1),
    max_tokens: int = typer.Option(96, "--max-tokens", min=1),
    warm: int = typer.Option(1, "--warm", min=0, help="compare's --warm with --warm-on first-half: untimed passes of the learning arms over the first half of the conversations at each delay, the other half reported (0: cold, all reported)."),
    out: Path = typer.Option(Path("bench-out-rpc"), "--out", help="A folder per delay (compare.json, logs)."),
) -> None:
    """The model split over two loopback RPC servers behind delay relays, at each delay: compare's
    arms side by side (ours on one pair of servers, each llama-server arm on a pair of its own:
    a llama.cpp RPC server serves one client at a time), and adaspark's mean verified width. The
    learning arms learn each delay afresh (compare's store is its own), warm by default: the
    cost model has then met the network it is priced on, and the conversations reported are ones
    the warm pass did not see (its n-gram memory holds none of their text)."""
    from benchmarks.relay import Relay, start_rpc_server, stop_rpc_server

    try:
        wanted = [float(d) for d in delays.split(",")]
    except ValueError:
        raise typer.BadParameter(f"--delays wants milliseconds, comma-separated, not {delays!r}") from None
    clients = 1 + sum(a.strip().startswith("llama:") for a in arms.split(","))
    procs, relays = [], []
    try:
        for _ in range(2 * clients):
            proc, port = start_rpc_server()
            procs.append(proc)
            relays.append(Relay(("127.0.0.1", port)))
        pairs = [",".join(r.endpoint for r in relays[2 * k: 2 * k + 2]) for k in range(clients)]
        rows = []
        for delay in wanted:
            for r in relays:
                r.delay = delay / 1000
            where = out / f"delay-{delay:g}ms"
            cmd = [sys.executable, "-m", "adaspark_cli.main", "compare", "--sets", str(benchmark_sets()), "--arms", arms,
                   "--subset", subset, "--max-turns", str(max_turns), "--max-tokens", str(max_tokens),
                   "--warm", str(warm), "--warm-on", "first-half" if warm else "all",
                   "--out", str(where), "--logs", str(where / "logs"), "--rpc", pairs[0]]
            for pair in pairs[1:]:
                cmd += ["--peer-rpc", pair]
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            report = orjson.loads((where / "compare.json").read_bytes())
            summary = (report["summary"]["held_out"]["unseen"] if warm else report["summary"])["first_n"]["vs_baseline"]
            width = _mean_width([r for r in report["replies"] if not r["warmed"]], "adaspark")
            rows.append([f"{delay:g}"] + [_ratio(summary.get(a.strip(), {}).get("overall")) for a in arms.split(",")[1:]]
                        + [f"{width:.2f}" if width is not None else "-"])
        typer.echo(tabulate(rows, ["delay ms"] + [f"{a.strip()} / ar" for a in arms.split(",")[1:]]
                            + ["adaspark mean width"], disable_numparse=True))
    finally:
        for r in relays:
            r.close()
        for proc in procs:
            stop_rpc_server(proc)


def _ratio(res: dict | None) -> str:
    if not res or res.get("ratio") is None:
        return "-"
    return f"{res['ratio']:.2f}x [{res['lo']:.2f}, {res['hi']:.2f}]"


if __name__ == "__main__":
    console.run_app(app)  # a bad argument: one line, exit code 2
