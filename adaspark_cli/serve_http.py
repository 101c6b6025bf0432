"""``adaspark serve``: an OpenAI-compatible HTTP server (POST /v1/chat/completions and
/v1/completions, streamed or not; GET /v1/models and /health) that learns across requests and
keeps the previous request's KV for the next one's common prefix. The HTTP stack is the
``adaspark[server]`` extra (FastAPI, uvicorn, sse-starlette), imported only by this command.
Request fields and defaults: adaspark_core/serve/openai_api.py; the app and shutdown:
adaspark_core/serve/http_app.py; the decoding thread: decoder.py; the limits on what one client may
take: http_limits.py."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from adaspark_cli import console
from adaspark_cli.console import reported
from adaspark_core.decode.arms import Speculation
from adaspark_core.decode.runtime import EngineOptions, Runtime


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0: every interface)."),
    port: int = typer.Option(8080, "--port", min=0, max=65535, help="Port to listen on (0: any free one, printed)."),
    model: Optional[str] = console.MODEL,
    arm: str = console.ARM,
    drafter: str = console.DRAFTER,
    block: Optional[int] = console.BLOCK,
    draft_top_k: int = console.DRAFT_TOP_K,
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
    parallel: int = typer.Option(1, "--parallel", "-np", min=1, max=64,
                                 help="Requests decoded together (llama-server's -np), each in a slot of --n-ctx "
                                      "tokens. llama.cpp models only, no --drafter."),
    queue_size: int = typer.Option(8, "--queue", min=0, help="Requests that may wait while the slots decode; the next gets 503."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, max=2.0,
                                      help="For requests that set none. 0: greedy, with speculation; above 0: "
                                           "sampled, with speculation that never changes the sample."),
    reuse_prefix: bool = typer.Option(True, "--reuse-prefix/--no-reuse-prefix",
                                      help="Keep the last request's KV and prefill only what follows the common "
                                           "token prefix."),
    max_body_mb: float = typer.Option(4.0, "--max-body-mb", min=0.001,
                                      help="Largest request body, in MB; a larger one gets 413 before it is read."),
    max_connections: int = typer.Option(64, "--max-connections", min=1,
                                        help="Open connections at most; at the cap a new one replaces the one idle "
                                             "longest, or gets 503 if every one has a request in progress."),
    header_timeout: float = typer.Option(10.0, "--header-timeout", min=0.01,
                                         help="Seconds a connection has to send a request's headers, from its "
                                              "opening or its previous reply; then it is closed."),
) -> None:
    """Serve the model over HTTP with OpenAI's API.

    It learns while it serves: one decode at a time, or --parallel N requests decoded together.
    Point any OpenAI client at http://HOST:PORT/v1 (any API key). Routes, fields and limits:
    docs/serving.md."""
    try:
        from adaspark_core.serve import http_app
        from adaspark_core.serve.http_limits import Limits
    except ImportError as e:
        console.fail(f"adaspark serve needs the server extra ({e.name} is missing): pip install 'adaspark[server]'")
    with reported():
        limits = Limits(int(max_body_mb * 2 ** 20), max_connections, header_timeout)
        sock = http_app.listen(host, port, max_connections)
        try:
            rt = Runtime.open(EngineOptions(model=model, n_ctx=n_ctx, threads=threads,
                                            layout=console.layout(n_gpu_layers, device, tensor_split, rpc, rpc_timeout), drafter=drafter, block=block,
                                            draft_top_k=draft_top_k, reuse_prefix=reuse_prefix, parallel=parallel,
                                            chat_template=console.chat_template(chat_template_file)),
                              Speculation.of(arm, memory_mb=memory_mb), store=store, log=log)
        except BaseException:
            sock.close()
            raise
        code = http_app.run(rt, sock, queue_size, temperature, limits,
                            warn=lambda m: typer.echo(f"adaspark: warning: {m}", err=True),
                            error=lambda m, trace: typer.echo(f"{trace}adaspark: error: {m}", err=True),
                            announce=lambda m: typer.echo(f"adaspark serve: {m}", err=True))
    raise typer.Exit(code)
