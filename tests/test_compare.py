"""``adaspark compare`` (issue "adaspark compare"): the workload rules and the run loop on fake arms,
then the whole command on the default model with a tiny workload. The statistics themselves are
tested in test_stats.py."""

import orjson
import pytest

from adaspark_core import compare as cmp
from adaspark_core.testset import Conversation, load

from conftest import PROMPTS
from test_cli import adaspark, assert_one_error_line


def conv(name, kind, n_turns, set_="s", result=None):
    turns = tuple({"kind": kind, "type": "first" if i == 0 else "continued", "text": f"{name} turn {i}",
                   **({"result": result} if result and i == 0 else {})} for i in range(n_turns))
    return Conversation(set_, name, kind, turns)


def test_the_papers_subsets():
    multi = [conv("a", "math", 2), conv("b", "math", 1), conv("c", "code", 3), conv("d", "rag", 1)]
    assert [c.name for c in cmp.subset(multi, "eval", already_eval=False)] == ["a", "c", "d"]
    single = [conv(x, "chat", 1) for x in "abcde"]
    assert [c.name for c in cmp.subset(single, "eval", already_eval=False)] == ["a", "b", "c"]
    assert cmp.subset(single, "eval", already_eval=True) == single  # the shared folder is the subset
    short = cmp.subset(multi, "short", already_eval=True)
    assert [(c.name, len(c.turns)) for c in short] == [("a", 2)]
    assert cmp.subset(multi, "all", already_eval=False) == multi


def test_tool_calls_are_recognised():
    assert cmp.looks_like_tool_call('{"name": "Market Trends API", "arguments": {}}')
    assert cmp.looks_like_tool_call("<tool_call>x</tool_call>")
    assert not cmp.looks_like_tool_call("The S&P 500 rose 2% today.")


class FakeArm:
    """Answers with a fixed text per arm; records what it was asked."""

    def __init__(self, name, text, tok_s=100.0, call=False):
        self.name, self.text, self.tok_s, self.call = name, text, tok_s, call
        self.prompts = []

    def answer(self, prompt, max_tokens, request_id):
        self.prompts.append((request_id, list(prompt)))
        text = '{"name": "f", "arguments": {}}' if self.call and request_id == "tools/0/0" else self.text
        return cmp.Answer([1] * 5, text, self.tok_s, "stop", {"1": 5})


def chat_tokens(messages):
    """One token per message character: history growth shows in the prompt length."""
    return [ord(ch) % 50 for m in messages for ch in m["role"] + m["content"]]


def test_each_arm_carries_its_own_history_and_tool_turns_give_two_replies():
    a, b = FakeArm("ar", "short"), FakeArm("x", "a much longer reply", call=True)
    convs = [conv("c0", "chat", 2), conv("tools", "tools", 1, result='{"price": 3}')]
    steps = []
    recs = cmp.run(convs, [a, b], chat_tokens, n_ctx=10_000, max_tokens=8, progress=lambda: steps.append(1))
    assert len(steps) == 3 * 2
    keys = [(r["arm"], r["conversation"], r["turn"], r["reply"]) for r in recs]
    # the order of the arms reverses from turn to turn
    assert keys[:4] == [("ar", "c0", 0, 0), ("x", "c0", 0, 0), ("x", "c0", 1, 0), ("ar", "c0", 1, 0)]
    # x calls a tool on the tool turn, so it gets a second, timed reply; ar's reply calls nothing
    assert ("x", "tools", 0, 1) in keys and ("ar", "tools", 0, 1) not in keys
    # turn 1 of c0 holds each arm's own reply to turn 0
    (_, p_ar), (_, p_x) = a.prompts[1], b.prompts[1]
    assert len(p_x) - len(p_ar) == len(b.text) - len(a.text)
    by = {(r["arm"], r["conversation"], r["turn"], r["reply"]): r for r in recs}
    assert by[("x", "c0", 0, 0)]["same_text_as_baseline"] is False and by[("ar", "c0", 0, 0)]["same_text_as_baseline"] is None
    assert by[("x", "tools", 0, 1)]["context"] > by[("x", "tools", 0, 0)]["context"]


