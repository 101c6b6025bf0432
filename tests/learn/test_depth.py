"""The draft depth learner (learn/depth.py) against known ground truth: the simulated target and a
simulated draft model that drafts position by position (engine/sim.py SimDrafter with
``position_ms``), whose picks' h are their true acceptance.

- on a flat verify ladder (a GPU's) with a draft at a tenth of a target row it drafts deep where
  the draft is right and stops where it is not, and beats every fixed depth (block-chain, chain:3)
  by 10% or more on a workload of easy and hard requests;
- on a CPU's steep ladder with a draft at half a row nothing pays, and it decodes as plain
  decoding does (within 2%), where a fixed depth loses half;
- its rounds log their forwards, and replay asks it again before each forward and gets the run's
  depths (a log that says otherwise is a mismatch); its state round-trips through the store.
"""

import copy
import dataclasses

import orjson
import pytest

from adaspark_core.base.checks import NewerVersion
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.engine.sim import CostCurve, DraftParams, make_sim
from adaspark_core.evaluate.replay import ReplayMismatch, replay
from adaspark_core.learn.depth import DraftDepth
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import RoundLog, RoundRecord, read_log

GPU = CostCurve.from_points([(1, 20.0), (8, 21.0), (16, 23.0), (32, 27.0), (64, 35.0)])  # a flat ladder
CPU = CostCurve.from_points([(1, 40.0), (2, 68.0), (4, 116.0), (8, 270.0), (16, 330.0), (64, 1200.0)])  # 1.7x a row
EASY = DraftParams(block=8, accept=(0.95,))
HARD = DraftParams(block=8, accept=(0.45,))


def decode(arm: str, curve: CostCurve, position_ms: float, seeds=range(8), tokens=300, log=None):
    """Tokens per ms over requests alternating EASY and HARD drafts (one learner set, as a server
    keeps it), and the drafted depths of the rounds."""
    spec = parse_arm(arm)
    learners = Learners.fresh() if spec.learns else None
    tokens_out, ms, depths = 0, 0.0, []
    for seed in seeds:
        target, drafter, clock, prompt = make_sim("x", seed=seed, curve=curve, params=(EASY, HARD)[seed % 2],
                                                  position_ms=position_ms, draft_ms=0.0)
        gen = Generation(target, prompt, spec, tokens, drafter=drafter, clock=clock, learners=learners,
                         request_id=f"r{seed}", log=log)
        for emitted in gen:
            tokens_out += len(emitted)
            depths.append((seed % 2, len(gen.last_record.drafting.forwards)))
        ms += clock.ms
    return tokens_out / ms, depths, learners


def js(x):
    """JSON, as a store holds it."""
    return orjson.loads(orjson.dumps(x))


def mean_depth(depths, hard: int) -> float:
    ds = [d for h, d in depths if h == hard]
    return sum(ds) / len(ds)


def test_on_a_flat_ladder_it_drafts_deep_where_the_draft_is_right_and_beats_every_fixed_depth():
    rate = {arm: decode(arm, GPU, position_ms=2.0)[:2] for arm in ("ar", "adaspark", "block-chain", "chain:3")}
    ours, depths = rate["adaspark"]
    print({arm: round(r / rate["ar"][0], 2) for arm, (r, _) in rate.items()})
    assert ours >= 1.10 * rate["block-chain"][0] and ours >= 1.10 * rate["chain:3"][0]
    assert mean_depth(depths, hard=0) >= 5 and mean_depth(depths, hard=1) <= 2


def test_on_a_cpu_ladder_nothing_pays_and_it_decodes_as_plain_decoding():
    rate = {arm: decode(arm, CPU, position_ms=20.0)[:2] for arm in ("ar", "adaspark", "chain:3")}
    ours, depths = rate["adaspark"]
    print({arm: round(r / rate["ar"][0], 3) for arm, (r, _) in rate.items()})
    assert ours >= 0.98 * rate["ar"][0] and rate["chain:3"][0] < 0.7 * rate["ar"][0]
    assert sum(d > 0 for _, d in depths) < 0.05 * len(depths)  # cold measuring and rare probes


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    path = tmp_path_factory.mktemp("depth") / "rounds.jsonl"
    _, depths, learners = decode("adaspark", GPU, position_ms=2.0, seeds=range(4), tokens=200, log=RoundLog(path))
    return learners, list(read_log(path)), depths


def test_replay_asks_again_before_each_forward_and_gets_the_runs_depths(logged):
    learners, records, depths = logged
    assert len({d for _, d in depths}) >= 3  # depths of every kind, 0 included
    replayed, _ = replay(records)  # checks every round's depth
    assert js(replayed.depth.state()) == js(learners.depth.state())
    assert learners.depth.rounds == sum(r.drafting.limit > 0 for r in records)  # not the budget's last token
    state = js(learners.depth.state())
    assert js(DraftDepth.from_state(state).state()) == state
    assert js(learners.state())["depth"] == state


def test_a_log_that_drafted_otherwise_is_a_mismatch(logged):
    """A round that stopped before its limit, logged with one forward more (as an end token would
    have cut the last position's picks): replay's learner stops where the run's did."""
    _, records, _ = logged
    i, rec = next((i, r) for i, r in enumerate(records)
                  if not r.first and 0 < len(r.drafting.forwards) < r.drafting.limit)
    depth = len(rec.drafting.forwards)
    longer = dataclasses.replace(rec, drafting=dataclasses.replace(rec.drafting, forwards=[*rec.drafting.forwards, 2.0]))
    longer = RoundRecord.from_json(orjson.loads(orjson.dumps(longer.to_json())))  # a line the writer could write
    with pytest.raises(ReplayMismatch, match=rf"round {rec.round}: replay drafts only {depth} positions; the log has {depth + 1}"):
        replay([*records[:i], longer, *records[i + 1:]])


@pytest.mark.parametrize("bad", [
    {"forwards": [1.0, 2.0], "rows": 0, "limit": 8, "max_rows": 64},  # forwards but no first rows
    {"forwards": [], "rows": 3, "limit": 8, "max_rows": 64},  # rows without a forward
    {"forwards": [1.0] * 9, "rows": 1, "limit": 8, "max_rows": 64},  # past its limit
    {"forwards": [-1.0], "rows": 1, "limit": 8, "max_rows": 64},
    {"forwards": [1.0], "rows": 1, "limit": 8},
])
def test_a_drafting_field_the_writer_could_not_have_written_is_refused(logged, bad):
    _, records, _ = logged
    d = orjson.loads(orjson.dumps(next(r for r in records if r.drafting.forwards).to_json()))
    d["drafting"] = bad
    with pytest.raises(ValueError, match="drafting"):
        RoundRecord.from_json(d)


def test_an_older_log_reads_with_no_drafting():
    d = orjson.loads(orjson.dumps(next(iter(read_log_fixture())).to_json()))
    d["schema"] = 6
    del d["drafting"]
    assert RoundRecord.from_json(d).drafting is None


def read_log_fixture():
    from conftest import ROOT
    return read_log(ROOT / "fixtures" / "logs" / "rounds.jsonl")


def test_a_store_that_never_met_a_draft_model_has_no_depth_section(logged):
    assert "depth" not in Learners.fresh().state()
    learners, _, _ = logged
    st = js(learners.state())
    assert js(Learners.from_state(st).depth.state()) == st["depth"]
    newer = copy.deepcopy(st)
    newer["depth"]["version"] = 2
    with pytest.raises(NewerVersion, match=r"depth\.version is 2"):
        Learners.from_state(newer)
