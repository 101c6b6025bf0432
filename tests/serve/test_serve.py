"""``adaspark serve-stdin`` (issue "Serving and inspection"): requests and responses as JSON
lines, bad lines answered and survived, the learned state saved after every request and on
exit, a restart beginning from the learned widths, and a store that SIGKILL never corrupts."""

import random
import signal
import subprocess
import sys
import time

import orjson
import pytest
from conftest import PROMPTS, SIM

from adaspark_core.base.sampling import Sampling
from adaspark_core.evaluate.replay import replay
from adaspark_core.serve.stdin_api import RequestError, parse_request
from adaspark_core.store.record import read_log
from adaspark_core.store.store import Store

CMD = [sys.executable, "-m", "adaspark_cli.main", "serve-stdin"]


def test_requests_are_parsed_and_bad_ones_named():
    r = parse_request(b'{"id": "x", "prompt": "hi", "max_tokens": 5, "stream": true}', 64, 1)
    assert (r.id, r.prompt, r.messages, r.max_tokens, r.stream) == ("x", "hi", None, 5, True)
    r = parse_request('{"prompt": "hi", "stop": "\\n", "temperature": 0.5, "top_k": 4, "seed": 2}', 64, 1)
    assert r.stops == ("\n",) and r.sampling == Sampling(0.5, top_k=4, seed=2)
    r = parse_request('{"messages": [{"role": "user", "content": "hi"}]}', 64, 7)
    assert (r.id, r.max_tokens, r.stream, r.name) == ("req-7", 64, False, "req-7")
    bad = {
        b"not json": (None, "not a JSON object"),
        b"[1, 2]": (None, "a request is a JSON object"),
        b'{"id": true, "prompt": "a"}': (None, "id must be"),
        b'{"id": 3, "prompt": "a", "temprature": 0.7}': (3, "unknown field temprature"),
        b'{"id": 3, "prompt": "a", "temperature": 9}': (3, "temperature must be a number from 0 to 2"),
        b'{"id": 3, "prompt": "a", "stop": 5}': (3, "stop must be"),
        b'{"id": 3}': (3, "either a prompt or messages"),
        b'{"id": 3, "prompt": "a", "messages": []}': (3, "either a prompt or messages"),
        b'{"id": 3, "prompt": "  "}': (3, "prompt must be non-empty"),
        b'{"id": 3, "messages": [{"role": "robot", "content": "a"}]}': (3, "role must be"),
        b'{"id": 3, "messages": [{"role": "user"}]}': (3, "content must be text"),
        b'{"id": 3, "prompt": "a", "max_tokens": 0}': (3, "max_tokens must be"),
        b'{"id": 3, "prompt": "a", "max_tokens": 2.5}': (3, "max_tokens must be"),
        b'{"id": 3, "prompt": "a", "stream": "yes"}': (3, "stream must be"),
    }
    for line, (rid, words) in bad.items():
        with pytest.raises(RequestError, match=words) as e:
            parse_request(line, 64, 1)
        assert e.value.id == rid


def serve(lines, *args, timeout=600):
    res = subprocess.run([*CMD, *map(str, args)], input="".join(lines), capture_output=True, text=True,
                         timeout=timeout)
    return res, [orjson.loads(x) for x in res.stdout.splitlines()]


def request(rid, **kw):
    return orjson.dumps({"id": rid, **kw}).decode() + "\n"


