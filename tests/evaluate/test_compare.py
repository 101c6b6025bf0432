"""``adaspark compare`` (issue "adaspark compare"): the workload rules and the run loop on fake arms,
then the whole command on the default model with a tiny workload. The statistics themselves are
tested in test_stats.py."""

import functools

import orjson
import pytest
from conftest import NEAR_TIE, PROMPTS, SIM, TESTSET
from helpers import adaspark, assert_one_error_line

from adaspark_core.evaluate import compare as cmp
from adaspark_core.evaluate.stats import summarize
from adaspark_core.evaluate.testset import Conversation, load
from adaspark_core.serve.tool_calls import format_of, openai_reply


def conv(name, kind, n_turns, set_="s", result=None):
    turns = tuple({"kind": kind, "type": "first" if i == 0 else "continued", "text": f"{name} turn {i}",
                   **({"result": result} if result and i == 0 else {})} for i in range(n_turns))
    return Conversation(set_, name, kind, turns, TOOLS if result else ())


TOOLS = ({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}},)


def test_the_papers_subsets():
    multi = [conv("a", "math", 2), conv("b", "math", 1), conv("c", "code", 3), conv("d", "rag", 1)]
    assert [c.name for c in cmp.subset(multi, "eval", already_eval=False)] == ["a", "c", "d"]
    single = [conv(x, "chat", 1) for x in "abcde"]
    assert [c.name for c in cmp.subset(single, "eval", already_eval=False)] == ["a", "b", "c"]
    assert cmp.subset(single, "eval", already_eval=True) == single  # a set file that is the subset
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
        call = self.call and request_id.split(":")[-1] == "tools/0/0"  # warm ids are "warm<k>:..."
        text = '{"name": "f", "arguments": {}}' if call else self.text
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


