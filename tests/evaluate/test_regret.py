"""The hindsight account (adaspark_core/evaluate/regret.py): hindsight acceptance from a log alone, the
identities the account's numbers must satisfy, and the CLI's report."""

import math
import subprocess
import sys

import orjson
import pytest

from adaspark_core.base.tree import ANCHOR
from adaspark_core.base.tree import hindsight_path as true_path
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.engine.sim import make_sim
from adaspark_core.evaluate.regret import CATEGORIES, CostTable, accepted_by_width, account, continuations
from adaspark_core.evaluate.replay import replay
from adaspark_core.learn.learned import Learners
from adaspark_core.store.record import RoundLog, read_log


def cand(token, parent):
    return {"token": token, "parent": parent}


def test_true_path_follows_the_continuation_through_placed_and_unplaced_candidates():
    # anchor -> 5 -> 6 -> 7 and anchor -> 9; the continuation is 5 6 8
    cands = [cand(5, ANCHOR), cand(9, ANCHOR), cand(6, 0), cand(7, 2), cand(8, 2)]
    assert true_path(cands, [5, 6, 8, 1]) == [0, 2, 4]
    assert true_path(cands, [9]) == [1]
    assert true_path(cands, [4, 5]) == []
    # every prefix of the order is a tree: a(n) counts the path's nodes among the first n - 1
    order = [0, 2, 1, 4, 3]
    assert accepted_by_width(order, [0, 2, 4]) == [0, 1, 2, 2, 3, 3]


def test_continuations_are_the_tokens_committed_from_each_anchor_on():
    class R:
        def __init__(self, path_tokens, bonus):
            self.candidates = [cand(t, ANCHOR) for t in path_tokens]
            self.path = list(range(len(path_tokens)))
            self.bonus = bonus

    recs = [R([1, 2], 3), R([], 4), R([5], 6)]
    assert continuations(recs) == [[1, 2, 3, 4, 5, 6], [4, 5, 6], [5, 6]]


def sim_log(tmp_path, arm, requests=3, seed=0):
    target, drafter, clock, _ = make_sim("cpu-smollm2-q4_0", seed=seed)
    path = tmp_path / f"{arm.replace(':', '_')}.jsonl"
    learners = Learners()
    with RoundLog(path) as log:
        for q in range(requests):
            prompt = drafter.text.span(0, 200 + 500 * q)
            gen = Generation(target, prompt, parse_arm(arm), 200, clock=clock, drafter=drafter,
                             learners=learners if parse_arm(arm).learns else None, log=log, request_id=f"q{q}")
            for _ in gen:
                pass
    return list(read_log(path))


def test_a_pinned_arm_is_its_own_width_in_hindsight(tmp_path):
    recs = sim_log(tmp_path, "pinned:8")
    acc = account(recs, CostTable(recs)).to_json()
    # The simulated target is width-invariant: a(width) is what each round accepted.
    assert acc["hindsight_mismatch"] == 0
    assert acc["modelled_rate"] == pytest.approx(acc["width_rates"]["8"], rel=1e-12)
    assert acc["oracle_rate"] >= acc["best_width_rate"] >= acc["width_rates"]["8"]


def test_the_adaptive_account_adds_up(tmp_path):
    recs = sim_log(tmp_path, "adaspark")
    costs = CostTable(recs + sim_log(tmp_path, "pinned:4") + sim_log(tmp_path, "chain:2"))
    _, rep = replay(recs)
    acc = account(recs, costs, rep.model_choices).to_json()
    assert set(acc["loss_ms"]) == set(CATEGORIES)
    # The causes add up to the time the run took beyond its tokens at the best width's rate.
    modelled_ms = acc["tokens"] / acc["modelled_rate"] * 1e3
    at_best_ms = acc["tokens"] / acc["best_width_rate"] * 1e3
    assert acc["loss_total_ms"] == pytest.approx(modelled_ms - at_best_ms, rel=1e-6, abs=1e-6)
    assert acc["loss_ms"]["adaptivity"] <= 1e-9  # choosing per round never loses to one width
    assert acc["oracle_rate"] >= acc["best_width_rate"] - 1e-9
    assert max(acc["width_rates"].values()) == pytest.approx(acc["best_width_rate"])
    assert sum(acc["realised_widths"].values()) == acc["rounds"] == len(recs)
    assert rep.model_choices  # the chooser's own argmax was rebuilt for the priced rounds
    parts = acc["host_ms"]
    assert math.isclose(sum(parts.values()) + acc["verify_ms"], acc["wall_ms"], rel_tol=1e-9)


def test_replay_regret_on_the_command_line(tmp_path):
    recs = sim_log(tmp_path, "adaspark")
    log = tmp_path / "adaspark.jsonl"
    cmd = [sys.executable, "-m", "adaspark_cli.main", "replay", str(log), "--regret"]
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True).stdout
    doc = orjson.loads(out)
    assert [a["arm"] for a in doc["regret"]] == ["adaspark"] and doc["regret"][0]["rounds"] == len(recs)
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "Loss to the best single width" in text and "per-round oracle" in text
    missing = subprocess.run(cmd + ["--costs", str(tmp_path / "nope.jsonl")], capture_output=True, text=True)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1 and "not found" in missing.stderr
