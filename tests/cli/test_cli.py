"""The decode command end to end: output shapes, streaming, logging and bad input."""


import orjson
import pytest
from conftest import PROMPTS, SIM
from helpers import adaspark, assert_one_error_line

from adaspark_core.evaluate.replay import replay
from adaspark_core.store.record import read_log


def test_missing_prompt_file(tmp_path):
    assert_one_error_line(adaspark("decode", tmp_path / "nope.txt"), "not found")


def test_empty_prompt_file(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("  \n")
    assert_one_error_line(adaspark("decode", p), "empty")


def test_non_gguf_model(tmp_path):
    m = tmp_path / "model.gguf"
    m.write_text("this is not a model")
    assert_one_error_line(adaspark("decode", PROMPTS / "story.txt", "--model", m), "not a GGUF")


def test_missing_model(tmp_path):
    assert_one_error_line(adaspark("decode", PROMPTS / "story.txt", "--model", tmp_path / "x.gguf"), "not found")


def test_corrupt_gguf_model(tmp_path):
    m = tmp_path / "broken.gguf"
    m.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    assert_one_error_line(adaspark("decode", PROMPTS / "story.txt", "--model", m), "could not load")


def test_unknown_arm():
    assert_one_error_line(adaspark("decode", PROMPTS / "story.txt", "--arm", "beam:3"), "unknown arm")


def test_prompt_longer_than_the_context():
    assert_one_error_line(adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "--n-ctx", 64), "context")


@pytest.mark.model
def test_a_context_past_32_bits_is_refused_before_llama_cpp_sees_it():
    # 2^32 + 16 once reached llama.cpp as 16 and aborted the process (exit 134, a backtrace on stdout)
    assert_one_error_line(adaspark("decode", PROMPTS / "story.txt", "--n-ctx", 2**32 + 16), "4294967312", "at most 4294967295")


def test_json_output_and_log(tmp_path):
    log = tmp_path / "rounds.jsonl"
    res = adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "--arm", "tree:8", "--max-tokens", 40, "--json", "--log", log)
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["arm"] == "tree:8" and out["finish"] in ("stop", "length")
    assert out["generated_tokens"] <= 40 and out["text"].strip()
    assert sum(out["widths"].values()) == out["rounds"] == sum(out["accepted"].values())
    recs = list(read_log(log))
    assert len(recs) == out["rounds"] and recs[0].first and recs[-1].last
    assert sum(len(r.emitted) for r in recs) == out["generated_tokens"]
    assert all(r.times.verify > 0 and r.times.decode > 0 for r in recs)


@pytest.mark.model
def test_streamed_text_equals_json_text_and_stdin_works():
    prompt = (PROMPTS / "list.txt").read_text()
    streamed = adaspark("decode", "-", "--arm", "chain:3", "--max-tokens", 30, stdin=prompt)
    as_json = adaspark("decode", "-", "--arm", "chain:3", "--max-tokens", 30, "--json", stdin=prompt)
    assert streamed.returncode == 0 and as_json.returncode == 0
    assert streamed.stdout == orjson.loads(as_json.stdout)["text"] + "\n"
    assert "tokens/round" in streamed.stderr and "widths" in streamed.stderr


def test_the_adaspark_arm_learns_into_its_store_and_a_restart_skips_the_cold_start(tmp_path):
    store, log1, log2 = tmp_path / "store.json", tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    first = adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "-n", 120, "--store", store, "--log", log1, "--json")
    assert first.returncode == 0, first.stderr
    saved = orjson.loads(store.read_bytes())
    assert saved["counts"]["requests"] == 1 and "width" in saved["sections"]
    assert any(r.decision.measure for r in read_log(log1))  # an empty store starts by measuring widths
    learned = {int(w) for w, k in saved["sections"]["width"]["cost"]["classes"].items() if k["count"] >= 3}
    second = adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "-n", 60, "--store", store, "--log", log2, "--json")
    assert second.returncode == 0, second.stderr
    # no learned width is measured again (a split made at the end of the first run may still be)
    assert learned and not {r.decision.measure for r in read_log(log2)} & learned
    saved = orjson.loads(store.read_bytes())
    assert saved["counts"]["requests"] == 2 and saved["sections"]["acceptance"]["requests"] == 2
    # Replaying both logs through fresh learners reproduces exactly what the store holds.
    replayed, report = replay([*read_log(log1), *read_log(log2)])
    assert orjson.loads(orjson.dumps(replayed.state())) == saved["sections"]
    assert [r.request for r in report.requests] == ["rewrite.txt", "rewrite.txt"]


def test_a_corrupt_store_is_reported_and_left_alone(tmp_path):
    store = tmp_path / "store.json"
    store.write_text('{"schema": 1, "fingerp')
    before = store.read_bytes()
    assert_one_error_line(adaspark("decode", PROMPTS / "story.txt", "--model", SIM, "-n", 5, "--store", store), "corrupt")
    assert store.read_bytes() == before


def test_raw_mode():
    text = "The capital of France is"
    res = adaspark("decode", "-", "--model", SIM, "--raw", "--arm", "tree:4", "--max-tokens", 12, "--json", stdin=text)
    assert res.returncode == 0, res.stderr
    assert orjson.loads(res.stdout)["prompt_tokens"] == len(text)  # one byte a token, no template around it


FIXTURE_LOG = PROMPTS.parent / "logs" / "rounds.jsonl"


