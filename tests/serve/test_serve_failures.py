"""The batched server's failure rule (issue 39): whatever raises while one request is admitted,
stepped, closed or logged ends that request with a 500, and the decoding thread goes on with the
others and the queue; a failure of a step's shared verify ends every request in that step; a
thread that cannot go on says so on /health (503), refuses what waits, and stops the server,
which exits 1. Driven in-process on the simulated model, its targets made the slots of a batch
(``SimBatch``: the simulated model decodes one request at a time on the command line), so none of
this loads llama.cpp. Also: the load benchmark's --clients refused in one line."""

import asyncio
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import orjson
import pytest
from conftest import ROOT, SIM
from helpers import assert_one_error_line, chat_body

from adaspark_core.decode.arms import Speculation
from adaspark_core.decode.generation import Generation
from adaspark_core.decode.runtime import EngineOptions, Runtime
from adaspark_core.engine.sim import VirtualClock
from adaspark_core.engine.simlm import SimLMTarget
from adaspark_core.learn.learned import Learners
from adaspark_core.serve import http_app
from adaspark_core.serve import openai_api as api
from adaspark_core.serve.decoder import Decoder, Job
from adaspark_core.serve.http_limits import Limits
from adaspark_core.serve.service import BatchServer
from adaspark_core.store.record import LogWriteError, RoundLog, read_log

WAIT_S = 30  # the longest any answer may take: a request left waiting fails its test, not hangs it
LONG, SHORT = 120, 30  # reply caps: long enough to be decoding together when the failure comes


class SimSlot(SimLMTarget):
    """A simulated target as one slot of a batch; its prompt is in at once (none pending)."""

    pending: tuple = ()

    def start(self, tokens: list[int], defer: bool = False) -> None:
        super().start(tokens)


class SimBatch:
    """``n`` slots over the simulated model on one virtual clock, verified in one call like
    LlamaBatch's; ``fail_at``: the verify (counted from 1) that raises, after its rows went in
    (as a decode that fails part way)."""

    def __init__(self, model, n: int):
        self.slots = [SimSlot(model, 4096) for _ in range(n)]
        clock = VirtualClock()
        for slot in self.slots:
            slot.clock = clock
        self.fail_at: int | None = None
        self.verifies = 0

    def verify(self, items, prefill=()):
        self.verifies += 1
        verified = [slot.verify(lay) for slot, lay in items]
        if self.verifies == self.fail_at:
            raise RuntimeError("injected: the step's decode failed")
        return verified

    def close(self) -> None:
        pass


class FlakyLog(RoundLog):
    """A round log whose write of each record ``fails(rec)`` picks fails as on a full disk."""

    def __init__(self, path, fails):
        super().__init__(path)
        self.fails = fails

    def write(self, rec) -> None:
        if self.fails(rec):
            raise LogWriteError(f"cannot write the round log {self.name}: No space left on device")
        super().write(rec)


def batched(tmp_path, n: int = 3, log=None) -> Runtime:
    """What ``adaspark serve --model sim:... --parallel n`` would open, were the sim batched."""
    rt = Runtime.open(EngineOptions(model=SIM), Speculation.of("adaspark"), store=tmp_path / "store.json", log=log)
    rt.engine = SimBatch(rt.model, n)
    rt.slots, rt.target = rt.engine.slots, rt.engine.slots[0]
    return rt


def start_together(decoder: Decoder, n: int) -> None:
    """The next request to be admitted waits until ``n`` are in the decoder, so that they begin in
    one step, as requests whose prompts prefill together on the real model do (the simulated
    model has no prefill to take that long)."""
    rt = decoder.rt
    chat = rt.chat

    def first_waits(messages, *tools):
        rt.chat = chat
        deadline = time.monotonic() + WAIT_S
        while decoder.pending < n and time.monotonic() < deadline:
            time.sleep(0.005)
        return chat(messages, *tools)

    rt.chat = first_waits


def answers(decoder: Decoder, caps: dict[str, int]) -> dict:
    """Chat requests named and capped by ``caps``, sent at once and begun in one step: name ->
    ("done", Reply), ("error", APIError), or ("refused", APIError) where ``submit`` turned it away."""
    start_together(decoder, len(caps))

    async def ask(name: str, cap: int):
        body = orjson.dumps(chat_body(f"Tell a long story about {name}.", max_tokens=cap, stream=True))
        job = Job(api.parse(body, True), name, asyncio.get_running_loop())
        try:
            decoder.submit(job)
        except api.APIError as e:
            return "refused", e
        while True:
            kind, value = await asyncio.wait_for(job.events.get(), WAIT_S)
            if kind != "text":
                return kind, value

    async def together():
        return await asyncio.gather(*(ask(name, cap) for name, cap in caps.items()))

    return dict(zip(caps, asyncio.run(together())))


