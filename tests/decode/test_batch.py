"""Requests decoded together (decode/batch.py on engine/llama_batch.py's LlamaBatch): one llama_decode a
step holds every active request's tree, and each reply is the one its request decodes alone."""

import subprocess
import sys

import pytest
from conftest import NEAR_TIE, assert_same_sample, prompt_tokens
from helpers import check_greedy, check_kv

from adaspark_core.base.errors import InputError
from adaspark_core.base.sampling import Sampling
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.batch import Batch
from adaspark_core.decode.generation import Generation

# (prompt, arm, max tokens, step it joins at, sampled): greedy and sampled requests in one batch,
# chains and trees of several widths, joining while others decode and ending at different steps.
REQUESTS = [
    ("explain.txt", "tree:8", 48, 0, False),
    ("code.txt", "chain:3", 40, 0, False),
    ("list.txt", "tree:16", 56, 3, False),
    ("story.txt", "chain:4", 36, 5, True),
    ("summary.txt", "ar", 12, 6, False),
]
SAMPLING = Sampling(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=11)


def solo(target, prompt, arm, max_tokens, sampling):
    gen = Generation(target, prompt, parse_arm(arm), max_tokens, sampling=sampling)
    for _ in gen:
        pass
    return gen.tokens


@pytest.mark.model
def test_replies_decoded_in_a_batch_equal_the_replies_decoded_alone(lm, target):
    from adaspark_core.engine.llama_batch import LlamaBatch

    # A small prefill budget: a joining prompt goes in over several steps, beside running rows.
    engine = LlamaBatch(lm, 4, n_ctx=512, prefill_per_step=24)
    batch = Batch(engine.verify)
    free = list(engine.slots)
    waiting = [(name, prompt_tokens(lm, name), arm, n, at, SAMPLING if sampled else None)
               for name, arm, n, at, sampled in REQUESTS]
    gens, widths, sizes = {}, {}, {}
    rounds_alone = 0
    mixed_steps = 0  # steps that verified some requests while others' prompts went in
    while waiting or batch.active:
        filling = [g for g in batch.active if g.target.pending]
        mixed_steps += 0 < len(filling) < len(batch.active)
        before = sum(len(g.target.pending) for g in filling)
        for req in [r for r in waiting if r[4] <= batch.steps and free]:
            waiting.remove(req)
            name, prompt, arm, n, _, how = req
            gen = Generation(free.pop(0), prompt, parse_arm(arm), n, request_id=name, sampling=how)
            batch.add(gen)
            gens[name], widths[name], sizes[name] = (req, gen), [], []
        stepped = batch.step()
        assert before - sum(len(g.target.pending) for g in filling) == min(24, before)  # the step's budget
        for gen, emitted in stepped:
            assert gen.request_id not in [g.request_id for g in filling]  # no round before its prompt is in
            widths[gen.request_id] += [gen.last_width] * len(emitted)
            check_kv(gen.target, sizes[gen.request_id])  # every slot's KV invariants, every step
            rounds_alone += 1
            if gen.finish is not None:
                free.append(gen.target)
    assert batch.steps < rounds_alone  # requests shared verifies
    assert mixed_steps >= 3  # the joining prompts (over 24 tokens each) took several steps each
    assert len(gens) == len(REQUESTS)
    for name, ((_, prompt, arm, n, _, how), gen) in gens.items():
        alone = solo(target, prompt, arm, n, how)
        if how is not None:
            assert_same_sample(lm, prompt, gen.tokens, alone, how, gen.seed, name)
            continue
        if gen.finish == "stop":
            widths[name].append(gen.last_width)
        check_greedy(lm, prompt, gen.tokens, gen.finish, widths[name])  # argmax but at near ties
        if gen.tokens != alone:  # the two part only where a re-score's top two nearly tie
            i = next(i for i, (a, b) in enumerate(zip(gen.tokens + [-1], alone + [-1])) if a != b)
            from adaspark_core.engine.llama_sequence import score

            row = score(lm, prompt + gen.tokens[:i])[-1]
            top = sorted(row)[-2:]
            assert top[1] - top[0] < NEAR_TIE, (name, i)


