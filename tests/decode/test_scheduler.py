import orjson
import pytest
from fakes import FakeTarget, cyclic

from adaspark_core.base.errors import InputError
from adaspark_core.decode.arms import Arm, parse_arm
from adaspark_core.decode.generation import run
from adaspark_core.decode.round import stop_cut
from adaspark_core.store.record import SCHEMA, RoundLog, RoundRecord, read_log


def test_parse_arm():
    assert parse_arm("ar") == Arm("ar")
    assert parse_arm("chain:3").max_width == 4
    assert parse_arm("tree:16").max_width == 16
    assert parse_arm("tree:1") == Arm("ar")  # width 1 is plain decoding
    assert parse_arm("chain:0") == Arm("ar")
    for bad in ["tree", "tree:0", "chain:-1", "beam:4", "tree:65", ""]:
        with pytest.raises(InputError):
            parse_arm(bad)


def test_stop_cut():
    def eog(t):
        return t == 0

    assert stop_cut([5, 6, 7], eog, 10) == (3, None)
    assert stop_cut([5, 0, 7], eog, 10) == (2, "stop")
    assert stop_cut([5, 6, 7], eog, 2) == (2, "length")
    assert stop_cut([5, 6], eog, 2) == (2, "length")
    assert stop_cut([0], eog, 1) == (1, "stop")


SEQ = [11, 12, 13, 14, 15, 16, 17, 18]


@pytest.mark.parametrize("arm", ["ar", "chain:3", "tree:2", "tree:8", "tree:16"])
def test_every_arm_emits_the_targets_greedy_continuation(arm):
    # The prompt repeats the cycle, so n-gram chains are right and rounds accept several tokens.
    prompt = SEQ * 3 + SEQ[:3]
    t = FakeTarget(cyclic(SEQ))
    gen = run(t, prompt, parse_arm(arm), max_tokens=40)
    expect = [SEQ[(3 + i) % len(SEQ)] for i in range(40)]
    assert gen.tokens == expect and gen.finish == "length"
    assert t.kv == prompt + expect[:-1]  # the cache holds everything but the anchor
    if arm != "ar":
        assert gen.stats.rounds <= 40 / 2  # speculation accepted several tokens per round
    assert max(gen.stats.widths) <= parse_arm(arm).max_width


def test_stop_token_ends_the_reply_and_is_not_emitted():
    seq = [11, 12, 13, 0]
    t = FakeTarget(cyclic(seq), eog=0)
    gen = run(t, [11, 12, 13, 0, 11], parse_arm("chain:4"), max_tokens=100)
    assert gen.tokens == [12, 13] and gen.finish == "stop"


def test_context_limit_ends_the_reply_without_overflowing():
    t = FakeTarget(cyclic(SEQ), n_ctx=40)
    prompt = SEQ * 3 + SEQ[:3]  # 27 tokens
    gen = run(t, prompt, parse_arm("tree:16"), max_tokens=1000)
    assert gen.finish == "context"
    assert len(prompt) + len(gen.tokens) == 40  # every position filled, none past the end


def test_width_one_rounds_have_one_row_and_no_candidates():
    t = FakeTarget(cyclic(SEQ))
    gen = run(t, SEQ * 2, parse_arm("ar"), max_tokens=5)
    assert all(lay.width == 1 for lay in t.verifies)
    assert gen.stats.widths == {1: 5}


def test_round_log_round_trips(tmp_path):
    path = tmp_path / "rounds.jsonl"
    t = FakeTarget(cyclic(SEQ))
    with RoundLog(path) as log:
        gen = run(t, SEQ * 2 + [11], parse_arm("tree:4"), max_tokens=10, request_id="q1", log=log)
    recs = list(read_log(path))
    assert len(recs) == gen.stats.rounds
    assert recs[0].first and recs[-1].last and recs[-1].finish == "length"
    assert [r.round for r in recs] == list(range(len(recs)))
    assert sum(len(r.emitted) for r in recs) == 10
    for r in recs:
        assert r.schema == SCHEMA and r.request == "q1"
        assert len(r.rows) == r.width == len(r.argmax)
        # the accepted path follows the argmax from the anchor, and the bonus is the argmax after it
        row_of = {c: i for i, c in enumerate(r.rows)}
        at = 0
        for c in r.path:
            assert r.candidates[c]["token"] == r.argmax[at]
            at = row_of[c]
        assert r.bonus == r.argmax[at]


