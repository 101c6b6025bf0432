"""Replay drives fresh learners through a round log and reproduces the live state exactly; its
report adds up. A scripted target with repeating text, so the n-gram fill, the acceptance model's
buckets, the guard and exploration all run, with no model."""

import orjson
import pytest
from conftest import ROOT
from fakes import CostlyTarget, canonical, markov

from adaspark_core.decode.scheduler import Generation, parse_arm
from adaspark_core.evaluate.replay import ReplayMismatch, replay
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import SCHEMA, RoundLog, read_log

# A real run's log written at round-log schema 3 (before ``reach`` was dropped), kept as it was.
SCHEMA_3_LOG = ROOT / "fixtures" / "logs" / "rounds-schema3.jsonl"


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
