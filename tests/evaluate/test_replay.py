"""Replay drives fresh learners through a round log and reproduces the live state exactly; its
report adds up. A scripted target with repeating text, so the n-gram fill, the acceptance model's
buckets, the guard and exploration all run, with no model. A log is checked as it is read, a log
that lacks rounds is replayed where it is whole, and a replay can be compared with a saved store."""

import itertools

import orjson
import pytest
from conftest import PROMPTS, ROOT, SIM
from fakes import CostlyTarget, canonical, markov
from helpers import adaspark, assert_one_error_line

from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.batch import Batch
from adaspark_core.decode.generation import Generation
from adaspark_core.evaluate.replay import ReplayMismatch, replay
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import SCHEMA, LogReadError, RoundLog, read_log

# A real run's log written at round-log schema 3 (before ``reach`` was dropped), kept as it was.
SCHEMA_3_LOG = ROOT / "fixtures" / "logs" / "rounds-schema3.jsonl"
# A real run of the default model (``make fixture-log``): three requests decoded alone.
FIXTURE_LOG = ROOT / "fixtures" / "logs" / "rounds.jsonl"


def serve(log, arms=("adaspark", "ar", "pinned:6", "adaspark", "adaspark", "adaspark"), learners=None):
    learners = learners or Learners()
    target = CostlyTarget(markov, eog=0)
    for i, arm in enumerate(arms):
        prompt = [1 + (i * 3 + k * 5) % 40 for k in range(30 + 10 * i)]
        gen = Generation(target, prompt, parse_arm(arm), 150, request_id=f"r{i}", log=log,
                         learners=learners if parse_arm(arm).learns else None)
        for _ in gen:
            pass
    return learners


def test_replay_reproduces_the_live_learners_and_the_report_adds_up(tmp_path):
    path = tmp_path / "rounds.jsonl"
    with RoundLog(path) as log:
        live = serve(log)
    records = list(read_log(path))
    replayed, rep = replay(records)
    assert canonical(replayed.state()) == canonical(live.state())
    assert [r.request for r in rep.requests] == ["r0", "r2", "r3", "r4", "r5"]  # ar is skipped
    learning = [r for r in records if r.arm != "ar"]
    assert sum(r.rounds for r in rep.requests) == len(learning)
    assert sum(rep.rows.values()) == sum(r.width - 1 for r in learning if r.candidates)
    assert sum(rep.accepted.values()) == sum(len(r.path) for r in learning)
    assert rep.ngram_rounds > 0 and rep.rows["ngram"] > 0
    js = rep.to_json()
    assert js["acceptance"]["nodes"] == sum(r.nodes for r in rep.scored())
    assert js["calibration"]["rounds"] == len(rep.calibration) > 0


def test_replay_names_the_round_where_the_log_and_the_learners_disagree(tmp_path):
    path = tmp_path / "rounds.jsonl"
    with RoundLog(path) as log:
        serve(log, arms=("adaspark", "adaspark"))
    records = list(read_log(path))
    tampered = [r for r in records if r.candidates][3]
    tampered.candidates[0]["q"] += 0.01
    with pytest.raises(ReplayMismatch, match=f"request {tampered.request} round {tampered.round}: replay priced"):
        replay(records)
    replay(records, check=False)  # --no-check goes on


def test_replay_on_top_of_a_restored_store_state(tmp_path):
    """A second server process starts from the store: replaying its log on the restored state
    reproduces its final state too."""
    first = serve(None, arms=("adaspark", "adaspark"))
    saved = canonical(first.state())
    path = tmp_path / "two.jsonl"
    from adaspark_core.learn.acceptance import AcceptanceModel
    from adaspark_core.learn.chooser import AdaptiveWidth

    def restore():
        return Learners(AdaptiveWidth.from_state(saved["width"]), AcceptanceModel.from_state(saved["acceptance"]))

    with RoundLog(path) as log:
        live = serve(log, arms=("adaspark", "pinned:4"), learners=restore())
    replayed, _ = replay(read_log(path), restore())
    assert canonical(replayed.state()) == canonical(live.state())


