"""``adaspark decode``: one reply, streamed to stdout, a summary on stderr."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from adaspark_cli import console
from adaspark_cli.console import reported
from adaspark_core.decode.arms import Speculation
from adaspark_core.decode.generation import Generation
from adaspark_core.decode.round import INTERRUPTED
from adaspark_core.decode.runtime import EngineOptions, Runtime


def decode(
    prompt_file: str = typer.Argument(..., help="File with the prompt text, or - for stdin."),
    model: Optional[str] = console.MODEL,
    arm: str = typer.Option("adaspark", "--arm", help="adaspark, cost, pinned:N, tree:N, chain:N or ar (see above)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="Most tokens to generate."),
    raw: bool = typer.Option(False, "--raw", help="Send the text as is, without the model's chat template."),
    system: Optional[str] = typer.Option(None, "--system", help="A system message (chat mode)."),
    log: Optional[Path] = console.LOG,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object (text and statistics) instead of streaming."),
    n_ctx: Optional[int] = console.N_CTX,
    chat_template_file: Optional[Path] = console.CHAT_TEMPLATE_FILE,
    json_schema: Optional[str] = console.JSON_SCHEMA,
    threads: Optional[int] = console.THREADS,
    n_gpu_layers: Optional[str] = console.N_GPU_LAYERS,
    device: Optional[str] = console.DEVICE,
    tensor_split: Optional[str] = console.TENSOR_SPLIT,
    rpc: Optional[str] = console.RPC,
    rpc_timeout: float = console.RPC_TIMEOUT,
    store: Optional[Path] = console.STORE,
    memory_mb: float = console.MEMORY_MB,
    drafter: str = console.DRAFTER,
    block: Optional[int] = console.BLOCK,
    draft_top_k: int = console.DRAFT_TOP_K,
    temperature: float = console.TEMPERATURE,
    sample_top_k: int = console.SAMPLE_TOP_K,
    top_p: float = console.TOP_P,
    min_p: float = console.MIN_P,
    seed: Optional[int] = console.SEED,
) -> None:
    """Decode a reply to PROMPT_FILE, streamed to stdout. A summary goes to stderr.

    Arms: ar, chain:N (at most N draft tokens), tree:N (N rows), pinned:N (N rows, learners on),
    cost (learned width, no n-gram), adaspark (learned width with n-gram candidates)."""
    how = console.sampling(temperature, sample_top_k, top_p, min_p, seed)
    schema = console.json_schema(json_schema)
    text = console.read_prompt(prompt_file)
    system = console.utf8(system, "--system") if system is not None else None
    with reported(), Runtime.open(EngineOptions(model=model, n_ctx=n_ctx, threads=threads,
                                                layout=console.layout(n_gpu_layers, device, tensor_split, rpc, rpc_timeout), drafter=drafter,
                                                block=block, draft_top_k=draft_top_k,
                                                chat_template=console.chat_template(chat_template_file)),
                                  Speculation.of(arm, memory_mb=memory_mb), store=store, log=log) as rt:
        if raw:
            prompt = rt.tokens(text)
        else:
            prompt = rt.chat(([{"role": "system", "content": system}] if system else [])
                             + [{"role": "user", "content": text}])
        grammar = rt.json_grammar(schema) if schema is not None else None
        gen = rt.generation(prompt, max_tokens, request_id=Path(prompt_file).name, sampling=how, grammar=grammar)
        # Ctrl-C or SIGTERM ends the reply at a round boundary, as ``serve`` does: its last round
        # logged as interrupted and the store saved equal to a replay of the log. (Raised
        # mid-round, KeyboardInterrupt left a round learned and never logged.)
        signals = console.Signals(force=True).install()
        signals.busy = True
        try:
            text_out = rt.run(gen, on_text=None if as_json else _write,
                              stop=lambda: INTERRUPTED if signals.got is not None else None)
        except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, the store keeps its last save
            raise
        except BaseException:  # a failed log write: what was learned is kept
            _save(rt, gen)
            raise
        _save(rt, gen)
        st = gen.stats
        if as_json:
            console.write_json({"text": text_out, "model": str(rt.model.path), "arm": rt.arm.name,
                                "prompt_tokens": len(prompt), "finish": gen.finish, **st.to_json(),
                                **({"sampling": how.describe(), "seed": gen.seed} if how else {})})
        else:
            _write("\n")
            _summary(rt, gen, how)
    if signals.got is not None:
        raise typer.Exit(signals.exit_code)


def _summary(rt: Runtime, gen: Generation, how) -> None:
    st = gen.stats
    tps = f"{st.decode_tps:.1f} tok/s" if st.decode_tps else "n/a (one delta)"
    typer.echo(
        f"[{rt.arm.name}{f', sampled: {how.describe()}, seed {gen.seed}' if how else ''}] "
        f"{st.generated} tokens in {st.rounds} rounds "
        f"({st.tokens_per_round:.2f} tokens/round), decode {tps}, finish {gen.finish}\n"
        f"  widths (rows: rounds)      {console.histogram(st.widths)}\n"
        f"  accepted (drafts: rounds)  {console.histogram(st.accepted)}",
        err=True,
    )


def _save(rt: Runtime, gen: Generation) -> None:
    """The learned state, counting the request only if it has a round (a request stopped during
    its prompt left nothing in the log: Generation.close forgot it)."""
    rt.save(rounds=gen.stats.rounds, requests=1 if gen.stats.rounds else 0)


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()