def test_replay_reports_on_the_fixture_log():
    """The checked-in log of a real run of the default model (``make fixture-log``) replays with
    no mismatch, and the report has every section."""
    res = adaspark("replay", FIXTURE_LOG)
    assert res.returncode == 0, res.stderr
    for heading in ("head-based", "fitted", "requests won", "Calibration", "n-gram-only nodes", "widened"):
        assert heading in res.stdout
    rep = orjson.loads(adaspark("replay", FIXTURE_LOG, "--json").stdout)
    acc, cal, ng = rep["acceptance"], rep["calibration"], rep["ngram"]
    assert len(acc["requests"]) >= 2 and acc["nodes"] > 0
    assert {"request", "nodes", "head_loss", "fitted_loss", "change", "fitted_rounds", "tree_rounds", "finish"} <= set(acc["requests"][0])
    assert 0 <= acc["requests_won"] <= acc["scored_requests"] and 0 <= acc["priced_share"] <= 1
    assert cal["rounds"] == sum(b["rounds"] for b in cal["bins"]) and len(cal["bins"]) == min(10, cal["rounds"])
    assert cal["ratio"] == pytest.approx(cal["accepted"] / cal["expected"])
    assert ng["rows"]["ngram"] > 0 and ng["rounds_with_ngram"] > 0
    assert 0 <= ng["acceptance_rate"]["ngram"] <= 1


def test_replay_reads_a_log_whose_last_line_a_crash_cut(tmp_path):
    """A crash while the log is written can only cut its last line (no newline after it): replay
    says so on stderr and replays the rest. A broken line anywhere else is still an error."""
    lines = FIXTURE_LOG.read_bytes().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2])
    whole = tmp_path / "whole.jsonl"
    whole.write_bytes(b"".join(lines[:-1]))
    for flags in ((), ("--no-check",)):
        res = adaspark("replay", cut, "--json", *flags)
        assert res.returncode == 0, res.stderr
        assert res.stderr.strip() == f"adaspark: {cut}:{len(lines)}: the last line is cut short (a crash while it was written?): left out"
        assert orjson.loads(res.stdout) == orjson.loads(adaspark("replay", whole, "--json", *flags).stdout)
    inside = tmp_path / "inside.jsonl"
    inside.write_bytes(b"".join(lines[:3]) + lines[3][:40] + b"\n" + b"".join(lines[4:]))
    assert_one_error_line(adaspark("replay", inside), "inside.jsonl:4", "not a round record")


def test_replay_bad_input(tmp_path):
    assert_one_error_line(adaspark("replay", tmp_path / "none.jsonl"), "not found")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"schema": 2, "request": "x"}\n')
    assert_one_error_line(adaspark("replay", bad), "bad.jsonl:1")
    ar_only = tmp_path / "ar.jsonl"
    ar_only.write_bytes(b"".join(line for line in FIXTURE_LOG.read_bytes().splitlines(keepends=True)[:1]).replace(b'"arm":"adaspark"', b'"arm":"ar"'))
    assert_one_error_line(adaspark("replay", ar_only), "no rounds of a learning arm")


@pytest.mark.model
def test_bad_drafters(tmp_path, default_model_path):
    prompt = PROMPTS / "story.txt"
    assert_one_error_line(adaspark("decode", prompt, "--drafter", f"model:{tmp_path / 'nope.gguf'}"), "not found")
    assert_one_error_line(adaspark("decode", prompt, "--drafter", "bogus"), "unknown drafter")
    assert_one_error_line(adaspark("decode", prompt, "--drafter", f"dspark:{default_model_path}"), "DSpark")


@pytest.mark.model
def test_decode_with_a_draft_model(default_model_path):
    res = adaspark("decode", PROMPTS / "rewrite.txt", "--arm", "tree:8", "--drafter", f"model:{default_model_path}",
                   "--block", 3, "--draft-top-k", 2, "-n", 40, "--json")
    assert res.returncode == 0, res.stderr
    out = orjson.loads(res.stdout)
    assert out["generated_tokens"] == 40 and out["tokens_per_round"] > 2


def test_decode_json_schema_replies_under_the_schema_and_refuses_a_bad_one(tmp_path):
    schema = {"type": "object", "additionalProperties": False, "required": ["title", "n"],
              "properties": {"title": {"type": "string", "maxLength": 10}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    (tmp_path / "s.json").write_text(orjson.dumps(schema).decode())
    log = tmp_path / "r.jsonl"
    res = adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "--json-schema", tmp_path / "s.json",
                   "--json", "--log", log)
    assert res.returncode == 0, res.stderr
    reply = orjson.loads(orjson.loads(res.stdout)["text"])
    assert set(reply) == {"title", "n"} and len(reply["title"]) <= 10 and reply["n"] <= 9
    assert all(r.constrained for r in read_log(log))
    any_object = adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "--json-schema", "{}", "-n", 200, "--json")
    assert orjson.loads(any_object.stdout)["text"].startswith("{")
    (tmp_path / "bad.json").write_text("[1]")
    for spec, words in [("{", "not JSON"), (tmp_path / "bad.json", "not a JSON object"), (tmp_path / "no.json", "no JSON"),
                        ('{"type": "nope"}', "cannot be compiled")]:
        assert_one_error_line(adaspark("decode", PROMPTS / "rewrite.txt", "--model", SIM, "--json-schema", spec), *words.split(" "))
