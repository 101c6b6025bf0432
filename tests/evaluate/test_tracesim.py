"""Trace simulation (adaspark_core/evaluate/tracesim.py, ``adaspark simulate``): the real scheduler and
learners decode recorded replies on a virtual clock priced by measured verify times."""


import orjson
import pytest
from conftest import ROOT
from helpers import adaspark, assert_one_error_line

from adaspark_core.base.errors import InputError
from adaspark_core.evaluate.replay import replay
from adaspark_core.evaluate.tracesim import (
    MeasuredCosts,
    Trace,
    first_half_conversations,
    read_traces,
    simulate,
    write_trace,
)
from adaspark_core.store.record import read_log

FIXTURE_LOG = ROOT / "fixtures" / "logs" / "rounds.jsonl"


def copy_trace(name="t0", finish="length", turn=0):
    """A prompt holding a passage, and a reply that copies it twice with a few words between:
    the n-gram fill finds the copies, so speculation pays."""
    passage = list(range(1000, 1040))
    prompt = list(range(10, 50)) + passage + list(range(60, 70))
    reply = [7, 8] + passage + [9] + passage[:30]
    return Trace(name, "copies", name.split("/")[0], turn, 0, prompt, reply, finish)


def costs():
    return MeasuredCosts([FIXTURE_LOG])  # a real run of the default model: widths 1, 2, 4, 8


def test_arms_decode_the_traces_exactly_and_speculation_pays_on_copies(tmp_path):
    traces = [copy_trace("a/0"), copy_trace("b/0", finish="stop"), copy_trace("c/0")]
    recs = simulate(traces, ["ar", "chain:3", "adaspark"], costs(), log_dir=tmp_path)
    by = {(r["arm"], r["conversation"]): r for r in recs}
    for t in traces:
        for arm in ("ar", "chain:3", "adaspark"):
            r = by[(arm, t.conversation)]
            assert r["tokens"] == len(t.tokens) and r["finish"] == t.finish  # simulate checks the tokens
            assert r["trace"][-1][0] == r["tokens"] and r["tok_s"] > 0
        assert by[("chain:3", t.conversation)]["tok_s"] > 1.5 * by[("ar", t.conversation)]["tok_s"]
    # one round log per arm, and the learning arm's replays exactly into its learners
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adaspark.jsonl", "ar.jsonl", "chain_3.jsonl"]
    adaptive = list(read_log(tmp_path / "adaspark.jsonl"))
    assert {r.request for r in adaptive} == {"a/0", "b/0", "c/0"}
    replay(adaptive)  # raises on any difference


def test_a_simulation_is_a_function_of_its_seed():
    traces = [copy_trace("a/0"), copy_trace("b/0")]
    one = simulate(traces, ["ar", "adaspark"], costs(), seed=3)
    assert simulate(traces, ["ar", "adaspark"], costs(), seed=3) == one
    assert simulate(traces, ["ar", "adaspark"], costs(), seed=4) != one


def test_warm_passes_run_the_learning_arms_first(tmp_path):
    traces = [copy_trace("a/0"), copy_trace("b/0")]
    recs = simulate(traces, ["ar", "adaspark"], costs(), warm=1, log_dir=tmp_path)
    assert len(recs) == 4  # the warm pass is not recorded
    warm = list(read_log(tmp_path / "warm-adaspark.jsonl"))
    assert {r.request for r in warm} == {"warm1:a/0", "warm1:b/0"}
    replay([*warm, *read_log(tmp_path / "adaspark.jsonl")])


def test_widths_past_the_measured_are_priced_per_row():
    c = costs()
    widest = max(c.table.widths)
    assert c.ms(2 * widest, 300) == pytest.approx(2 * c.ms(widest, 300))
    assert c.ms(1, 300) < c.ms(widest, 300)