def test_a_stream_of_requests_with_bad_lines_is_served_and_learned_into_the_store(tmp_path):
    store, log = tmp_path / "store.json", tmp_path / "rounds.jsonl"
    texts = [(PROMPTS / n).read_text() for n in ("rewrite.txt", "explain.txt", "list.txt", "code.txt")]
    lines, expected = [], []
    for i in range(20):
        rid = f"q{i}"
        if i % 5 == 4:  # a streamed chat request
            lines.append(request(rid, messages=[{"role": "user", "content": texts[i % 4]}], max_tokens=24, stream=True))
        else:
            lines.append(request(rid, prompt=texts[i % 4][:400], max_tokens=16 + i))
        expected.append(("ok", rid))
        if i in (3, 11):
            lines.append("{this is not json\n")
            expected.append(("error", None))
        if i == 7:
            lines.append(request("bad-opt", prompt="a", top_pp=0.9))
            expected.append(("error", "bad-opt"))
        if i == 15:
            lines.append(request("too-long", prompt="word " * 5000))  # longer than --n-ctx
            expected.append(("error", "too-long"))
    lines.insert(6, "\n")  # a blank line is skipped, not an error
    res, out = serve(lines, "--model", SIM, "--store", store, "--log", log, "--n-ctx", 2048)
    assert res.returncode == 0, res.stderr
    finals = [o for o in out if "delta" not in o]
    assert [("error" if "error" in o else "ok", o["id"]) for o in finals] == expected
    deltas = {}
    for o in out:
        if "delta" in o:
            deltas[o["id"]] = deltas.get(o["id"], "") + o["delta"]
    for o in finals:
        if "error" in o:
            assert isinstance(o["error"], str) and o["error"]
            continue
        st = o["stats"]
        assert o["done"] and o["finish"] in ("stop", "length") and st["generated_tokens"] >= 1
        assert st["decode_tok_s"] is None or st["decode_tok_s"] > 0
        assert st["tokens_per_round"] >= 1 and sum(st["widths"].values()) == st["rounds"]
        if o["id"] in ("q4", "q9", "q14", "q19"):
            assert deltas[o["id"]] == o["text"]  # the deltas add up to the text
        else:
            assert o["id"] not in deltas
    assert "too-long" in [o["id"] for o in finals] and "context" in next(o["error"] for o in finals if o["id"] == "too-long")
    # The store holds exactly what fresh learners learn from the run's log.
    saved = orjson.loads(store.read_bytes())
    assert saved["counts"]["requests"] == 20
    replayed, report = replay(list(read_log(log)))
    assert orjson.loads(orjson.dumps(replayed.state())) == saved["sections"]
    assert len(report.requests) == 20
    # A second server on the same store begins from the learned widths: no cold-start round.
    log2 = tmp_path / "second.jsonl"
    res, out = serve([request("again", prompt=texts[1], max_tokens=48)], "--model", SIM, "--store", store, "--log", log2)
    assert res.returncode == 0 and out[-1]["done"], res.stderr
    assert all(r.decision.measure is None for r in read_log(log2))
    assert orjson.loads(store.read_bytes())["counts"]["requests"] == 21


