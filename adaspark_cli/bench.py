"""Benchmarks: speeds measured side by side in one run, printed as tables. Not tests.

    python -m adaspark_cli.bench smoke [--max-tokens N] [--passes K] [--json]
    python -m adaspark_cli.bench quant [--json]

``smoke`` decodes three bundled prompts (one copy-heavy) with ar, chain:4, tree:8 and tree:16,
the arms interleaved and each pass in the opposite order of the last, and reports decode tok/s
(median over passes), the ratio to ar, tokens per round and the engine's host time per round.
``quant`` times pinned-width verifies of the shipped Q4_1 default model against its Q4_0 copy.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional

import orjson
import typer
from tabulate import tabulate

from adaspark_core import tree
from adaspark_core.engine.llama import LlamaModel, LlamaTarget
from adaspark_core.models import default_model
from adaspark_core.scheduler import Generation, parse_arm
from adaspark_core.tree import ANCHOR, NGRAM

PROMPTS = Path(__file__).resolve().parent.parent / "fixtures" / "prompts"
SMOKE_PROMPTS = ["rewrite.txt", "explain.txt", "story.txt"]  # rewrite.txt is the copy-heavy task
SMOKE_ARMS = ["ar", "chain:4", "tree:8", "tree:16"]

app = typer.Typer(add_completion=False, no_args_is_help=True)


@app.callback()
def _main() -> None:
    """AdaSpark benchmarks."""


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
    target = LlamaTarget(lm)
    runs: dict[tuple[str, str], list[dict]] = {}
    for k in range(passes):
        for name in SMOKE_PROMPTS:
            prompt = lm.chat_prompt([{"role": "user", "content": (PROMPTS / name).read_text()}])
            order = arm_list if k % 2 == 0 else arm_list[::-1]
            for arm in order:
                gen = Generation(target, prompt, arm, max_tokens)
                host = []
                for _ in gen:
                    host.append(gen.stats.host_ms)
                st = gen.stats
                runs.setdefault((name, arm.name), []).append(
                    {"tps": st.decode_tps or 0.0, "tpr": st.tokens_per_round, "tokens": gen.tokens,
                     "host_ms": st.host_ms / max(st.rounds, 1), "widths": dict(st.widths)}
                )
    rows, out = [], []
    for name in SMOKE_PROMPTS:
        ar_tps = statistics.median(r["tps"] for r in runs[(name, arm_list[0].name)])
        ar_text = runs[(name, arm_list[0].name)][0]["tokens"]
        for arm in arm_list:
            rs = runs[(name, arm.name)]
            tps = statistics.median(r["tps"] for r in rs)
            row = {
                "prompt": name, "arm": arm.name, "tok_s": tps, "vs_first_arm": tps / ar_tps if ar_tps else None,
                "tokens_per_round": statistics.median(r["tpr"] for r in rs),
                "host_ms_per_round": statistics.median(r["host_ms"] for r in rs),
                "same_text_as_first_arm": rs[0]["tokens"] == ar_text,
                "tokens": len(rs[0]["tokens"]),
            }
            out.append(row)
            rows.append([name, arm.name, f"{tps:.1f}", f"{row['vs_first_arm']:.2f}x", f"{row['tokens_per_round']:.2f}",
                         f"{row['host_ms_per_round']:.3f}", row["tokens"], "yes" if row["same_text_as_first_arm"] else "no"])
    if as_json:
        print(orjson.dumps({"model": str(lm.path), "passes": passes, "max_tokens": max_tokens, "rows": out}).decode())
        return
    print(f"model {lm.path.name}, {passes} passes, up to {max_tokens} tokens, median decode tok/s (client clock)")
    print(tabulate(rows, headers=["prompt", "arm", "tok/s", f"vs {arm_list[0].name}", "tok/round", "host ms/round", "tokens", f"same text as {arm_list[0].name}"]))


def pinned_verify_ms(target: LlamaTarget, width: int, reps: int) -> tuple[float, float]:
    """Median llama_decode time and median engine host time (ms) of a chain verify of ``width``
    rows at the target's current context, over ``reps`` verifies after two warm-ups. Each verify
    is discarded, so all run at the same context. Host time = batch build + argmax read."""
    cands: list = []
    for k in range(width - 1):
        cands.append(tree.child_of(cands, ANCHOR if k == 0 else k - 1, 500 + k, NGRAM))
    lay = tree.layout(target.anchor, cands, list(range(len(cands))))
    dec, host = [], []
    for _ in range(reps + 2):
        v = target.verify(lay)
        target.discard(lay)
        dec.append(v.decode_ms)
        host.append(v.host_ms)
    return statistics.median(dec[2:]), statistics.median(host[2:])


@app.command()
def quant(
    widths: str = typer.Option("1,2,4,8,16,32", "--widths"),
    contexts: str = typer.Option("200,1500", "--contexts"),
    reps: int = typer.Option(7, "--reps"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Verify time by width of the shipped Q4_1 default model and its Q4_0 copy, side by side."""
    from adaspark_core.models import shipped_default

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
def host(
    widths: str = typer.Option("1,2,4,8,16,32,64", "--widths"),
    reps: int = typer.Option(50, "--reps"),
) -> None:
    """The engine's own Python time per verify outside llama_decode, by width, for a chain and for
    a bushy tree (batch build, KV sequence copies, argmax read, commit-equivalent discard)."""
    import time

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


if __name__ == "__main__":
    app()
