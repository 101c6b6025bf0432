"""The ``adaspark`` command line: the Typer app and its commands, and the console entry point.
Each command lives in its own module and imports only adaspark_cli.console and the core (``serve``
imports its HTTP stack, an optional extra, when it runs); this
module imports them all and registers them, so nothing imports back from here."""

from __future__ import annotations

import os
import sys

import typer

from adaspark_cli import console
from adaspark_cli.compare_cmd import compare, simulate
from adaspark_cli.decode_cmd import decode
from adaspark_cli.models_cmd import models_app
from adaspark_cli.profile_cmd import profile
from adaspark_cli.replay_cmd import replay
from adaspark_cli.rpc_cmd import rpc_server
from adaspark_cli.serve_cmd import serve_stdin
from adaspark_cli.serve_http import serve
from adaspark_cli.store_cmd import inspect_store, store_app

# Help in click's plain layout (option names, then their help indented below), readable at 80
# columns; Typer's rich tables wrapped every option into a cell a few words wide. Sub-apps
# (store, models) inherit the mode from this app.
app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    context_settings={"max_content_width": 80},
    help="Speculative decoding with tree verification for llama.cpp models (AdaSpark).",
)


@app.callback()
def _main() -> None:
    """AdaSpark: speculative decoding with tree verification for llama.cpp models."""


app.command("decode")(decode)
app.command("replay")(replay)
app.command("serve-stdin")(serve_stdin)
app.command("serve")(serve)
app.command("profile")(profile)
app.command("compare")(compare)
app.command("simulate")(simulate)
app.command("rpc-server")(rpc_server)
app.add_typer(store_app, name="store")
app.add_typer(models_app, name="models")
app.command("inspect-store")(inspect_store)


def main(args: list[str] | None = None) -> None:
    """The console entry point. Usage errors (a bad option value, an unknown option) are one
    line on stderr and exit code 2, as the core's input errors are: help text is for
    ``--help``, not for a pipeline's log. Standard streams closed by the caller are put on
    /dev/null first, so no file the run opens takes their numbers."""
    closed = [fd for fd in (0, 1, 2) if not _is_open(fd)]
    for fd in closed:
        os.dup2(os.open(os.devnull, os.O_RDWR), fd)
    if 2 in closed:
        sys.stderr = open(os.devnull, "w")
    if 1 in closed:
        sys.stderr.write("adaspark: error: stdout is closed: give the output somewhere to go (> FILE)\n")
        sys.exit(2)
    console.run_app(app, args)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main()