def test_a_log_of_schema_4_with_reach_reads_and_replays_as_it_did(tmp_path):
    """Up to schema 4 a record said how many rows its sources could have filled (``reach``), for
    the cost model to move a width no tree filled; no measuring round is narrower than its width,
    so nothing read it and schema 5 drops it. The same rounds written with it read into the same
    records and replay into the same learners; what is written now has no such field."""
    path = tmp_path / "rounds.jsonl"
    with RoundLog(path) as log:
        live = serve(log, arms=("adaspark", "ar", "adaspark"))
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    assert all(d["schema"] == SCHEMA >= 5 and "reach" not in d for d in lines)
    assert any(d["measure"] is not None for d in lines)  # cold start: rounds that measured a width
    old = tmp_path / "old.jsonl"
    old.write_bytes(b"".join(orjson.dumps({**d, "schema": 4, "reach": 7}) + b"\n" for d in lines))
    records = list(read_log(old))
    assert records == list(read_log(path))
    assert all(orjson.loads(orjson.dumps(r.to_json())) == d for r, d in zip(records, lines))
    replayed, _ = replay(records)
    assert canonical(replayed.state()) == canonical(live.state())


def test_the_checked_in_log_of_schema_3_reads_without_reach():
    lines = [orjson.loads(x) for x in SCHEMA_3_LOG.read_bytes().splitlines()]
    assert {d["schema"] for d in lines} == {3} and all("reach" in d for d in lines)
    for rec in read_log(SCHEMA_3_LOG):
        d = rec.to_json()
        assert d["schema"] == SCHEMA and "reach" not in d and not hasattr(rec, "reach")


def test_a_schema_5_line_reads_as_a_round_verified_alone():
    """Schema 6 adds ``step`` (rounds verified together with other requests'); a line written
    before it reads as a round verified alone, and replays through the lone-round path."""
    from adaspark_core.store.record import RoundRecord

    line = {"request": "r", "round": 0, "context": 5, "arm": "ar", "anchor": 1, "candidates": [], "order": [],
            "offered": [1], "prices": None, "width": 1, "rows": [-1], "argmax": [2], "path": [], "bonus": 2,
            "emitted": [2], "times": {"draft": 0.1, "verify": 1.0, "commit": 0.1, "host": 0.1, "decode": 0.9,
                                       "learn": 0.0, "start": 0.0, "total": 1.2},
            "measure": None, "p_src": None, "priced": None, "explored": False, "first": True, "last": True,
            "finish": "length", "sampling": None, "schema": 5}
    rec = RoundRecord.from_json(line)
    assert rec.step is None and rec.schema == SCHEMA


# --- a batched run on fake slots ---------------------------------------------------------------


class Slot(CostlyTarget):
    """A slot of a batched engine, faked: a joining request's prompt waits (``start(defer=True)``)
    and goes in, a chunk a step, beside the other slots' verifies (``verify_together``)."""

    def __init__(self):
        super().__init__(markov, eog=0)
        self.pending: list[int] = []

    def start(self, tokens, defer=False):
        super().start(tokens)
        if defer:
            self.pending, self.kv = self.kv, []


def verify_together(items, filling, chunk=12):
    out = [slot.verify(lay) for slot, lay in items]
    for slot in filling:
        slot.kv += slot.pending[:chunk]
        del slot.pending[:chunk]
    return out


def record_batched(path, requests=7, slots=3, tokens=40) -> Learners:
    """A batched run of the adaspark arm: ``requests`` requests of ``tokens`` tokens and more on
    ``slots`` slots (a request joins as one leaves, its prompt going in over several steps), logged
    to ``path``; its learners. On a ticking clock and a fixed batch id, so the log is the same
    every time."""
    ticks = itertools.count()
    learners, batch = Learners(), Batch(verify_together)
    batch.id = "b0"
    free, queue = [Slot() for _ in range(slots)], list(range(requests))
    with RoundLog(path) as log:
        while queue or batch.active:
            while queue and free:
                i = queue.pop(0)
                batch.learn_previous_rounds()
                prompt = [1 + (i * 3 + k * 5) % 40 for k in range(30 + 7 * i)]
                batch.add(Generation(free.pop(0), prompt, parse_arm("adaspark"), tokens + 17 * (i % 3), request_id=f"r{i}",
                                     log=log, learners=learners, clock=lambda: next(ticks) * 1e-4))
            for gen, _ in batch.step():
                if gen.finish is not None:
                    free.append(gen.target)
    return learners


@pytest.fixture(scope="module")
def batched_log(tmp_path_factory) -> list[bytes]:
    """The lines of record_batched's log, which replays to exactly the run's learners."""
    path = tmp_path_factory.mktemp("batched") / "rounds.jsonl"
    live = canonical(record_batched(path).state())
    records = list(read_log(path))
    assert all(r.step is not None for r in records) and any(r.step.prefill for r in records)
    assert canonical(replay(records)[0].state()) == live
    return path.read_bytes().splitlines(keepends=True)


def edited(lines, i, edit) -> list[bytes]:
    d = orjson.loads(lines[i])
    edit(d)
    return [*lines[:i], orjson.dumps(d) + b"\n", *lines[i + 1:]]