def test_a_multi_turn_conversation_carries_the_clients_history(tmp_path):
    proc = subprocess.Popen([*CMD, "--model", SIM, "--store", tmp_path / "s.json"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    messages = []
    replies = []
    for turn in ("Name three colours.", "Which of them is the colour of the sky?", "Say it again in capitals."):
        messages.append({"role": "user", "content": turn})
        proc.stdin.write(request(f"t{len(replies)}", messages=messages, max_tokens=32))
        proc.stdin.flush()
        out = orjson.loads(proc.stdout.readline())
        assert out["id"] == f"t{len(replies)}" and out["done"], out
        replies.append(out)
        messages.append({"role": "assistant", "content": out["text"]})
    proc.stdin.close()
    assert proc.wait(timeout=120) == 0
    # each turn's prompt holds the whole conversation so far
    assert replies[0]["prompt_tokens"] < replies[1]["prompt_tokens"] < replies[2]["prompt_tokens"]


@pytest.mark.model
@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_server_cleanly_and_saves(tmp_path, sig, code):
    store = tmp_path / "s.json"
    proc = subprocess.Popen([*CMD, "--store", store], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdin.write(request("long", prompt=(PROMPTS / "story.txt").read_text(), max_tokens=2000))
    proc.stdin.flush()
    time.sleep(3.0)  # mid-request: the reply ends after the current round
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    final = orjson.loads(out.splitlines()[-1])
    assert final["id"] == "long" and final["finish"] in ("interrupted", "stop")
    saved = Store.open(store, orjson.loads(store.read_bytes())["fingerprint"])
    assert saved.counts["requests"] == 1


@pytest.mark.slow  # 20 processes killed in turn: a long run
def test_sigkill_at_random_moments_never_leaves_an_unreadable_store(tmp_path):
    store = tmp_path / "s.json"
    rng = random.Random(0)
    prompts = [(PROMPTS / n).read_text()[:300] for n in ("rewrite.txt", "explain.txt", "list.txt")]
    stdin = "".join(request(i, prompt=prompts[i % 3], max_tokens=8) for i in range(200))
    seen = set()
    first_save = None  # seconds from start to the first save, measured by the first run
    for trial in range(20):
        proc = subprocess.Popen([*CMD, "--model", SIM, "--store", store], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
        t0 = time.monotonic()
        proc.stdin.write(stdin)
        proc.stdin.flush()
        if first_save is None:  # a loaded machine starts the server slower: the kills scale with it
            while not store.exists() and time.monotonic() - t0 < 60:
                time.sleep(0.01)
            first_save = time.monotonic() - t0
        else:  # kills before the first save, between saves and during them
            time.sleep(rng.uniform(0.4, 2.4) * first_save)
        proc.kill()
        proc.wait()
        if store.exists():
            fp = orjson.loads(store.read_bytes())["fingerprint"]
            with Store.open(store, fp) as saved:  # raises on an unreadable store; its lock released after
                seen.add(saved.counts["requests"])
    assert max(seen, default=0) > 0 and len(seen) > 1  # the kills landed after saves, at several counts


@pytest.mark.model
def test_a_conversations_next_turn_prefills_only_its_new_text(tmp_path):
    """Prompt-prefix reuse on the real model: the second turn of a chat keeps the first turn's KV
    (its whole prompt at least: the reply's tokens too where the history repeats them); with
    --no-reuse-prefix every request is prefilled from scratch."""
    first = [{"role": "user", "content": "Name a colour."}]
    turn = first + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Why?"}]
    for flag in ("--reuse-prefix", "--no-reuse-prefix"):
        res, out = serve([request(1, messages=first, max_tokens=12), request(2, messages=turn, max_tokens=12)],
                         "--store", tmp_path / "s.json", flag)
        assert res.returncode == 0, res.stderr
        assert out[0]["prompt_reused"] == 0
        if flag == "--reuse-prefix":
            assert out[0]["prompt_tokens"] <= out[1]["prompt_reused"] < out[1]["prompt_tokens"]
        else:
            assert out[1]["prompt_reused"] == 0


def test_a_json_schema_request_replies_under_it_and_a_bad_one_is_answered(tmp_path):
    schema = {"type": "object", "additionalProperties": False, "required": ["word", "n"],
              "properties": {"word": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
    lines = [request("j", prompt="A word and a digit.", json_schema=schema, max_tokens=64),
             request("bad", prompt="x", json_schema="yes"), request("nope", prompt="x", json_schema={"type": "nope"}),
             request("any", prompt="Anything.", json_schema={}, max_tokens=200, stream=True)]
    res = subprocess.run([*CMD, "--model", SIM, "--log", tmp_path / "r.jsonl"], input="".join(lines),
                         capture_output=True, text=True, timeout=120)
    out = [orjson.loads(line) for line in res.stdout.splitlines()]
    assert res.returncode == 0, res.stderr
    reply = orjson.loads(out[0]["text"])
    assert set(reply) == {"word", "n"} and len(reply["word"]) <= 8 and out[0]["finish"] == "stop"
    assert out[1] == {"id": "bad", "error": "json_schema must be a JSON schema object ({} for any object)"}
    assert out[2]["id"] == "nope" and "cannot be compiled" in out[2]["error"]
    deltas = "".join(o["delta"] for o in out[3:] if "delta" in o)
    assert deltas == out[-1]["text"] and deltas.startswith("{")
    assert [r.constrained for r in read_log(tmp_path / "r.jsonl")].count(True) > 0
