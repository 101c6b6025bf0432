"""``adaspark replay``: fresh learners driven through logged runs, and how they predicted."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import orjson
import typer

from adaspark_cli.console import fail, reported
from adaspark_cli.report import regret_tables, replay_tables, step_regret_tables
from adaspark_core.base.errors import InputError
from adaspark_core.evaluate.regret import CostTable, account
from adaspark_core.evaluate.replay import ReplayMismatch
from adaspark_core.evaluate.replay import replay as run_replay
from adaspark_core.evaluate.step_regret import step_account
from adaspark_core.store.record import read_log


def replay(
    logs: list[Path] = typer.Argument(..., help="Round logs written by --log (JSON lines), replayed in the order given (e.g. a compare run's warm-adaspark.jsonl, then adaspark.jsonl)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    no_check: bool = typer.Option(False, "--no-check", help="Go on where replay and the log disagree."),
    regret: bool = typer.Option(False, "--regret", help="Add the hindsight account: what every width would have accepted and cost, the best single width, the per-round oracle, and the loss split by cause."),
    costs: Optional[list[Path]] = typer.Option(None, "--costs", help="More round logs (e.g. the other arms of the same bench) whose measured verify times price the widths; repeat it."),
) -> None:
    """Drive fresh learners through a logged run and report how they predicted: acceptance log
    loss per request (paper Table 2), calibration of S (Figure 10) and what the n-gram fill added
    (Table 7). Only rounds of learning arms (adaspark, pinned:N, cost) are replayed. With
    --regret, every arm of the log (fixed arms too) gets the hindsight account."""
    for p in [*logs, *(costs or [])]:
        if not p.exists():  # anything else there (a folder, a device) read_log names
            fail(f"round log not found: {p}")
    log = logs[-1]

    def cut(message: str) -> None:
        sys.stderr.write(f"adaspark: {message}\n")

    with reported():
        try:
            records = [r for p in logs for r in read_log(p, cut)]
            _, rep = run_replay(records, check=not no_check)
            cost_records = [r for p in costs or [] for r in read_log(p, cut)]
        except ReplayMismatch as e:
            raise InputError(f"{log}: {e} (is the log from another version? --no-check goes on)") from None
        except ValueError as e:
            raise InputError(str(e)) from None
        if not rep.requests and not regret:
            raise InputError(f"{log}: no rounds of a learning arm (adaspark, pinned:N, cost) to replay")
        report = rep.to_json() if rep.requests else {}
        if regret:
            table = CostTable(records + cost_records)
            # One account per arm and regime (sampled rounds accept by other odds than greedy ones) of lone
            # rounds; a batched step's rounds share one decode, so they get the step account.
            arms: dict[tuple, list] = {}
            batched: dict[str, list] = {}
            for r in records:
                if r.step is None:
                    arms.setdefault((r.arm, r.sampling is not None), []).append(r)
                else:
                    batched.setdefault(r.arm, []).append(r)
            report["regret"] = [{**account(rs, table, rep.model_choices).to_json(), "sampled": sampled}
                                for (_, sampled), rs in arms.items()]
            report["step_regret"] = [step_account(rs).to_json() for rs in batched.values()]
        if as_json:
            sys.stdout.write(orjson.dumps(report).decode() + "\n")
            return
        if rep.requests:
            sys.stdout.write(replay_tables(report))
        if regret:
            sys.stdout.write(regret_tables(report["regret"]) + step_regret_tables(report["step_regret"]))