def close(decoder: Decoder) -> None:
    """Decoder.close, bounded: a decoding thread that never ends fails the test instead."""
    closer = threading.Thread(target=decoder.close, daemon=True)
    closer.start()
    closer.join(WAIT_S)
    assert not closer.is_alive(), "the decoding thread did not end"


def assert_done(outcomes: dict, names: str) -> None:
    for name in names:
        kind, value = outcomes[name]
        assert kind == "done" and value.finish == "length", (name, kind, value)


def assert_failed(outcome, *words: str) -> None:
    kind, value = outcome
    assert kind == "error" and value.status == 500, outcome
    for w in words:
        assert w in str(value), value


def assert_serving(decoder: Decoder, served: int) -> None:
    assert decoder.health() == (200, {"status": "ok", "busy": False, "queued": 0, "served": served})


def failure_then_more(rt: Runtime, first: dict, later: dict, served: int, warn=print,
                      between=lambda: None) -> tuple[dict, dict]:
    """The answers to ``first`` (requests begun in one step, among which the failure comes) and
    then to ``later``; in between ``between()`` checks what it may, and after them the decoding
    thread must be serving, idle, with ``served`` replies done. The decoder is closed either way."""
    decoder = Decoder(rt, 8, warn)
    try:
        out = answers(decoder, first)
        between()
        out = out, answers(decoder, later)
        assert_serving(decoder, served=served)
    finally:
        close(decoder)
    return out


def test_a_request_whose_round_cannot_be_logged_fails_alone(tmp_path, monkeypatch, capsys):
    learned = []
    learn = Learners.learn

    def counted(self, rec):
        learned.append((rec.request, rec.round))
        return learn(self, rec)

    monkeypatch.setattr(Learners, "learn", counted)
    rt = batched(tmp_path)
    rt.log = FlakyLog(tmp_path / "rounds.jsonl", lambda rec: rec.request == "b" and rec.round == 2)
    warnings = []
    first, later = failure_then_more(rt, {"a": LONG, "b": LONG, "c": LONG}, {"d": SHORT, "e": SHORT}, 4,
                                     warnings.append)
    assert_failed(first["b"], "cannot write the round log", "the reply was cut short")
    assert_done(first, "ac")
    assert_done(later, "de")
    # b's round 2 was learned once: its close does not take again the record whose write failed
    assert learned.count(("b", 2)) == 1 and len(learned) == len(set(learned))
    logged = [(rec.request, rec.round) for rec in read_log(tmp_path / "rounds.jsonl")]
    assert [r for name, r in logged if name == "b"] == [0, 1]
    assert all((name, r) in logged for name, r in learned if name != "b")
    assert warnings == [] and "Traceback" not in capsys.readouterr().err  # a full disk is no bug


def close_fails_for(monkeypatch, name: str) -> None:
    """Request ``name``'s Generation.close raises after it has done its work."""
    close_gen = Generation.close

    def failing_close(self):
        close_gen(self)
        if self.request_id == name:
            raise RuntimeError(f"injected: {name}'s close failed")

    monkeypatch.setattr(Generation, "close", failing_close)


def test_a_request_whose_close_fails_fails_alone(tmp_path, monkeypatch, capsys):
    close_fails_for(monkeypatch, "b")
    # b ends first, the others decoding
    first, later = failure_then_more(batched(tmp_path), {"a": LONG, "b": SHORT, "c": LONG}, {"d": SHORT}, 3)
    assert_failed(first["b"], "internal error: RuntimeError: injected: b's close failed")
    assert_done(first, "ac")
    assert_done(later, "d")
    assert "injected: b's close failed" in capsys.readouterr().err  # a bug's trace, for its finder


def test_a_request_that_cannot_be_admitted_fails_alone(tmp_path, monkeypatch):
    generation = Runtime.generation

    def failing_generation(self, prompt, max_tokens, request_id="r0", **kw):
        if request_id == "b":
            raise RuntimeError("injected: b cannot start")
        return generation(self, prompt, max_tokens, request_id, **kw)

    monkeypatch.setattr(Runtime, "generation", failing_generation)
    # b's slot was given back: three more at once take all three slots
    first, later = failure_then_more(batched(tmp_path), {"a": LONG, "b": LONG, "c": LONG},
                                     {"d": SHORT, "e": SHORT, "f": SHORT}, 5)
    assert_failed(first["b"], "internal error: RuntimeError: injected: b cannot start")
    assert_done(first, "ac")
    assert_done(later, "def")