def test_bad_traces_and_costs_get_one_line(tmp_path):
    good = tmp_path / "t.jsonl"
    write_trace(good, copy_trace())
    assert [t.request for t in read_traces([good])] == ["t0"]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(good.read_bytes() + b"{not json\n")
    with pytest.raises(InputError, match=r"bad.jsonl:2: not a trace line"):
        read_traces([bad])
    old = tmp_path / "old.jsonl"
    old.write_bytes(orjson.dumps({**copy_trace().to_json(), "schema": 99}) + b"\n")
    with pytest.raises(InputError, match="schema 99"):
        read_traces([old])
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(InputError, match="no trace"):
        read_traces([empty])
    assert_one_error_line(adaspark("simulate", tmp_path / "missing.jsonl", "--costs", FIXTURE_LOG), "cannot read")
    assert_one_error_line(adaspark("simulate", good, "--costs", good), "")
    assert_one_error_line(adaspark("simulate", good, "--costs", FIXTURE_LOG, "--arms", "ar,nope"), "unknown arm")
    assert_one_error_line(adaspark("simulate", good, "--costs", FIXTURE_LOG, "--arms", "chain:3,chain:3"), "twice")
    assert_one_error_line(adaspark("simulate", good, "--costs", FIXTURE_LOG, "--logs", good), "is a file")


def test_simulate_command_prints_compare_tables(tmp_path):
    traces = tmp_path / "t.jsonl"
    for i in range(3):
        write_trace(traces, copy_trace(f"c{i}/0"))
    res = adaspark("simulate", traces, "--costs", FIXTURE_LOG, "--arms", "chain:3,adaspark", "--resamples", 100)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("simulated: 3 traced replies") and "chain:3" in res.stdout and "adaspark" in res.stdout
    res = adaspark("simulate", traces, "--costs", FIXTURE_LOG, "--arms", "adaspark", "--resamples", 100,
                   "--warm", 1, "--warm-on", "first-half")
    assert res.returncode == 0, res.stderr
    assert "The 2 conversations the warm passes saw" in res.stdout
    assert "The 1 conversations the warm passes did not see (held out)" in res.stdout
    res = adaspark("simulate", traces, "--costs", FIXTURE_LOG, "--warm-on", "half")
    assert_one_error_line(res, "unknown --warm-on 'half'")


def test_warm_passes_over_the_first_half_leave_the_second_unseen(tmp_path):
    traces = [copy_trace("a/0"), copy_trace("a/1", turn=1), copy_trace("b/0"), copy_trace("c/0")]
    seen = first_half_conversations(traces)
    assert seen == {"a", "b"}  # of one source's three conversations, the first half rounded up
    recs = simulate(traces, ["ar", "adaspark"], costs(), warm=1, log_dir=tmp_path, warm_on=seen)
    assert {r.request for r in read_log(tmp_path / "warm-adaspark.jsonl")} == {"warm1:a/0", "warm1:a/1", "warm1:b/0"}
    assert {(r["conversation"], r["warmed"]) for r in recs} == {("a", True), ("b", True), ("c", False)}
    assert not any(r["warmed"] for r in simulate(traces[:1], ["ar"], costs()))  # cold: nothing was seen


def test_a_trace_that_keeps_its_end_token_ends_as_the_model_does(tmp_path):
    # An earlier turn in the prompt ends on the model's end token (5) and the reply copies that
    # turn to its end, well under its cap: the copy proposes the end token, which the simulated
    # target gives as the model did, so the round that reaches it ends the reply, and nothing
    # below it is verified. A trace of before (no end token, no cap) ends on a token no candidate
    # holds, capped at its own length.
    passage = list(range(1000, 1030))
    prompt = list(range(10, 30)) + passage + [5] + list(range(60, 64)) + passage[:6]
    kept = Trace("e/0", "copies", "e", 0, 0, prompt, passage[6:], "stop", end=5, max_tokens=128)
    write_trace(tmp_path / "t.jsonl", kept)
    assert read_traces([tmp_path / "t.jsonl"]) == [kept]
    sentinel = Trace("s/0", "copies", "s", 0, 0, prompt, passage[6:], "stop")  # a trace of before
    recs = simulate([kept, sentinel], ["tree:16"], costs(), log_dir=tmp_path)
    assert [r["finish"] for r in recs] == ["stop", "stop"]
    log = list(read_log(tmp_path / "tree_16.jsonl"))
    last = {r.request: r for r in log if r.last}
    assert [last["e/0"].candidates[j]["token"] for j in last["e/0"].path][-1] == 5
    assert 5 not in [last["s/0"].candidates[j]["token"] for j in last["s/0"].path]
    for r in log:
        if r.request == "e/0":
            assert all(r.candidates[r.candidates[j]["parent"]]["token"] != 5 for j in r.rows[1:]
                       if r.candidates[j]["parent"] >= 0)