# --- every line checked as it is read ----------------------------------------------------------

# Line 9 of the fixture log is a round with 32 candidates verified at width 2 (issue 39's cases)
LONE_DAMAGE = {
    "path 999": (lambda d: d.update(path=[999]), "path.0 is 999, not a verified child of the anchor"),
    "a row past the width": (lambda d: d["rows"].append(999), "rows has 3 items, not one per row of the width (2)"),
    "candidates not objects": (lambda d: d.update(candidates=[1, 2]), "candidates.0 is 1, not an object"),
    "a candidate without parent": (lambda d: d["candidates"][3].pop("parent"), "candidates.3.parent is missing"),
    "step {}": (lambda d: d.update(step={}), "step.batch is missing"),
    "step 5": (lambda d: d.update(step=5), "step is 5, not an object or null"),
    "q 'a'": (lambda d: d["candidates"][0].update(q="a"), "candidates.0.q is 'a', not a number in [0, 1]"),
    "round true": (lambda d: d.update(round=True), "round is True, not an integer >= 0"),
    "a parent below its child": (lambda d: d["candidates"][2].update(parent=5),
                                 "candidates.2.parent is 5, not an earlier candidate or the anchor (-1)"),
}
# a batched record (its step)
STEP_DAMAGE = {
    "max_rows removed": (lambda d: d["step"].pop("max_rows"), "step.max_rows is missing"),
    "index 'a'": (lambda d: d["step"].update(index="a"), "step.index is 'a', not an integer >= 0"),
    "draft 'x'": (lambda d: d["step"].update(draft="x"), "step.draft is 'x', not a number in [0, 1e+15]"),
    "cells -1": (lambda d: d["step"].update(cells=-1), "step.cells is -1, not an integer >= 1"),
    "cells below the context": (lambda d: d["step"].update(cells=d["context"] - 1), "fewer than this round's context"),
    "index past the requests": (lambda d: d["step"].update(index=d["step"]["requests"]), "not one of the step's"),
}


@pytest.mark.parametrize("case", LONE_DAMAGE)
def test_a_lone_line_that_does_not_hold_is_one_error_naming_it(tmp_path, case):
    edit, message = LONE_DAMAGE[case]
    log = tmp_path / "log.jsonl"
    log.write_bytes(b"".join(edited(FIXTURE_LOG.read_bytes().splitlines(keepends=True), 8, edit)))
    with pytest.raises(LogReadError) as e:
        list(read_log(log))
    assert str(e.value) == f"{log}:9: not a round record ({message})"


@pytest.mark.parametrize("case", STEP_DAMAGE)
def test_a_batched_line_that_does_not_hold_is_one_error_naming_it(tmp_path, batched_log, case):
    edit, message = STEP_DAMAGE[case]
    lines = batched_log
    log = tmp_path / "log.jsonl"
    log.write_bytes(b"".join(edited(lines, 20, edit)))
    with pytest.raises(LogReadError) as e:
        list(read_log(log))
    assert str(e.value).startswith(f"{log}:21: not a round record (") and message in str(e.value), str(e.value)


def test_the_lines_of_a_step_agree(tmp_path, batched_log):
    """A step's lines are consecutive and share its fields; each request and index once."""
    lines = batched_log
    step = orjson.loads(lines[20])["step"]
    mates = [i for i, x in enumerate(lines) if orjson.loads(x)["step"]["id"] == step["id"]]
    assert len(mates) >= 2
    log = tmp_path / "log.jsonl"
    log.write_bytes(b"".join(edited(lines, mates[1], lambda d: d["step"].update(rows=d["step"]["rows"] + 1))))
    with pytest.raises(LogReadError, match=f"{log}:{mates[1] + 1}: .*differ"):
        list(read_log(log))
    first = orjson.loads(lines[mates[0]])
    log.write_bytes(b"".join(edited(lines, mates[1], lambda d: d["step"].update(index=first["step"]["index"],
                                                                                  lead=first["step"]["lead"]))))
    with pytest.raises(LogReadError, match=f"{log}:{mates[1] + 1}: .*a second round"):
        list(read_log(log))


# --- logs that lack rounds --------------------------------------------------------------------