def test_a_conversation_that_outgrows_the_context_ends_for_that_arm():
    a = FakeArm("ar", "x" * 300)
    recs = cmp.run([conv("c", "chat", 4)], [a], chat_tokens, n_ctx=700, max_tokens=8)
    assert [r["turn"] for r in recs] == [0, 1, 2]  # turn 3 (975 tokens) no longer fits


def test_arms_are_parsed_and_ar_always_runs_first():
    arms = cmp.make_arms(["adaspark", "pld:3", "tree:4"], target=None, drafter=None,
                         llama_factory=lambda: object(), is_eog=lambda t: False)
    assert [a.name for a in arms] == ["ar", "adaspark", "pld:3", "tree:4"]
    assert arms[1].learners is not None and arms[3].learners is None
    for bad, words in [(["pld:0"], "at least one"), (["tree:4", "tree:4"], "twice"), (["block-chain"], "--drafter"),
                       (["warp:9"], "unknown arm")]:
        with pytest.raises(Exception, match=words):
            cmp.make_arms(bad, None, None, lambda: object(), lambda t: False)


@pytest.mark.model
def test_compare_runs_every_kind_of_arm_and_writes_its_results(tmp_path):
    sets = tmp_path / "tiny.json"
    sets.write_bytes(orjson.dumps({"set": "tiny", "subset": "all", "conversations": [
        {"name": "tiny/copy", "kind": "rewrite", "turns": [
            {"kind": "rewrite", "type": "first", "text": "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."},
            {"kind": "rewrite", "type": "continued", "text": "Now repeat it once more."}]},
        {"name": "tiny/chat", "kind": "chat", "turns": [
            {"kind": "chat", "type": "first", "text": "Name three colours."}]},
    ]}))
    assert len(load(sets)) == 2
    out = tmp_path / "out"
    res = adaspark("compare", "--sets", sets, "--sets", PROMPTS / "rewrite.txt", "--subset", "all",
                   "--arms", "ar,pld:3,chain:3,tree:8,cost,adaspark,pinned:4", "--max-tokens", 24,
                   "--resamples", 200, "--out", out, "--json")
    assert res.returncode == 0, res.stderr
    summary = orjson.loads(res.stdout)
    arms = ["ar", "pld:3", "chain:3", "tree:8", "cost", "adaspark", "pinned:4"]
    assert summary["arms"] == arms and summary["baseline"] == "ar"
    assert set(summary["sources"]) == {"tiny", "prompts"}
    for arm in arms[1:]:
        r = summary["vs_baseline"][arm]["overall"]
        assert set(r) >= {"ratio", "lo", "hi", "replies", "capped", "text_differs"}
        assert r["paired"] == 4  # every reply of the three turns and the prompt file
        if r["ratio"] is not None:
            assert r["lo"] <= r["ratio"] <= r["hi"]
    assert summary["pld"]["best"] == "pld:3" and summary["pinned"]["arms"] == ["pinned:4"]
    doc = orjson.loads((out / "compare.json").read_bytes())
    assert doc["model"]["sha256"] and doc["machine"]["cpus"] >= 1 and doc["packages"]["llama-cpp-python"]
    assert doc["arms"] == arms and doc["settings"]["max_tokens"] == 24
    assert len(doc["replies"]) == 4 * len(arms)
    assert {r["arm"] for r in doc["replies"] if r["widths"]} == set(arms) - {"pld:3"}
    assert (out / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # greedy decoding: every arm's reply to the copy task is ar's text, near ties aside
    copies = [r for r in doc["replies"] if r["conversation"] == "tiny/copy" and r["turn"] == 0]
    assert sum(r["same_text_as_baseline"] is not False for r in copies) >= len(arms) - 2


def test_compare_bad_input(tmp_path):
    assert_one_error_line(adaspark("compare", "--sets", tmp_path / "none.json"), "no such set")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert_one_error_line(adaspark("compare", "--sets", bad), "not a conversation set")
    assert_one_error_line(adaspark("compare", "--subset", "most"), "unknown subset")
