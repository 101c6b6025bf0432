"""``adaspark serve`` (issue 15): a real server on 127.0.0.1 answering the real ``openai`` client,
OpenAI-shaped errors that leave it serving, a bounded queue, concurrent clients all answered and
learned from, a client that leaves mid-stream, and SIGTERM mid-request."""

import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
from conftest import PROMPTS, SIM, assert_same_sample
from helpers import Server, chat_body, stream_events

from adaspark_core.store.record import read_log

# --- on the simulated model: the HTTP behaviour, without llama.cpp -----------------------------

def test_bad_requests_get_openai_shaped_errors_and_the_server_keeps_serving(tmp_path):
    srv = Server("--model", SIM, "--n-ctx", 64, "--store", tmp_path / "store.json")
    try:
        cases = [
            ("/v1/chat/completions", b"{\"messages\": [", 400, None),
            ("/v1/chat/completions", chat_body("hi", temprature=0.2), 400, "unknown_field"),
            ("/v1/chat/completions", chat_body("hi", max_tokens="ten"), 400, None),
            ("/v1/completions", {"prompt": "hi", "stream": 1}, 400, None),
            ("/v1/chat/completions", chat_body("word " * 200), 400, "context_length_exceeded"),
            ("/v1/completions", {"prompt": [10 ** 9]}, 400, None),
            ("/v1/chat/completions", chat_body("hi", temperature=2.5), 400, None),
            ("/v1/embeddings", {"input": "hi"}, 404, "not_found"),
        ]
        for path, body, status, code in cases:
            r = srv.post(path, body)
            assert r.status_code == status, (path, body, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["code"] == code
        r = srv.http.get("/v1/chat/completions")
        assert r.status_code == 405 and r.json()["error"]["message"].startswith("no such method")
        r = srv.post("/v1/chat/completions", chat_body("hi", max_tokens=8))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert srv.http.get("/health").json()["status"] == "ok"
        models = srv.http.get("/v1/models").json()
        assert models["object"] == "list" and len(models["data"]) == 1
    finally:
        assert srv.stop() == 128 + signal.SIGTERM
    assert "Traceback" not in srv.stderr


def test_a_full_queue_answers_503_and_every_accepted_request_is_served(tmp_path):
    # --queue 0: one decoding, none waiting. Requests sent together: the first decodes a long
    # reply, the others find it busy.
    srv = Server("--model", SIM, "--queue", 0, "--n-ctx", 8192)
    try:
        long_one = chat_body("hi", max_tokens=6000)
        with ThreadPoolExecutor(4) as pool:
            first = pool.submit(srv.post, "/v1/chat/completions", long_one)
            time.sleep(0.3)
            rest = [pool.submit(srv.post, "/v1/chat/completions", chat_body("hi", max_tokens=4)) for _ in range(3)]
            statuses = [f.result().status_code for f in rest]
            assert first.result().status_code == 200
        assert 503 in statuses, statuses
        busy = next(f.result().json() for f in rest if f.result().status_code == 503)
        assert busy["error"]["code"] == "queue_full" and busy["error"]["type"] == "server_error"
        assert srv.post("/v1/chat/completions", chat_body("hi", max_tokens=4)).status_code == 200
    finally:
        srv.stop()


def test_a_port_in_use_is_one_error_line(tmp_path):
    srv = Server("--model", SIM)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", srv.url)
        port = srv.url.rsplit(":", 1)[1]
        res = subprocess.run([sys.executable, "-m", "adaspark_cli.main", "serve", "--model", SIM, "--port", port],
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 2 and "cannot listen on 127.0.0.1:" in res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    finally:
        srv.stop()


def test_an_ipv6_address_is_printed_in_brackets(tmp_path):
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback")
    srv = Server("--model", SIM, "--store", tmp_path / "store.json", "--host", "::1", timeout=60)
    try:
        assert re.fullmatch(r"http://\[::1\]:\d+", srv.url)
        assert srv.http.get("/health").json()["status"] == "ok"  # the printed URL is one a client can use
    finally:
        srv.stop()


# --- on the real default model -------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    srv = Server("--store", tmp / "store.json", "--log", tmp / "rounds.jsonl", "--queue", 8)
    srv.tmp = tmp
    yield srv
    code = srv.stop()
    assert code == 128 + signal.SIGTERM and "Traceback" not in srv.stderr, srv.stderr


def store_requests(srv) -> int:
    """Requests the server's store has learned from: none before its first save."""
    path = srv.tmp / "store.json"
    return orjson.loads(path.read_bytes())["counts"]["requests"] if path.exists() else 0


@pytest.mark.model
def test_the_openai_client_chats_streams_and_completes(served, lm):
    client = served.client()
    assert [m.id for m in client.models.list().data] == [served.http.get("/v1/models").json()["data"][0]["id"]]
    messages = [{"role": "user", "content": (PROMPTS / "rewrite.txt").read_text()}]
    whole = client.chat.completions.create(model="anything", messages=messages, max_tokens=48)
    text = whole.choices[0].message.content
    assert text and whole.choices[0].finish_reason in ("stop", "length")
    assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens == len(lm.chat_prompt(messages))
    stats = whole.model_extra["adaspark"]
    assert stats["decoding"].startswith("greedy") and sum(stats["widths"].values()) == stats["rounds"]
    chunks = list(client.chat.completions.create(model="anything", messages=messages, max_tokens=48, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the same greedy reply, its deltas joined; the second request prefilled nothing new
    assert streamed == text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    last = next(c for c in reversed(chunks) if c.choices)
    assert last.model_extra["adaspark"]["prompt_reused"] == whole.usage.prompt_tokens - 1
    done = client.completions.create(model="anything", prompt="The capital of France is", max_tokens=12)
    assert done.choices[0].text and done.usage.completion_tokens <= 12
    cut = client.completions.create(model="anything", prompt="Count: 1, 2, 3,", max_tokens=40, stop=[" 6"])
    assert cut.choices[0].finish_reason == "stop" and " 6" not in cut.choices[0].text


@pytest.mark.model
def test_a_sampled_request_is_seeded_and_says_how_it_was_drawn(served, lm):
    from adaspark_core.base.sampling import Sampling

    client = served.client()
    messages = [{"role": "user", "content": "Name a colour."}]
    ask = dict(model="m", messages=messages, max_tokens=16, temperature=0.9, top_p=0.95, seed=7)
    a, b = (client.chat.completions.create(**ask) for _ in range(2))
    # The same sample, up to kernel near ties (the second request's widths and reused prefix
    # differ): its tokens, from the round log, which names each request by its response id.
    tokens = {a.id: [], b.id: []}
    for _ in range(50):  # a reply's last round is logged just after the reply is out
        recs = [r for r in read_log(served.tmp / "rounds.jsonl") if r.request in tokens]
        if sum(r.last for r in recs) == 2:
            break
        time.sleep(0.1)
    for r in recs:
        tokens[r.request] += r.emitted
    assert b.choices[0].message.content == b"".join(map(lm.piece, tokens[b.id])).decode()
    assert_same_sample(lm, lm.chat_prompt(messages), tokens[b.id], tokens[a.id], Sampling(0.9, top_p=0.95), 7)
    stats = a.model_extra["adaspark"]
    assert stats["decoding"].startswith("sampled (temperature 0.9, top_p 0.95)") and stats["seed"] == 7
    unseeded = client.chat.completions.create(**{**ask, "seed": None}).model_extra["adaspark"]
    assert isinstance(unseeded["seed"], int)  # the seed drawn for it, to reproduce it


@pytest.mark.model
def test_four_clients_five_requests_each_are_all_answered_and_learned(served):
    before = store_requests(served)
    topics = ["rivers", "bread", "chess", "owls", "glass"]

    def client_run(c):
        client = served.client()
        out = []
        for i, topic in enumerate(topics):
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": f"{c}: one line on {topic}"}],
                                               max_tokens=10)
            out.append((r.choices[0].finish_reason, r.usage.completion_tokens, r.id))
        return out

    with ThreadPoolExecutor(4) as pool:
        results = [x for part in pool.map(client_run, range(4)) for x in part]
    assert len(results) == 20 and all(f in ("stop", "length") and 1 <= n <= 10 for f, n, _ in results)
    assert len({rid for _, _, rid in results}) == 20
    assert store_requests(served) == before + 20  # saved after each one
    logged = {rec.request for rec in read_log(served.tmp / "rounds.jsonl")}
    assert {rid for _, _, rid in results} <= logged


@pytest.mark.model
def test_a_client_that_leaves_mid_stream_stops_its_decode_and_its_learning_is_kept(served):
    before = store_requests(served)
    body = chat_body("Write a very long story about a lighthouse keeper.", max_tokens=2000, stream=True)
    with served.http.stream("POST", "/v1/chat/completions", content=orjson.dumps(body)) as r:
        assert r.status_code == 200
        first = orjson.loads(next(e for e in stream_events(r.iter_lines())))
    rid = first["id"]
    # the server goes on: the next request is answered, after the abandoned one ended
    r = served.post("/v1/chat/completions", chat_body("Say hi.", max_tokens=4))
    assert r.status_code == 200
    rounds = [rec for rec in read_log(served.tmp / "rounds.jsonl") if rec.request == rid]
    # cut short, not ended by stop or length: the last round decoded says so
    assert rounds and [rec.finish for rec in rounds] == [None] * (len(rounds) - 1) + ["interrupted"]
    assert rounds[-1].last and not any(rec.last for rec in rounds[:-1])
    assert sum(len(rec.emitted) for rec in rounds) < 2000
    assert store_requests(served) == before + 2


@pytest.mark.model
def test_serve_answers_as_decode_does(tmp_path):
    prompt = PROMPTS / "rewrite.txt"
    decode = subprocess.run([sys.executable, "-m", "adaspark_cli.main", "decode", prompt, "--arm", "chain:3",
                             "-n", "40", "--json"], capture_output=True, text=True, timeout=300)
    raw = subprocess.run([sys.executable, "-m", "adaspark_cli.main", "decode", prompt, "--arm", "chain:3",
                          "-n", "20", "--json", "--raw"], capture_output=True, text=True, timeout=300)
    srv = Server("--arm", "chain:3", "--no-reuse-prefix")
    try:
        client = srv.client()
        chat = client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt.read_text()}],
                                              max_tokens=40)
        completion = client.completions.create(model="m", prompt=prompt.read_text(), max_tokens=20)
    finally:
        srv.stop()
    assert chat.choices[0].message.content == orjson.loads(decode.stdout)["text"]
    assert completion.choices[0].text == orjson.loads(raw.stdout)["text"]


@pytest.mark.model
def test_sigterm_mid_stream_ends_the_reply_saves_the_store_and_exits(tmp_path):
    store = tmp_path / "store.json"
    srv = Server("--store", store)
    body = chat_body("Write a very long story about a lighthouse keeper.", max_tokens=2000, stream=True)
    with srv.http.stream("POST", "/v1/chat/completions", content=orjson.dumps(body)) as r:
        events = stream_events(r.iter_lines())
        seen = [next(events)]
        srv.proc.send_signal(signal.SIGTERM)
        seen += list(events)
    code = srv.stop()
    assert seen[-1] == "[DONE]"
    finish = [c["choices"][0]["finish_reason"] for c in map(orjson.loads, seen[:-1]) if c["choices"]]
    assert finish[-1] == "interrupted" and all(f is None for f in finish[:-1])
    assert code == 128 + signal.SIGTERM
    assert "Traceback" not in srv.stderr, srv.stderr
    assert orjson.loads(store.read_bytes())["counts"]["requests"] == 1
