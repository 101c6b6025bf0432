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
from adaspark_core.evaluate.replay import ABSENT, ReplayMismatch, ReplayRefused, state_differences, whole_rounds
from adaspark_core.evaluate.replay import replay as run_replay
from adaspark_core.evaluate.step_regret import step_account
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import read_log
from adaspark_core.store.store import Store

SHOWN = 3  # differing fields named when the learners and a store differ


def replay(
    logs: list[Path] = typer.Argument(..., help="Round logs written by --log (JSON lines), replayed in the order given (e.g. a compare run's warm-adaspark.jsonl, then adaspark.jsonl)."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON object."),
    no_check: bool = typer.Option(False, "--no-check", help="Go on where replay and the log disagree."),
    regret: bool = typer.Option(False, "--regret", help="Add the hindsight account: what every width would have accepted and cost, the best single width, the per-round oracle, and the loss split by cause."),
    costs: Optional[list[Path]] = typer.Option(None, "--costs", help="More round logs (e.g. the other arms of the same bench) whose measured verify times price the widths; repeat it."),
    against: Optional[Path] = typer.Option(None, "--against", help="The store the logged run saved: compare the replayed learners with it and name where they differ (exit code 2 if they do)."),
) -> None:
    """Replay round logs through fresh learners.

    The report says how they predicted: acceptance log loss per request (paper Table 2), calibration of S (Figure 10) and what the n-gram fill added
    (Table 7). Only rounds of learning arms (adaspark, pinned:N, cost) are replayed. With
    --regret, every arm of the log (fixed arms too) gets the hindsight account. Every line is
    checked as it is read; rounds the log does not hold whole (a log that starts mid-request, a
    request's or a step's rounds missing) are left out, and a line on stderr says so."""
    for p in [*logs, *(costs or [])]:
        if not p.exists():  # anything else there (a folder, a device) read_log names
            fail(f"round log not found: {p}")
    log = logs[-1]
    named = str(log) if len(logs) == 1 else "the logs"

    def note(message: str) -> None:
        sys.stderr.write(f"adaspark: {message}\n")

    with reported():
        try:
            records = [r for p in logs for r in read_log(p, note)]
            learners, rep = run_replay(records, check=not no_check)
            cost_records = [r for p in costs or [] for r in read_log(p, note)]
        except ReplayMismatch as e:
            raise InputError(f"{log}: {e} (is the log from another version? --no-check goes on)") from None
        except ReplayRefused as e:
            raise InputError(f"{log}: {e}") from None
        except ValueError as e:
            raise InputError(str(e)) from None
        # The hindsight accounts take what replay takes: a round's continuation, a step's rows,
        # are the run's only where the log holds its request, its step, whole.
        whole = whole_rounds(records)[0] if regret else []
        if rep.skipped and not rep.requests and not whole:
            raise InputError(f"{named}: nothing to replay: {rep.skipped}")
        if not rep.requests and not regret and against is None:  # (a store beside an empty log must be fresh)
            raise InputError(f"{log}: no rounds of a learning arm (adaspark, pinned:N, cost) to replay")
        if against is not None:
            compare_with_store(learners, against, rep.skipped)
        elif rep.skipped:
            note(f"{named}: {rep.skipped}")
        report = rep.to_json() if rep.requests else {}
        if regret:
            table = CostTable(records + cost_records)
            # One account per arm and regime (sampled rounds accept by other odds than greedy ones) of lone
            # rounds; a batched step's rounds share one decode, so they get the step account.
            arms: dict[tuple, list] = {}
            batched: dict[str, list] = {}
            for r in whole:
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


def compare_with_store(learners: Learners, path: Path, skipped) -> None:
    """The replayed learners against the learned sections of the store at ``path`` (read, never
    written, no lock taken: the run may still hold it), exactly, as plain JSON: a line on stderr
    if they are equal, InputError naming the first fields that differ otherwise. A replay that
    left rounds out is not compared: learners that did not see them cannot be the run's."""
    if skipped:
        raise InputError(f"{path}: not compared: replay {skipped}, so its learners cannot be the run's")
    store, _ = Store.read(path, hint="it was not compared")
    saved = orjson.loads(orjson.dumps(Learners.from_store(store, hint="it was not compared").state()))
    replayed = orjson.loads(orjson.dumps(learners.state()))
    diffs = list(state_differences(replayed, saved))
    if diffs:
        shown = "; ".join(f"{where}: store {_show(b)}, replay {_show(a)}" for where, a, b in diffs[:SHOWN])
        raise InputError(f"{path}: its learned sections differ from the replay at {len(diffs)} "
                         f"field{'s' * (len(diffs) != 1)}: {shown}" + ("; ..." if len(diffs) > SHOWN else ""))
    sys.stderr.write(f"adaspark: {path}: its learned sections equal the replay's\n")


def _show(v) -> str:
    s = "(absent)" if v is ABSENT else orjson.dumps(v).decode()
    return s if len(s) <= 40 else s[:37] + "..."
