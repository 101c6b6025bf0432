"""The hindsight account of batched steps (evaluate/step_regret.py) on a constructed log whose
truth is known: request A proposes a chain the target always follows and verifies only its
anchor; request B proposes a chain the target never follows and verifies all of it. Each step's
decode takes exactly 5 + rows + 0.01 cells ms."""

import pytest

from adaspark_core.base.decision import WidthDecision
from adaspark_core.evaluate.step_regret import step_account
from adaspark_core.store.record import RoundRecord, Step, Timing

STEPS = 12
HOST = 0.5  # each step's planning time, the same at every width


def chain(tokens: list[int]) -> list[dict]:
    return [{"parent": j - 1, "token": t, "q": 0.5, "depth": j + 1} for j, t in enumerate(tokens)]


def decode_ms(rows: int, cells: int) -> float:
    return 5 + rows + 0.01 * cells


def b_width(s: int) -> int:
    return 4 if s % 2 == 0 else 2


def a_log(sampled_step: int | None = None, prompt_step: int | None = None) -> list[RoundRecord]:
    """Step s: A (width 1) commits 100 + s, its chain holds its next three tokens; B (width 4 at
    even steps, 2 at odd ones) commits 500 + s, its chain is wrong from the first node."""
    recs = []
    for s in range(STEPS):
        prompt = 40 if s == prompt_step else 0  # tokens of a joining prompt riding in the step
        cells = 100 + 10 * s + prompt
        rows = 1 + b_width(s)
        step = dict(batch="b", id=s, requests=2, rows=rows, cells=cells, draft=HOST, last=s == STEPS - 1,
                    max_rows=64, prefill=prompt or None)
        for req, width, tokens, bonus in (("A", 1, [100 + s, 101 + s, 102 + s], 100 + s),
                                          ("B", b_width(s), [999, 998, 997], 500 + s)):
            lead = req == "A"
            dec = decode_ms(rows + prompt, cells) if lead else 0.0
            recs.append(RoundRecord(
                request=req, round=s, context=cells // 2, arm="adaspark", anchor=0, candidates=chain(tokens),
                order=[0, 1, 2], decision=WidthDecision.unpriced(width, [1, 4, 8]), rows=[-1, 0, 1, 2][:width],
                argmax=[bonus] * width, path=[], bonus=bonus, emitted=[bonus],
                times=Timing(draft=0.0, verify=dec, commit=0.0, host=0.0, decode=dec),
                first=s == 0, last=s == STEPS - 1,
                sampling={"temperature": 1.0, "seed": 1} if s == sampled_step and req == "B" else None,
                step=Step(**step, index=int(not lead), lead=lead)))
    return recs


def test_the_step_cost_is_fitted_and_the_oracle_moves_rows_to_the_chain_that_is_right():
    acc = step_account(a_log()).to_json()
    assert acc["steps"] == STEPS and acc["rounds"] == 2 * STEPS and acc["tokens"] == 2 * STEPS
    t0, t1, t2, t3 = acc["fit"]
    assert (t0, t1, t2, t3) == pytest.approx((5, 1, 0.01, 0), abs=1e-6)
    assert acc["fit_error"] < 1e-9
    # realised: 2 tokens a step for 5 or 3 rows
    realised = 2 * STEPS / sum(decode_ms(1 + b_width(s), 100 + 10 * s) + HOST for s in range(STEPS)) * 1e3
    assert acc["measured_rate"] == pytest.approx(realised) and acc["modelled_rate"] == pytest.approx(realised)
    # the oracle: A verifies the part of its chain the reply still holds (all 3 nodes but near the
    # end), B its anchor alone
    held = [min(3, STEPS - s) for s in range(STEPS)]
    oracle = sum(2 + k for k in held) / sum(decode_ms(2 + k, 100 + 10 * s) + HOST for s, k in enumerate(held)) * 1e3
    assert acc["oracle_rate"] == pytest.approx(oracle)
    assert acc["by_load"]["2"] == pytest.approx({"steps": STEPS, "realised": 2.0, "best_width": 4.0,
                                                 "oracle": sum(2 + k for k in held) / (2 * STEPS)})
    # every request at 4 rows: A's are accepted, B's wasted
    fixed4 = sum(2 + k for k in held) / sum(decode_ms(8, 100 + 10 * s) + HOST for s in range(STEPS)) * 1e3
    assert acc["best_width"] == 4 and acc["best_width_rate"] == pytest.approx(fixed4)
    assert acc["width_rates"]["1"] < acc["width_rates"]["4"]


def test_a_step_with_a_sampled_round_has_no_hindsight_and_is_left_out():
    acc = step_account(a_log(sampled_step=3)).to_json()
    assert acc["steps"] == STEPS - 1 and acc["left_out_steps"] == 1


def test_too_few_steps_are_not_priced():
    acc = step_account([r for r in a_log() if r.round < 6]).to_json()
    assert acc["fit"] is None and acc["oracle_rate"] is None and acc["steps"] == 6
    # rows that never vary cannot separate a row's price from the step's
    acc = step_account([r for r in a_log() if r.round % 2 == 0]).to_json()
    assert acc["steps"] == STEPS // 2 and acc["fit"] is None


def test_a_step_that_carried_prompt_tokens_is_not_priced_but_counts_in_the_runs_rate():
    acc = step_account(a_log(prompt_step=4)).to_json()
    assert acc["steps"] == STEPS - 1 and acc["left_out_steps"] == 1
    assert acc["fit"] == pytest.approx([5, 1, 0.01, 0], abs=1e-6)  # the prompt's decode did not teach it
    every = 2 * STEPS / sum(decode_ms(1 + b_width(s) + 40 * (s == 4), 100 + 10 * s + 40 * (s == 4)) + HOST
                            for s in range(STEPS)) * 1e3
    run = acc["with_prompts"]
    assert run["measured"] == pytest.approx(every)
    assert acc["measured_rate"] > run["measured"] and run["measured"] < run["oracle"] < acc["oracle_rate"]
