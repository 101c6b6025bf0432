"""``adaspark serve --parallel N`` (issue 29): requests decoded together on N slots of one context,
answered as they end, streamed, cut by stop strings, cancelled by a client that leaves, learned
from with the widths of every step logged, and refused with one line where it cannot run."""

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import orjson
import pytest
from conftest import SIM
from helpers import Server, chat_body, stream_events

from adaspark_core.evaluate.replay import replay
from adaspark_core.store.record import read_log


def test_parallel_on_a_simulated_model_is_one_error_line():
    res = subprocess.run([sys.executable, "-m", "adaspark_cli.main", "serve", "--port", "0", "--model", SIM,
                          "--parallel", "2"], capture_output=True, text=True, timeout=120)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "one request at a time" in lines[0], res.stderr


@pytest.mark.model
def test_parallel_requests_are_answered_together_logged_by_step_and_replayed(tmp_path):
    srv = Server("--parallel", 3, "--store", tmp_path / "store.json", "--log", tmp_path / "rounds.jsonl")
    try:
        questions = ["Name three rivers.", "Write one line about bread.", "What is chess?", "Describe an owl.",
                     "Why is glass clear?", "Count to five."]

        def ask(i):
            extra = {"stop": ["\n"]} if i == 1 else {"temperature": 0.8, "seed": 5} if i == 2 else {}
            r = srv.post("/v1/chat/completions", chat_body(questions[i], max_tokens=40, **extra))
            return r.status_code, r.json()

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, range(6)))
        assert all(code == 200 for code, _ in answers), answers
        assert all(a["choices"][0]["finish_reason"] in ("stop", "length") for _, a in answers)
        assert "\n" not in answers[1][1]["choices"][0]["message"]["content"]
        assert answers[2][1]["adaspark"]["seed"] == 5
        # a client that leaves mid-stream: its reply ends at the next step, the others go on
        body = chat_body("Write a very long story about a lighthouse keeper.", max_tokens=2000, stream=True)
        with srv.http.stream("POST", "/v1/chat/completions", content=orjson.dumps(body)) as r:
            rid = orjson.loads(next(e for e in stream_events(r.iter_lines())))["id"]
        assert srv.post("/v1/chat/completions", chat_body("Say hi.", max_tokens=4)).status_code == 200
        health = srv.http.get("/health").json()
        assert health["served"] >= 7 and health["queued"] == 0
    finally:
        code = srv.stop()
    assert code == 128 + signal.SIGTERM and "Traceback" not in srv.stderr, srv.stderr
    records = list(read_log(tmp_path / "rounds.jsonl"))
    left = [rec for rec in records if rec.request == rid]
    assert left[-1].last and left[-1].finish == "interrupted" and sum(len(r.emitted) for r in left) < 2000
    assert all(rec.step is not None for rec in records)
    _, report = replay(records)  # every step decided again as the server decided it
    assert max(int(n) for n in report.to_json()["batched"]) >= 2  # requests shared steps
    stored = orjson.loads((tmp_path / "store.json").read_bytes())
    assert stored["counts"]["requests"] == len({rec.request for rec in records})
