"""Round logs fuzzed (issue 39): every field of lone records (the fixture log, a real run of the
default model) and of batched records (a run on fake slots, test_replay.record_batched) dropped,
given a value of another type, put out of its range or pointed at a neighbouring candidate, and
whole lines cut, taken out, renamed, doubled and swapped. Every ``adaspark replay`` of every such
log, plain, with --regret and with --no-check, is one error line or a result, never a traceback.
Seeded: a failure names its case, and the same seed makes it again."""

import io
import random
from contextlib import redirect_stderr, redirect_stdout

import orjson
import pytest
import typer
from conftest import ROOT
from helpers import adaspark
from test_replay import record_batched

from adaspark_cli.replay_cmd import replay as replay_command

SEED = 39
FLAGS = ((), ("--regret",), ("--no-check",))
# Values of every JSON type, and numbers out of every range a field has (below 0, past 1, past 64 bits)
OTHERS = (None, True, False, "x", "", 1.5, -1, -2, 0, 2, 2**64 - 1, 1e300, [], [0], {}, {"a": 1})
LONE_LINES = 45  # the fixture log's first request, whole
LONE_MUTATED = (8, 18, 44)  # a measuring round of 32 candidates; a width-8 round accepting 7; the last round


def run(log, *flags) -> tuple[int, str, str]:
    """The replay command's function in this process, as ``adaspark replay LOG FLAGS`` calls it
    (without Typer's parsing, which costs more than a replay of these logs): (exit code, stdout,
    stderr). Any exception but the command's exit is raised: a traceback fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            replay_command([log], as_json=False, no_check="--no-check" in flags, regret="--regret" in flags,
                           costs=None, against=None)
        except typer.Exit as e:
            return e.exit_code, out.getvalue(), err.getvalue()
    return 0, out.getvalue(), err.getvalue()


def assert_one_line_or_a_result(log, code, out: str, err: str, case: str) -> None:
    """One error line naming the log (an error from inside that the command only wrapped would not
    know it), or a report with at most a cut last line and the skipped rounds said."""
    lines = err.splitlines()
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith(f"adaspark: error: {log}") and not out, (case, err)
    else:
        assert code == 0 and out and len(lines) <= 2 and all(x.startswith("adaspark: ") for x in lines), (case, code, err)


def leaves(v, path=()):
    """Every (path, value) inside a JSON value: each object's fields, a list's first two items and
    its last (a round's candidates, rows and path alike), and the containers themselves."""
    yield path, v
    if type(v) is dict:
        for k, x in v.items():
            yield from leaves(x, (*path, k))
    elif type(v) is list:
        for i in sorted({0, 1, len(v) - 1} & set(range(len(v)))):
            yield from leaves(v[i], (*path, i))


def edit(d: dict, path: tuple, value=None, drop=False) -> dict:
    d = orjson.loads(orjson.dumps(d))
    *up, last = path
    parent = d
    for k in up:
        parent = parent[k]
    if drop:
        del parent[last]
    else:
        parent[last] = value
    return d


def mutations(d: dict, rng: random.Random):
    """(what, the record mutated) for every field of ``d``: dropped; a value of another type or
    out of range; and a neighbour (an integer's: a reference to the next or the previous
    candidate, row or round; a flag's: the other; a list's: reversed, or with its first item
    again), else another."""
    for path, value in leaves(d):
        if not path:
            continue
        where = ".".join(map(str, path))
        near = ([value - 1, value + 1] if type(value) is int else [not value] if type(value) is bool
                else [value[::-1], value + value[:1]] if type(value) is list else [])
        for v in (rng.choice(OTHERS), rng.choice(near or OTHERS)):
            yield f"{where} = {v!r}", edit(d, path, v)
        yield f"{where} dropped", edit(d, path, drop=True)


def cuts(lines: list[bytes], rng: random.Random):
    """(what, the log's lines) with whole lines cut, taken out, renamed, doubled or swapped."""
    n = len(lines)
    requests = sorted({orjson.loads(x)["request"] for x in lines})
    yield "the first line cut", lines[1:]
    yield "the last line cut short", [*lines[:-1], lines[-1][: len(lines[-1]) // 2]]
    yield "the log twice", lines + lines
    yield "a request's lines taken out", [x for x in lines if orjson.loads(x)["request"] != requests[0]]
    for _ in range(6):
        i, j = sorted(rng.sample(range(n), 2))
        yield f"line {i + 1} taken out", [*lines[:i], *lines[i + 1:]]
        yield f"lines {i + 1} to {j} taken out", [*lines[:i], *lines[j:]]
        yield f"line {i + 1} twice", [*lines[: i + 1], *lines[i:]]
        yield f"lines {i + 1} and {j + 1} swapped", [*lines[:i], lines[j], *lines[i + 1: j], lines[i], *lines[j + 1:]]
        renamed = orjson.loads(lines[i])
        renamed["request"] = rng.choice([*requests, "zz"])
        yield f"line {i + 1} of request {renamed['request']}", [*lines[:i], orjson.dumps(renamed) + b"\n", *lines[i + 1:]]


def fuzz(tmp_path, lines: list[bytes], mutated: tuple[int, ...], seed: int) -> int:
    """Every mutation of the ``mutated`` lines and every cut of ``lines``, each replayed with one
    of FLAGS in turn; returns how many logs were replayed."""
    rng = random.Random(seed)
    log = tmp_path / "fuzzed.jsonl"
    cases = [(f"line {i + 1}: {what}", [*lines[:i], orjson.dumps(d) + b"\n", *lines[i + 1:]])
             for i in mutated for what, d in mutations(orjson.loads(lines[i]), rng)]
    cases += list(cuts(lines, rng))
    for k, (case, body) in enumerate(cases):
        log.write_bytes(b"".join(body))
        flags = FLAGS[k % len(FLAGS)]
        assert_one_line_or_a_result(log, *run(log, *flags), f"seed {seed}, {case}, flags {flags}")
    return len(cases)


def test_fuzzed_lone_logs_replay_to_one_line_or_a_result(tmp_path):
    lines = (ROOT / "fixtures" / "logs" / "rounds.jsonl").read_bytes().splitlines(keepends=True)[:LONE_LINES]
    assert fuzz(tmp_path, lines, LONE_MUTATED, SEED) > 800


@pytest.fixture(scope="module")
def batched_lines(tmp_path_factory) -> list[bytes]:
    path = tmp_path_factory.mktemp("fuzz") / "batched.jsonl"
    record_batched(path, requests=3, slots=2, tokens=16)
    return path.read_bytes().splitlines(keepends=True)


def test_fuzzed_batched_logs_replay_to_one_line_or_a_result(tmp_path, batched_lines):
    records = [orjson.loads(x) for x in batched_lines]
    # a request's first round; a step's lead with prompt tokens riding and a request admitted; a
    # round of a tree, accepted
    first = next(i for i, d in enumerate(records) if d["first"] and d["step"]["index"])
    lead = next(i for i, d in enumerate(records) if d["step"]["lead"] and d["step"].get("prefill") and d["step"]["began"])
    tree = max(range(len(records)), key=lambda i: (len(records[i]["path"]), records[i]["width"]))
    assert records[tree]["path"] and records[tree]["width"] > 2
    assert fuzz(tmp_path, batched_lines, (first, lead, tree), SEED + 1) > 800


def test_the_command_itself_prints_one_line_or_a_result(tmp_path, batched_lines):
    """The same through the real command (a process of its own): the exit code, one line on
    stderr, no traceback, for a damaged line, a cut batched log and a renamed request."""
    log = tmp_path / "log.jsonl"
    damaged = orjson.loads(batched_lines[5])
    damaged["step"]["cells"] = -1
    renamed = orjson.loads(batched_lines[-8])
    renamed["request"] = "zz"
    for case, body, flags in (
            ("cells -1", [*batched_lines[:5], orjson.dumps(damaged) + b"\n", *batched_lines[6:]], ("--regret",)),
            ("the first line cut", batched_lines[1:], ("--no-check",)),
            ("a request renamed", [*batched_lines[:-8], orjson.dumps(renamed) + b"\n", *batched_lines[-7:]], ())):
        log.write_bytes(b"".join(body))
        res = adaspark("replay", log, *flags)
        assert "Traceback" not in res.stderr, (case, res.stderr)
        assert_one_line_or_a_result(log, res.returncode, res.stdout, res.stderr, case)
        assert (res.returncode, run(log, *flags)[0]) in ((0, 0), (2, 2)), case