def test_a_lone_log_that_starts_mid_request_replays_from_the_next_request(tmp_path):
    """``tail -n +2``: the first request's other rounds need the state its first round began,
    so they are left out, said, and the next requests replay from their beginnings."""
    records = list(read_log(FIXTURE_LOG))
    first = records[0].request
    _, whole = replay(records)
    _, cut = replay(records[1:], check=False)
    assert [r.request for r in cut.requests] == [r.request for r in whole.requests][1:]
    skipped = sum(1 for r in records if r.request == first) - 1
    assert cut.skipped.rounds == skipped and cut.skipped.requests == {first}
    assert str(cut.skipped).startswith(f"skipped {skipped} rounds of 1 request")
    assert f"request {first} round 1: the log does not hold its earlier rounds" in str(cut.skipped)
    log = tmp_path / "cut.jsonl"
    log.write_bytes(b"".join(FIXTURE_LOG.read_bytes().splitlines(keepends=True)[1:]))
    res = adaspark("replay", log, "--no-check", "--json")
    assert res.returncode == 0 and res.stderr == f"adaspark: {log}: {cut.skipped}\n", res.stderr
    assert orjson.loads(res.stdout)["acceptance"]["requests"][0]["request"] == cut.requests[0].request


CUTS = {
    "first line cut": lambda lines: lines[1:],
    "a request's lines taken out": lambda lines: [x for x in lines if orjson.loads(x)["request"] != "r1"],
    "a request renamed in one line": lambda lines: edited(lines, 60, lambda d: d.update(request="zz")),
    "a line taken out": lambda lines: lines[:60] + lines[61:],
    "a step's line made lone": lambda lines: edited(lines, 60, lambda d: d.update(step=None)),
}


@pytest.mark.parametrize("case", CUTS)
def test_a_batched_log_that_lacks_rounds_replays_where_it_is_whole_or_says_why_not(tmp_path, batched_log, case):
    """A step's rounds were decided together, so a step that lacks one is left out, and with it
    every later round of its requests (their state lacks that round): replay goes on where the
    log is whole again, or, where nothing is, refuses in one line. Never a KeyError."""
    lines = batched_log
    log = tmp_path / "log.jsonl"
    log.write_bytes(b"".join(CUTS[case](lines)))
    records = list(read_log(log))
    _, rep = replay(records, check=False)
    assert rep.skipped and sum(r.rounds for r in rep.requests) + rep.skipped.rounds == len(records)
    res = adaspark("replay", log, "--regret")  # checked: exact where it replays, or one line
    said = res.stderr.strip().splitlines()
    if rep.requests:
        assert res.returncode in (0, 2) and len(said) == 1 and "skipped" in said[0], res.stderr
    else:
        assert_one_error_line(res, f"{log}: nothing to replay", "skipped")


# --- a replay compared with the run's store --------------------------------------------------


@pytest.fixture(scope="module")
def store_and_log(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("against")
    store, log = tmp / "store.json", tmp / "rounds.jsonl"
    for prompt in ("rewrite.txt", "list.txt"):
        res = adaspark("decode", PROMPTS / prompt, "--model", SIM, "-n", 60, "--store", store, "--log", log)
        assert res.returncode == 0, res.stderr
    return store, log


def test_replay_against_the_runs_store_says_they_are_equal(store_and_log):
    store, log = store_and_log
    res = adaspark("replay", log, "--against", store, "--json")
    assert res.returncode == 0, res.stderr
    assert res.stderr == f"adaspark: {store}: its learned sections equal the replay's\n"
    assert orjson.loads(res.stdout)["acceptance"]["requests"]


def test_replay_against_another_store_names_where_they_differ(tmp_path, store_and_log):
    store, log = store_and_log
    saved = orjson.loads(store.read_bytes())
    chooser = saved["sections"]["width"]["chooser"]
    chooser["held"] += 1
    other = tmp_path / "other.json"
    other.write_bytes(orjson.dumps(saved))
    assert_one_error_line(adaspark("replay", log, "--against", other), f"{other}: its learned sections differ from "
                          f"the replay at 1 field: width.chooser.held: store {chooser['held']}, replay {chooser['held'] - 1}")
    # one whose log lost its first request's rounds cannot be the run's: not compared
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(log.read_bytes().splitlines(keepends=True)[1:]))
    assert_one_error_line(adaspark("replay", cut, "--against", store, "--no-check"), f"{store}: not compared: replay skipped")


def test_replay_against_a_store_beside_a_log_with_no_rounds(tmp_path, store_and_log):
    """A server stopped while its prompts went in logs nothing: its store must be a fresh one."""
    store, _ = store_and_log
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    fresh = tmp_path / "fresh.json"
    saved = orjson.loads(store.read_bytes())
    fresh.write_bytes(orjson.dumps({**saved, "sections": {}}))
    res = adaspark("replay", empty, "--against", fresh)
    assert res.returncode == 0 and res.stderr == f"adaspark: {fresh}: its learned sections equal the replay's\n", res.stderr
    res = adaspark("replay", empty, "--against", store)
    assert_one_error_line(res, f"{store}: its learned sections differ from the replay")
