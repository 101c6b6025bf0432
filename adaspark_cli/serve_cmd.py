"""``adaspark serve-stdin``: JSON lines in, JSON lines out, one request at a time, learning while
it serves (request format: adaspark_core/serve/stdin_api.py).

Responses, one JSON object per line on stdout:

    {"id": ..., "delta": "text"}                                  (streamed requests, per round)
    {"id": ..., "done": true, "text": "...", "finish": "stop"|"length"|"context"|"interrupted",
     "prompt_tokens": n, "prompt_reused": n taken from the previous request's KV (--reuse-prefix),
     "stats": {"generated_tokens", "decode_tok_s", "tokens_per_round", "widths", ...}}
    {"id": ... or null, "error": "what was wrong"}                 (the server goes on serving)

The learners persist across requests, and the store is saved atomically after every request and
on exit. EOF ends the server (exit 0). SIGINT or SIGTERM between requests ends it at once; during
a request, after the current round: the reply ends with finish "interrupted", and the server
saves and exits (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from adaspark_cli import console
from adaspark_cli.console import reported
from adaspark_core.base.errors import InputError
from adaspark_core.decode.arms import Speculation
from adaspark_core.decode.runtime import EngineOptions, Runtime
from adaspark_core.serve.service import keep, serve_request
from adaspark_core.serve.stdin_api import RequestError, parse_request
from adaspark_core.store.record import LogWriteError


def serve_stdin(
    model: Optional[str] = console.MODEL,
    arm: str = console.ARM,
    drafter: str = console.DRAFTER,
    block: Optional[int] = console.BLOCK,
    draft_top_k: int = console.DRAFT_TOP_K,
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="A request's reply cap when it sets none."),
    store: Optional[Path] = console.STORE,
    memory_mb: float = console.MEMORY_MB,
    log: Optional[Path] = console.LOG,
    n_ctx: Optional[int] = console.N_CTX,
    chat_template_file: Optional[Path] = console.CHAT_TEMPLATE_FILE,
    threads: Optional[int] = console.THREADS,
    n_gpu_layers: Optional[str] = console.N_GPU_LAYERS,
    device: Optional[str] = console.DEVICE,
    tensor_split: Optional[str] = console.TENSOR_SPLIT,
    rpc: Optional[str] = console.RPC,
    rpc_timeout: float = console.RPC_TIMEOUT,
    reuse_prefix: bool = typer.Option(True, "--reuse-prefix/--no-reuse-prefix",
                                      help="Keep the last request's KV and prefill only what follows the common "
                                           "token prefix."),
) -> None:
    """Serve JSON-line requests from stdin, one at a time.

    Answers are JSON lines on stdout. A request: {"id", "prompt" (raw text) or "messages" (chat), "max_tokens", "stream"}."""
    if sys.stdin is None:
        console.fail("stdin is closed: serve-stdin reads its requests there")
    with reported():
        rt = Runtime.open(EngineOptions(model=model, n_ctx=n_ctx, threads=threads,
                                        layout=console.layout(n_gpu_layers, device, tensor_split, rpc, rpc_timeout), drafter=drafter, block=block,
                                            draft_top_k=draft_top_k, reuse_prefix=reuse_prefix,
                                            chat_template=console.chat_template(chat_template_file)),
                          Speculation.of(arm, memory_mb=memory_mb), store=store, log=log)
    server = Server(rt, max_tokens)
    signals = console.Signals().install()
    try:
        server.run(signals)
    except console.Interrupted:
        pass
    except BrokenPipeError:  # the reader went away: save and end quietly
        console.quiet_stdout()
    finally:
        signals.busy = True
        server.close()
    raise typer.Exit(signals.exit_code)


class Server:
    def __init__(self, rt: Runtime, max_tokens: int):
        self.rt = rt
        self.max_tokens = max_tokens
        self.served = 0

    def run(self, signals: console.Signals) -> None:
        rt = self.rt
        typer.echo(f"adaspark serve-stdin: ready ({rt.model.path.name}, arm {rt.arm.name}"
                   f"{', store ' + str(rt.store.path) if rt.store else ''})", err=True)
        number = 0
        for line in sys.stdin.buffer:
            if not line.strip():
                continue
            number += 1
            signals.busy = True
            try:
                req = parse_request(line, self.max_tokens, number)
                self.serve(req, stop=lambda: signals.got is not None)
            except RequestError as e:
                console.write_json({"id": e.id, "error": str(e)})
            finally:
                signals.busy = False
            if signals.got is not None:
                raise console.Interrupted

    def serve(self, req, stop) -> None:
        rt = self.rt
        try:
            prompt = rt.tokens(req.prompt) if req.prompt is not None else rt.chat(req.messages)
            grammar = rt.json_grammar(req.json_schema) if req.json_schema is not None else None
            on_text = (lambda text: console.write_json({"id": req.id, "delta": text})) if req.stream else None
            reply = serve_request(rt, prompt, req.max_tokens, req.name, stops=req.stops, sampling=req.sampling,
                                  on_text=on_text, cancelled=stop, on_warning=_warn, grammar=grammar)
        except InputError as e:
            raise RequestError(str(e), req.id) from None
        except LogWriteError as e:
            # The round log could not take a round (a full disk): the request ends with an error,
            # what the learners took from its rounds is saved, and the next request tries again.
            raise RequestError(f"{e}; the reply was cut short", req.id) from None
        self.served += 1
        console.write_json({"id": req.id, "done": True, "text": reply.text, "finish": reply.finish,
                            "prompt_tokens": reply.prompt_tokens, "prompt_reused": reply.prompt_reused,
                            "stats": reply.stats_json()})

    def close(self) -> None:
        """Save the learned state (a request's is saved when it ends; this covers a run with none),
        then release the store, the log and the engine."""
        try:
            keep(self.rt, 0, 0, _warn)
        finally:
            self.rt.close()


def _warn(message: str) -> None:
    typer.echo(f"adaspark: warning: {message}", err=True)