def test_a_template_with_tools_gets_them_and_the_parsed_call_is_answered_by_its_id():
    """Where the template takes tools, they and the calls go through it (as the server renders
    them), the call is read with the server's parser, and the result answers it by id."""
    rendered = []

    def render(messages, tools=None):
        rendered.append((messages, tools))
        return [1] * sum(len(orjson.dumps(m)) for m in messages)

    fmt = format_of("{{ '<tool_call>' }}")
    chat = cmp.Chat(render, functools.partial(openai_reply, fmt=fmt), lambda tools: (fmt.value_start, tools))
    assert chat.lazy(conv("tools", "tools", 1, result="3")) == (fmt.value_start, list(TOOLS))  # our arms hold calls
    assert chat.lazy(conv("c", "chat", 1)) is None and cmp.Chat(render).lazy(conv("t", "tools", 1, result="3")) is None
    caller = FakeArm("x", "no call")
    caller.text_for_call = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    caller.answer = lambda prompt, max_tokens, request_id: cmp.Answer(
        [1] * 5, caller.text_for_call if request_id.endswith("/0/0") else "It is 3.", 100.0, "stop", {"1": 5})
    talker = FakeArm("ar", '{"name": "f", "arguments": {}} is not in the template\'s format')
    recs = cmp.run([conv("tools", "tools", 2, result='{"price": 3}')], [talker, caller], chat, 10_000, 8)
    by = {(r["arm"], r["turn"], r["reply"]): r for r in recs}
    assert by[("x", 0, 0)]["tool_calls"] == 1 and by[("ar", 0, 0)]["tool_calls"] == 0
    assert ("x", 0, 1) in by and ("ar", 0, 1) not in by  # only a parsed call gets its result
    assert all(tools == list(TOOLS) for _, tools in rendered) and all(m[0]["role"] == "user" for m, _ in rendered)
    answered = next(m for m, _ in rendered if len(m) == 3)
    said, result = answered[1], answered[2]
    assert said["content"] == "Sure." and said["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    assert result == {"role": "tool", "tool_call_id": said["tool_calls"][0]["id"], "content": '{"price": 3}'}
    summary = summarize(recs, ["ar", "x"], baseline="ar", resamples=100)
    assert summary["tool_calls"] == {"ar": {"replies": 2, "calling": 0}, "x": {"replies": 3, "calling": 1}}


def test_a_conversation_that_outgrows_the_context_ends_for_that_arm():
    a = FakeArm("ar", "x" * 300)
    recs = cmp.run([conv("c", "chat", 4)], [a], chat_tokens, n_ctx=700, max_tokens=8)
    assert [r["turn"] for r in recs] == [0, 1, 2]  # turn 3 (975 tokens) no longer fits


def test_arms_are_parsed_and_ar_always_runs_first():
    arms = cmp.make_arms(["adaspark", "pld:3", "tree:4"], target=None, drafter=None,
                         prompt_lookup=lambda: object(), is_eog=lambda t: False)
    assert [a.name for a in arms] == ["ar", "adaspark", "pld:3", "tree:4"]
    assert arms[1].learners is not None and arms[3].learners is None
    for bad, words in [(["pld:0"], "at least one"), (["tree:4", "tree:4"], "twice"), (["block-chain"], "--drafter"),
                       (["warp:9"], "unknown arm")]:
        with pytest.raises(Exception, match=words):
            cmp.make_arms(bad, None, None, lambda: object(), lambda t: False)


class LearningFake(FakeArm):
    """A fake arm with learners: the warm pass runs it."""

    learners = "its own"


def test_warm_passes_run_the_learning_arms_only_and_are_not_recorded():
    convs = [conv("c0", "chat", 2), conv("tools", "tools", 1, result='{"price": 3}')]
    cold = cmp.run(convs, [FakeArm("ar", "a"), LearningFake("x", "b", call=True)], chat_tokens, 10_000, 8)
    ar, x, y = FakeArm("ar", "a"), LearningFake("x", "b", call=True), FakeArm("chain:3", "c")
    steps = []
    recs = cmp.run(convs, [ar, x, y], chat_tokens, 10_000, 8, progress=lambda: steps.append(1), warm=2)
    assert len(steps) == cmp.steps(convs, [ar, x, y], warm=2) == 3 * 3 + 2 * 3 * 1
    # x answered the workload (4 replies: the tool turn calls) twice untimed, then measured
    ids = [i for i, _ in x.prompts]
    assert ids[:8] == [f"warm{k}:{r}" for k in (1, 2) for r in ("c0/0/0", "c0/1/0", "tools/0/0", "tools/0/1")]
    assert ids[8:] == ["c0/0/0", "c0/1/0", "tools/0/0", "tools/0/1"]
    assert [i for i, _ in ar.prompts] == ["c0/0/0", "c0/1/0", "tools/0/0"] and len(y.prompts) == 3
    # only the measured pass is recorded, exactly as a cold run's records
    key = lambda r: (r["arm"], r["conversation"], r["turn"], r["reply"])  # noqa: E731
    assert sorted(map(key, (r for r in recs if r["arm"] != "chain:3"))) == sorted(map(key, cold))
    # the warm pass gives each arm its own history as the measured pass does
    assert x.prompts[1][1] == x.prompts[9][1]


def test_scheduler_arms_trace_their_deltas_and_log_each_arm(tmp_path):
    from fakes import CostlyTarget, canonical, markov

    from adaspark_core.decode.arms import parse_arm
    from adaspark_core.evaluate.replay import replay
    from adaspark_core.evaluate.stats import summarize
    from adaspark_core.learn.learned import Learners
    from adaspark_core.store.record import read_log

    def arms():
        target = CostlyTarget(markov, eog=0)  # never ends a reply: every reply reaches the cap
        return [cmp.SchedulerArm(parse_arm(a), target, learners=Learners() if parse_arm(a).learns else None)
                for a in ("ar", "adaspark", "chain:3")]

    convs = [conv("c0", "chat", 2), conv("c1", "chat", 1)]
    logs = tmp_path / "logs"
    warm_arms = arms()
    recs = cmp.run(convs, warm_arms, chat_tokens, 10_000, 24, warm=1, log_dir=logs)
    assert all(r["capped"] and r["tokens"] == 24 for r in recs)
    for r in recs:
        tr = r["trace"]
        # led by the decode's start, before the first delta, which is the clock's zero
        assert tr[0][0] == 0 and tr[0][1] < 0.0 and tr[1][1] == 0.0 and tr[-1][0] == r["tokens"]
        assert all(b[0] > a[0] and b[1] >= a[1] for a, b in zip(tr, tr[1:]))
        assert len(tr) - 1 <= sum(r["widths"].values())  # at most one delta per round
    assert all(len(r["trace"]) == 1 + 24 for r in recs if r["arm"] == "ar")  # ar: a token per round
    s = summarize(recs, ["ar", "adaspark", "chain:3"], resamples=100)
    assert s["headline"] == "first_n" and s["vs_baseline"]["adaspark"]["overall"]["ratio"] is None
    f = s["first_n"]["vs_baseline"]["adaspark"]["overall"]
    assert f["replies"] + f["no_interval"] == f["paired"] == 3 and f["untraced"] == 0

    assert sorted(p.name for p in logs.iterdir()) == ["adaspark.jsonl", "ar.jsonl", "chain_3.jsonl", "traces.jsonl",
                                                      "warm-adaspark.jsonl"]
    from adaspark_core.evaluate.tracesim import read_traces

    traces = read_traces([logs / "traces.jsonl"])  # the baseline's replies of the measured pass
    assert [t.request for t in traces] == ["c0/0/0", "c0/1/0", "c1/0/0"]
    assert all(len(t.tokens) == 24 and t.finish == "length" for t in traces)
    measured, warm = list(read_log(logs / "adaspark.jsonl")), list(read_log(logs / "warm-adaspark.jsonl"))
    assert {r.request for r in measured} == {"c0/0/0", "c0/1/0", "c1/0/0"} and {r.arm for r in measured} == {"adaspark"}
    assert {r.request for r in warm} == {"warm1:c0/0/0", "warm1:c0/1/0", "warm1:c1/0/0"}
    assert {r.request for r in read_log(logs / "chain_3.jsonl")} == {"c0/0/0", "c0/1/0", "c1/0/0"}
    # the learners went on from the warm pass: replaying both logs in order reproduces them
    replayed, _ = replay([*warm, *measured])
    assert canonical(replayed.state()) == canonical(warm_arms[1].learners.state())
    assert all(a.log is None for a in warm_arms)

    # A cold run into the same folder starts every log afresh; its log replays on its own.
    cold_arms = arms()
    cmp.run(convs, cold_arms, chat_tokens, 10_000, 24, log_dir=logs)
    measured = list(read_log(logs / "adaspark.jsonl"))
    assert {r.request for r in measured} == {"c0/0/0", "c0/1/0", "c1/0/0"}
    replayed, _ = replay(measured)
    assert canonical(replayed.state()) == canonical(cold_arms[1].learners.state())


def test_prompt_lookup_arm_traces_every_token():
    class FakeDecoder:  # engine/prompt_lookup.PromptLookupDecoder's face
        n_ctx = 100

        def generate(self, prompt, n):
            assert n == 3
            yield from (7, 8, 9, 0, 5)

        def detokenize(self, tokens):
            return b"x" * len(tokens)

    ticks = iter([10.0, 10.5, 10.75])
    arm = cmp.PromptLookupArm(3, FakeDecoder(), is_eog=lambda t: t == 0)
    ans = arm.answer([1, 2], 10, "r", clock=lambda: next(ticks))
    assert ans.finish == "stop" and ans.trace == [[1, 0.0], [2, 0.5], [3, 0.75]]
    assert ans.tok_s == pytest.approx(2 / 0.75)
    assert cmp.Answer([1], "x", None, "stop").trace is None  # arms without a trace still work


@pytest.mark.parametrize("max_tokens", [16, 1])
def test_compare_command_on_a_fake_engine_never_crashes(tmp_path, monkeypatch, max_tokens):
    """The whole command, in process, on a simulated model (every reply reaches the cap): only the
    first-N ratio exists; with 1 token (single-delta replies, which the paper's rule leaves out) it
    still counts every reply, timed from the decode's start."""
    from typer.testing import CliRunner

    from adaspark_cli.main import app

    monkeypatch.setenv("ADASPARK_HOME", str(tmp_path / "home"))
    sets = tmp_path / "tiny.json"
    sets.write_bytes(orjson.dumps({"set": "tiny", "subset": "all", "conversations": [
        {"name": f"tiny/c{i}", "kind": "chat", "turns": [{"kind": "chat", "type": "first", "text": f"Say {i}."},
                                                       {"kind": "chat", "type": "continued", "text": "Again."}]}
        for i in range(3)]}))
    out = tmp_path / "out"
    (out / "ratios.png").parent.mkdir()
    (out / "ratios.png").write_bytes(b"an older run's figure")
    res = CliRunner().invoke(app, ["compare", "--model", "sim:cpu-smollm2-q4_0", "--sets", str(sets), "--subset", "all", "--arms",
                                        "ar,chain:3,pinned:4,adaspark", "--max-tokens", str(max_tokens),
                                        "--resamples", "100", "--warm", "1", "--out", str(out),
                                        "--logs", str(out / "logs")])
    assert res.exit_code == 0, res.output
    assert "learning arms from a warm store (1 untimed pass first)" in res.stdout
    doc = orjson.loads((out / "compare.json").read_bytes())
    assert doc["settings"]["warm"] == 1 and len(doc["replies"]) == 4 * 6
    assert all(r["capped"] for r in doc["replies"])
    s = doc["summary"]
    assert s["vs_baseline"]["adaspark"]["overall"]["ratio"] is None       # the paper's rule: nothing left
    assert (out / "logs" / "warm-adaspark.jsonl").is_file() and (out / "logs" / "chain_3.jsonl").is_file()
    fn = s["first_n"]["vs_baseline"]["adaspark"]["overall"]
    # a second turn copies the first (the simulated rule repeats) and may fit in one round: counted
    assert s["headline"] == "first_n" and fn["replies"] == 6 and fn["no_interval"] == 0
    assert "all paired replies, first N tokens" in res.stdout
    assert (out / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_command_without_a_ratio_skips_the_figure_with_one_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from adaspark_cli.main import app

    monkeypatch.setenv("ADASPARK_HOME", str(tmp_path / "home"))
    sets = tmp_path / "tiny.json"
    sets.write_bytes(orjson.dumps({"set": "tiny", "subset": "all", "conversations": [
        {"name": "tiny/c0", "kind": "chat", "turns": [{"kind": "chat", "type": "first", "text": "Say 0."}]}]}))
    out = tmp_path / "out"
    (out / "ratios.png").parent.mkdir()
    (out / "ratios.png").write_bytes(b"an older run's figure")
    res = CliRunner().invoke(app, ["compare", "--model", "sim:cpu-smollm2-q4_0", "--sets", str(sets), "--subset", "all",
                                   "--arms", "ar", "--max-tokens", "4", "--resamples", "100", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "no ratio to plot" in res.stderr and not (out / "ratios.png").exists()


# --- replies under JSON schemas (the JSON extraction workload) -----------------------------------------

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "size", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}


def json_conv(name, schema=SCHEMA):
    return Conversation("jsonextract", name, "extraction", ({"kind": "extraction", "type": "first",
                                                             "text": f"Describe {name} as JSON."},),
                        response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": schema,
                                                                                "strict": True}})


def test_every_scheduler_arm_answers_under_the_conversations_schema_and_is_counted():
    import json

    import jsonschema

    from adaspark_core.decode.arms import parse_arm
    from adaspark_core.engine.simlm import SimModel
    from adaspark_core.evaluate.stats import summarize
    from adaspark_core.learn.learned import Learners

    model = SimModel(SIM)
    target = model.target()
    names = ["ar", "chain:3", "adaspark"]
    arms = [cmp.SchedulerArm(parse_arm(a), target, learners=Learners() if parse_arm(a).learns else None) for a in names]
    convs = [json_conv("sea"), json_conv("sky"), conv("free", "chat", 1)]
    recs = cmp.run(convs, arms, model.chat_prompt, 4096, 96)
    under = [r for r in recs if r["conversation"] != "free"]
    assert len(under) == 2 * 3 and all(r["finish"] == "stop" and r["json_valid"] for r in under)
    for r in under:
        jsonschema.validate(json.loads(r["text"]), SCHEMA)  # the grammar's compact JSON, following the schema
    free = [r for r in recs if r["conversation"] == "free"]
    assert all(r["json_valid"] is None for r in free) and not any(r["text"].startswith("{") for r in free)
    s = summarize(recs, names, resamples=100)
    assert s["json_valid"] == {a: {"replies": 2, "valid": 2, "capped": 0} for a in names}
    # a reply the cap cuts is not JSON: counted, not valid
    capped = cmp.run([json_conv("sea")], arms[:1], model.chat_prompt, 4096, 5)
    assert capped[0]["finish"] == "length" and capped[0]["json_valid"] is False
    assert summarize(capped, ["ar"], resamples=100)["json_valid"] == {"ar": {"replies": 1, "valid": 0, "capped": 1}}
    assert summarize(free, names, resamples=100)["json_valid"] == {}


def test_a_response_format_survives_the_workload_rules():
    from adaspark_cli.compare_cmd import load_workload
    from adaspark_core.evaluate.json_workload import load_json_workload

    convs = load_workload([TESTSET], "eval", json_requests=True)
    assert [(c.name, c.response_format) for c in convs] == [(c.name, c.response_format)
                                                              for c in load_json_workload(TESTSET)]
    assert all(cmp.reply_schema(c) == c.response_format["json_schema"]["schema"] for c in convs)
    short = cmp.subset([json_conv("a")], "short", already_eval=True)
    assert short[0].response_format == json_conv("a").response_format
    assert cmp.reply_schema(Conversation("s", "n", "k", (), response_format={"type": "json_object"})) == {"type": "object"}
    assert cmp.reply_schema(conv("c", "chat", 1)) is None


def test_prompt_lookup_is_refused_for_replies_under_schemas():
    loaded = []
    with pytest.raises(Exception, match="takes no grammar") as e:
        cmp.make_arms(["ar", "pld:3"], None, None, lambda: loaded.append(1), lambda t: False, schemas=True)
    assert "\n" not in str(e.value) and loaded == []  # before its decoder loads the model
    assert [a.name for a in cmp.make_arms(["ar", "chain:3"], None, None, None, lambda t: False, schemas=True)] == [
        "ar", "chain:3"]


def test_compare_command_runs_the_json_workload(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from adaspark_cli.main import app

    monkeypatch.setenv("ADASPARK_HOME", str(tmp_path / "home"))
    out = tmp_path / "out"
    args = ["compare", "--model", SIM, "--sets", str(TESTSET), "--json-workload", "--arms", "ar,chain:3,adaspark",
            "--max-tokens", "96", "--resamples", "100", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    doc = orjson.loads((out / "compare.json").read_bytes())
    assert doc["settings"]["json_workload"] is True
    replies = doc["replies"]  # the requests that fit the simulated model's context (its tokens are bytes)
    assert replies and all(isinstance(r["json_valid"], bool) for r in replies)
    jv = doc["summary"]["json_valid"]
    assert sorted(jv) == ["adaspark", "ar", "chain:3"] and len({v["replies"] for v in jv.values()}) == 1
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("json valid"))
    assert line.split()[2:] == [f'{jv[a]["valid"]}/{jv[a]["replies"]}' for a in ("ar", "chain:3", "adaspark")]
    assert "JSON extraction requests" in res.stdout

    res = CliRunner().invoke(app, args[:-2] + ["--arms", "ar,pld:3"])
    assert res.exit_code == 2 and "takes no grammar" in res.output
    sets = tmp_path / "chat.json"  # no document to extract from
    sets.write_bytes(orjson.dumps({"set": "tiny", "conversations": [
        {"name": "c", "kind": "chat", "turns": [{"kind": "chat", "type": "first", "text": "Hi."}]}]}))
    res = CliRunner().invoke(app, ["compare", "--model", SIM, "--sets", str(sets), "--json-workload", "--arms", "ar"])
    assert res.exit_code == 2 and "no document to extract from" in res.output


@pytest.mark.model
def test_compare_runs_every_kind_of_arm_and_writes_its_results(tmp_path, lm):
    from adaspark_core.engine.llama_sequence import rescore

    copy_task = "Repeat this sentence exactly: the quick brown fox jumps over the lazy dog."
    sets = tmp_path / "tiny.json"
    sets.write_bytes(orjson.dumps({"set": "tiny", "subset": "all", "conversations": [
        {"name": "tiny/copy", "kind": "rewrite", "turns": [
            {"kind": "rewrite", "type": "first", "text": copy_task},
            {"kind": "rewrite", "type": "continued", "text": "Now repeat it once more."}]},
        {"name": "tiny/chat", "kind": "chat", "turns": [
            {"kind": "chat", "type": "first", "text": "Name three colours."}]},
    ]}))
    assert len(load(sets)) == 2
    out = tmp_path / "out"
    res = adaspark("compare", "--sets", sets, "--sets", PROMPTS / "rewrite.txt", "--subset", "all",
                   "--arms", "ar,pld:3,chain:3,tree:8,cost,adaspark,pinned:4", "--max-tokens", 24,
                   "--resamples", 200, "--out", out, "--json", "--warm", 1, "--logs", out / "logs")
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
    assert doc["arms"] == arms and doc["settings"]["max_tokens"] == 24 and doc["settings"]["warm"] == 1
    assert all(r["trace"][-1][0] == r["tokens"] for r in doc["replies"] if r["tokens"])
    assert summary["headline"] in ("first_n", "uncapped") and summary["first_n"]["vs_baseline"]["adaspark"]
    logs = out / "logs"
    assert {p.name for p in logs.iterdir()} == {"ar.jsonl", "chain_3.jsonl", "tree_8.jsonl", "cost.jsonl",
                                                 "adaspark.jsonl", "pinned_4.jsonl", "warm-cost.jsonl",
                                                 "warm-adaspark.jsonl", "warm-pinned_4.jsonl", "traces.jsonl"}
    # ar's replies as traces: the scheduler arms decode them again on a virtual clock priced by
    # the run's own verify times, and never leave them (simulate checks every reply)
    sim = adaspark("simulate", logs / "traces.jsonl", "--costs", logs / "ar.jsonl", "--costs", logs / "chain_3.jsonl",
                   "--costs", logs / "adaspark.jsonl", "--arms", "chain:3,adaspark", "--resamples", 200, "--json")
    assert sim.returncode == 0, sim.stderr
    simulated = orjson.loads(sim.stdout)
    assert simulated["arms"] == ["ar", "chain:3", "adaspark"]
    assert simulated["first_n"]["vs_baseline"]["chain:3"]["overall"]["paired"] == 4
    both = tmp_path / "both.jsonl"  # a warm run replays from its warm log on
    both.write_bytes((logs / "warm-adaspark.jsonl").read_bytes() + (logs / "adaspark.jsonl").read_bytes())
    assert adaspark("replay", both).returncode == 0
    assert len(doc["replies"]) == 4 * len(arms)
    assert {r["arm"] for r in doc["replies"] if r["widths"]} == set(arms) - {"pld:3"}
    assert (out / "ratios.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # greedy decoding: every arm's reply to the copy task is ar's text, but where the one-row
    # kernel of ar and the multi-row kernel of a verify break a near tie apart (paper 3.5; on an
    # AVX2-only CPU every speculating arm split from ar at one tie, "which" / "but")
    copies = [r for r in doc["replies"] if r["conversation"] == "tiny/copy" and r["turn"] == 0]
    ar_text = next(r["text"] for r in copies if r["arm"] == "ar")
    prompt = lm.chat_prompt([{"role": "user", "content": copy_task}])
    for r in copies:
        if r["same_text_as_baseline"] is False:
            ours, theirs = (lm.tokenize(t, special=False, add_bos=False) for t in (ar_text, r["text"]))
            # the first token that differs, or where one reply stopped (its end token) and the other went on
            i = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
            _, gap = rescore(lm, prompt + ours[:i])
            assert gap[-1] < NEAR_TIE, (r["arm"], r["text"], ar_text)


def test_compare_bad_input(tmp_path):
    assert_one_error_line(adaspark("compare", "--sets", tmp_path / "none.json"), "no such set")
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert_one_error_line(adaspark("compare", "--sets", bad), "not a conversation set")
    assert_one_error_line(adaspark("compare", "--subset", "most"), "unknown subset")
    assert_one_error_line(adaspark("compare", "--sets", TESTSET, "--logs", bad, "--subset", "short"), "is a file")


def test_max_turns_keeps_the_first_turns_of_every_conversation(tmp_path):
    from adaspark_cli.compare_cmd import load_workload
    from adaspark_core.evaluate import testset

    full = load_workload([TESTSET], "eval")
    first = load_workload([TESTSET], "eval", max_turns=1)
    assert [c.name for c in first] == [c.name for c in full]
    assert all(len(c.turns) == 1 and c.turns[0] == f.turns[0] for c, f in zip(first, full))
    assert (len(full), sum(len(c.turns) for c in full), len(first)) == (11, 33, 11)
    assert list(dict.fromkeys(c.set for c in full)) == list(testset.SOURCE_ORDER)


def test_a_fresh_clone_defaults_to_its_own_excerpt(monkeypatch, tmp_path):
    from adaspark_core.evaluate import testset

    monkeypatch.setattr(testset, "shared_dir", lambda: tmp_path / "no-shared-folder")
    assert testset.default_dir() == TESTSET


def test_the_excerpt_is_verbatim_and_its_short_subset_is_the_benchmarks():
    import hashlib

    from adaspark_cli.compare_cmd import load_workload
    from adaspark_core.evaluate import testset

    for f in sorted(TESTSET.glob("*.json")):
        for c in orjson.loads(f.read_bytes())["conversations"]:
            text = "\n".join(t["text"] for t in c["turns"])
            assert hashlib.sha256(text.encode()).hexdigest()[:16] == c["sha256"], c["name"]
    if not testset.shared_dir().is_dir():
        pytest.skip("no ../shared/testset beside the repository")
    shared = {c.name: c for c in load_workload([testset.shared_dir()], "all")}
    assert all(c == shared[c.name] for c in load_workload([TESTSET], "all"))
    assert load_workload([TESTSET], "short") == load_workload([testset.shared_dir()], "short")


def test_each_llama_server_arm_needs_rpc_servers_of_its_own():
    """A llama.cpp RPC server serves one client at a time: --peer-rpc gives one list per llama: arm."""
    from adaspark_core.base.errors import InputError

    with pytest.raises(InputError, match=r"one list of servers for each llama-server arm \(2\), not 1"):
        cmp.make_arms(["ar", "llama:ar", "llama:ngram-mod"], None, None, lambda: None, lambda t: False,
                      model_path="m.gguf", n_ctx=512, peer_device_args=[("--rpc", "127.0.0.1:1")])