@pytest.mark.model
def test_a_batched_learning_run_replays_exactly_and_logs_its_steps(lm, tmp_path):
    """Six requests of the adaspark arm, four slots, one set of learners, greedy and sampled
    requests in the same steps: replaying the round log decides every step's widths as the run
    did (replay checks q, order, width and measurement) and ends with the same learned state; the
    replay report counts the rounds by requests in their step."""
    import orjson

    from adaspark_core.engine.llama_batch import LlamaBatch
    from adaspark_core.evaluate.replay import replay
    from adaspark_core.learn.learned import Learners
    from adaspark_core.store.record import RoundLog, read_log

    engine = LlamaBatch(lm, 4, n_ctx=512, prefill_per_step=32)
    learners = Learners()
    log = RoundLog(tmp_path / "rounds.jsonl")
    batch = Batch(engine.verify)
    free = list(engine.slots)
    names = ["rewrite.txt", "explain.txt", "code.txt", "list.txt", "story.txt", "summary.txt"]
    queue = [(i, name, prompt_tokens(lm, name)) for i, name in enumerate(names)]
    while queue or batch.active:
        while queue and free:
            i, name, prompt = queue.pop(0)
            how = SAMPLING if i % 3 == 2 else None
            batch.learn_previous_rounds()  # before its learners are chosen: a first sampled request copies its regime
            batch.add(Generation(free.pop(0), prompt, parse_arm("adaspark"), 48, request_id=f"{i}-{name}", log=log,
                                 learners=learners.regime(how is not None), sampling=how))
        for gen, _ in batch.step():
            if gen.finish is not None:
                free.append(gen.target)
    log.close()
    records = list(read_log(tmp_path / "rounds.jsonl"))
    assert all(r.step is not None for r in records) and max(r.step.requests for r in records) == 4
    assert sum(r.step.lead for r in records) == batch.steps  # a step of prompts alone has no round
    assert any(r.step.prefill for r in records)  # prompts went in beside verifying requests
    replayed, report = replay(records)  # raises ReplayMismatch at the first disagreement
    assert orjson.dumps(replayed.state()) == orjson.dumps(learners.state())
    by_load = report.to_json()["batched"]
    assert sum(v["rounds"] for v in by_load.values()) == len(records) and "4" in by_load
    times = report.to_json()["step_times"]  # where each load's steps spent their time
    assert sum(t["steps"] + t["prefill_steps"] for t in times.values()) == batch.steps
    assert times["4"]["ms"]["decode"] > 0 and 0 < times["4"]["host_share"] < 1
    # replay --regret gives the steps the step account (a lone round's would price each of a
    # step's rounds at the whole step's time): every step with rounds is in it or left out
    out = subprocess.run([sys.executable, "-m", "adaspark_cli.main", "replay", str(tmp_path / "rounds.jsonl"),
                          "--regret", "--json"], capture_output=True, text=True, check=True).stdout
    rep = orjson.loads(out)
    assert rep["regret"] == [] and [a["arm"] for a in rep["step_regret"]] == ["adaspark"]
    steps = {(r.step.batch, r.step.id) for r in records}
    acc = rep["step_regret"][0]
    assert acc["steps"] + acc["left_out_steps"] == len(steps)
    assert acc["fit"] is None or acc["oracle_rate"] >= acc["modelled_rate"] - 1e-9


@pytest.mark.model
def test_a_learning_arm_cannot_join_a_batch_of_another_arm(lm):
    from adaspark_core.engine.llama_batch import LlamaBatch

    engine = LlamaBatch(lm, 2, n_ctx=256)
    batch = Batch(engine.verify)
    batch.add(Generation(engine.slots[0], prompt_tokens(lm, "code.txt"), parse_arm("chain:3"), 8, request_id="a"))
    with pytest.raises(InputError, match="adaspark"):
        batch.add(Generation(engine.slots[1], prompt_tokens(lm, "list.txt"), parse_arm("adaspark"), 8, request_id="b"))
    assert len(batch.active) == 1


@pytest.mark.model
def test_slots_share_out_the_sequences_and_a_request_can_leave_mid_reply(lm):
    from adaspark_core.engine.llama_batch import LlamaBatch

    engine = LlamaBatch(lm, 8, n_ctx=256)
    assert [s.seq0 for s in engine.slots] == [32 * i for i in range(8)]
    assert all(s.max_width == 32 for s in engine.slots)  # 256 sequences among 8 slots
    batch = Batch(engine.verify)
    a = Generation(engine.slots[0], prompt_tokens(lm, "list.txt"), parse_arm("tree:16"), 40, request_id="a")
    b = Generation(engine.slots[1], prompt_tokens(lm, "code.txt"), parse_arm("chain:3"), 40, request_id="b")
    batch.add(a)
    batch.add(b)
    batch.step()
    batch.step()
    batch.drop(a, "stop")
    assert a.finish == "stop" and batch.active == [b]
    while batch.active:
        batch.step()
    assert b.finish is not None and len(b.tokens) > 0