def test_read_log_names_a_bad_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"schema": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(read_log(path))
    path.write_text('{"schema": 99}\n')
    with pytest.raises(ValueError, match="schema"):
        list(read_log(path))


def test_trees_on_a_recurrent_model_are_refused_with_a_clear_message():
    t = FakeTarget(cyclic(SEQ))
    t.supports_trees = False
    with pytest.raises(InputError, match="recurrent"):
        run(t, SEQ, parse_arm("tree:8"), max_tokens=5)
    assert run(t, SEQ * 2, parse_arm("chain:4"), max_tokens=5).tokens == [11, 12, 13, 14, 15]
    t.supports_chains = False  # no recurrent-state rollback: one row per round only
    with pytest.raises(InputError, match="roll back"):
        run(t, SEQ, parse_arm("chain:4"), max_tokens=5)
    assert run(t, SEQ * 2, parse_arm("ar"), max_tokens=3).tokens == [11, 12, 13]


def test_a_schema_1_line_upgrades_with_the_acceptance_fields_unset(tmp_path):
    path = tmp_path / "rounds.jsonl"
    with RoundLog(path) as log:
        run(FakeTarget(cyclic(SEQ)), SEQ * 2 + [11], parse_arm("tree:4"), max_tokens=3, log=log)
    d = orjson.loads(path.read_bytes().splitlines()[0])
    for k in ("p_src", "priced", "explored"):
        del d[k]
    d["schema"] = 1
    rec = RoundRecord.from_json(d)
    assert rec.schema == SCHEMA and rec.p_src is None and rec.priced is None and rec.explored is False


def test_the_last_round_learns_after_its_tokens_are_out(tmp_path):
    """The reply's last round ends the request (the cost model's refits): it learns and is logged
    after the generation has yielded it, so the client clock does not wait for it, and it is
    learned even when the consumer stops right after the last tokens."""
    from adaspark_core.decode.generation import Generation
    from adaspark_core.learn.learned import Learners

    learners = Learners()
    path = tmp_path / "rounds.jsonl"
    with RoundLog(path) as log:
        gen = Generation(FakeTarget(cyclic([1, 2, 3, 4, 5, 6])), [1, 2, 3, 4, 5, 6, 1, 2], parse_arm("pinned:4"), 12,
                         learners=learners, log=log)
        seen = []
        for _ in gen:
            seen.append((gen.finish, learners.policy.cost.rounds))
            if gen.finish is not None:
                break  # a consumer that stops at once; the generator is closed below
        rounds_at_last_yield = seen[-1][1]
        assert gen.finish == "length" and rounds_at_last_yield == len(seen) - 1  # not learned yet
        del gen  # closing the generator learns from and logs the last round
    assert learners.policy.cost.rounds == len(seen) == len(list(read_log(path)))


def test_no_row_is_verified_below_an_end_token_or_past_the_replys_budget():
    # Rows below the end token, or deeper than the tokens the reply may still emit, are lost
    # whatever the target says there; they must not be proposed, priced or verified.
    seq = [11, 12, 13, 14, 15, 0]
    t = FakeTarget(cyclic(seq), eog=0)
    gen = run(t, seq * 3 + [11], parse_arm("tree:16"), max_tokens=100)
    assert gen.tokens == [12, 13, 14, 15] and gen.finish == "stop"
    for lay in t.verifies:
        assert all(lay.token[p] != 0 for p in lay.parent_row if p >= 0)
    t = FakeTarget(cyclic(SEQ))
    gen = run(t, SEQ * 3 + SEQ[:3], parse_arm("tree:16"), max_tokens=5)
    assert gen.tokens == [SEQ[(3 + i) % len(SEQ)] for i in range(5)]
    assert t.verifies[0].max_depth == 4  # 5 to go: a path of 4 and the target's own token make 5
    assert len(t.verifies) == 1
