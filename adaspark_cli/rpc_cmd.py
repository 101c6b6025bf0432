"""``adaspark rpc-server``: this host's device served to llama.cpp RPC clients (engine/devices.py),
the installed library's own RPC server, so a host needs no llama.cpp build of its own."""

from __future__ import annotations

from typing import Optional

import typer

from adaspark_cli.console import reported
from adaspark_core.base.errors import InputError
from adaspark_core.engine.devices import serve_rpc


def rpc_server(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on. The RPC protocol has no authentication: never expose it to an open network."),
    port: int = typer.Option(50052, "--port", min=1, max=65535, help="Port to listen on."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads of a CPU device (default: all)."),
    device: Optional[str] = typer.Option(None, "--device", help="The device to serve, by llama.cpp's name (default: the first GPU, else the CPU)."),
) -> None:
    """Serve this host's device to llama.cpp RPC clients until stopped.

    A client (decode, serve, compare ... --rpc HOST:PORT, or llama.cpp's own --rpc) puts layers
    of its model on it; docs/devices.md."""
    with reported():
        if host != "127.0.0.1":
            typer.echo(f"adaspark: warning: serving RPC on {host}: it has no authentication; keep it off open networks",
                       err=True)
        serve_rpc(host, port, threads, device,
                  on_ready=lambda name: typer.echo(f"adaspark: RPC server on {host}:{port}, device {name}", err=True))
        raise InputError(f"the RPC server could not listen on {host}:{port}")