def test_a_step_whose_verify_fails_ends_every_request_in_it_and_serving_goes_on(tmp_path, monkeypatch):
    # ... while one of them also fails to close: the others are closed all the same, and the
    # thread lives
    close_fails_for(monkeypatch, "a")
    rt = batched(tmp_path, log=tmp_path / "rounds.jsonl")
    rt.engine.fail_at = 4

    def no_verify_pending():  # the rows the failed verify held were taken off every slot
        assert all(slot._pending is None for slot in rt.engine.slots)

    first, later = failure_then_more(rt, {"a": LONG, "b": LONG, "c": LONG}, {"d": SHORT, "e": SHORT}, 2,
                                     between=no_verify_pending)
    for name in "abc":  # each answered with the step's failure, a's own close failure only on stderr
        assert_failed(first[name], "internal error: RuntimeError: injected: the step's decode failed")
    assert_done(later, "de")
    records = list(read_log(tmp_path / "rounds.jsonl"))
    assert {rec.request for rec in records if rec.last} == {"d", "e"}  # the failed ones never ended


def test_a_decoding_thread_that_cannot_go_on_says_so_and_refuses_the_rest(tmp_path, monkeypatch):
    def broken(self):
        raise RuntimeError("injected: the loop broke")

    monkeypatch.setattr(BatchServer, "step", broken)
    errors = []
    decoder = Decoder(batched(tmp_path, n=2), 8, print, lambda line, trace: errors.append((line, trace)))
    try:
        first = answers(decoder, {"a": LONG, "b": LONG, "c": LONG})
        status, health = decoder.health()
        after = answers(decoder, {"d": SHORT})
    finally:
        close(decoder)
    # a and b were decoding (500), c waiting (503): none is left waiting
    assert [(kind, value.status) for kind, value in first.values()] == [("error", 500), ("error", 500), ("error", 503)]
    assert first["c"][1].code == "decoder_failed"
    assert status == 503 and health["status"] == "failed" and "injected: the loop broke" in health["error"]
    kind, refused = after["d"]
    assert kind == "refused" and refused.status == 503 and refused.code == "decoder_failed"
    # the operator is told once, with the trace for whoever finds the bug
    [(line, trace)] = errors
    assert line == "the decoding thread failed (RuntimeError: injected: the loop broke); the server stops"
    assert trace.startswith("Traceback") and "injected: the loop broke" in trace


@contextmanager
def serving(rt: Runtime):
    """``adaspark serve`` on ``rt`` in a thread of this process, on a free loopback port: (the
    server, its URL, its thread). Stopped as SIGTERM stops it, if it has not stopped itself."""
    sock = http_app.listen("127.0.0.1", 0, 16)
    server = http_app.make_server(rt, 8, 0.0, Limits(2 ** 20, 16, 10.0), print)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{sock.getsockname()[1]}", thread
    finally:
        server.handle_exit(signal.SIGTERM, None)
        thread.join(WAIT_S)
        close(server.decoder)
        sock.close()
    assert not thread.is_alive()


def post(url: str, text: str, results: dict) -> None:
    with httpx.Client(base_url=url, timeout=WAIT_S) as client:
        results[text] = client.post("/v1/chat/completions", content=orjson.dumps(chat_body(text, max_tokens=40)))


def test_through_http_a_full_log_disk_answers_every_request_and_the_server_goes_on(tmp_path):
    # the case: --parallel 2 --log /dev/full, two chat requests at once, then a third
    results: dict = {}
    with serving(batched(tmp_path, n=2, log=Path("/dev/full"))) as (server, url, _):
        start_together(server.decoder, 2)
        two = [threading.Thread(target=post, args=(url, text, results)) for text in ("Name a river.", "An owl?")]
        for t in two:
            t.start()
        for t in two:
            t.join(WAIT_S)
        post(url, "Count to five.", results)
        health = httpx.get(url + "/health", timeout=WAIT_S)
    assert len(results) == 3
    for r in results.values():
        assert r.status_code == 500, r.text
        assert "cannot write the round log /dev/full" in r.json()["error"]["message"]
    assert health.status_code == 200 and health.json()["status"] == "ok" and not health.json()["busy"]
    assert server.exit_code == 128 + signal.SIGTERM


def test_through_http_a_decoding_thread_that_fails_stops_the_server_with_exit_code_1(tmp_path, monkeypatch):
    def broken(self):
        raise RuntimeError("injected: the loop broke")

    monkeypatch.setattr(BatchServer, "step", broken)
    results: dict = {}
    with serving(batched(tmp_path, n=2)) as (server, url, thread):
        post(url, "Name a river.", results)
        thread.join(WAIT_S)  # the server stops by itself
        assert not thread.is_alive()
    r = results["Name a river."]
    assert r.status_code == 500 and "the decoding thread failed" in r.json()["error"]["message"]
    assert server.exit_code == 1


@pytest.mark.parametrize("clients", ["abc", "", "1,,2", "0,4"])
def test_the_load_benchmark_refuses_bad_client_counts_in_one_line(clients):
    res = subprocess.run([sys.executable, "-m", "benchmarks.bench", "load", "--clients", clients], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert_one_error_line(res, "--clients", "comma-separated counts from 1 to 64")
