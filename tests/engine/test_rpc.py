"""The model split over two llama.cpp RPC servers on loopback (``adaspark rpc-server``, started
here on free ports and killed by PID): the text a tree verifies there is the text plain decoding
gives there, and locally the same up to near ties; a server that cannot be reached, never answers,
speaks another protocol, dies or stops answering mid-run is one error line, never a hang; the
store commands find a layout's store."""

import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time

import llama_cpp as L
import orjson
import pytest
from helpers import NEAR_TIE, adaspark, assert_one_error_line

from adaspark_core.base.paths import models_dir
from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import run
from adaspark_core.engine.devices import parse_layout
from adaspark_core.engine.llama import LlamaModel
from adaspark_core.engine.llama_batch import LlamaBatch
from adaspark_core.engine.llama_sequence import score
from adaspark_core.engine.llama_server import free_port
from benchmarks.relay import start_rpc_server, stop_rpc_server

pytestmark = [pytest.mark.model,
              pytest.mark.skipif(not L.llama_supports_rpc(), reason="llama-cpp-python built without GGML_RPC")]

QUESTIONS = ["Write one sentence about the sea.", "List three uses of copper.", "Explain recursion to a child."]


def _start_server() -> tuple[subprocess.Popen, str]:
    proc, port = start_rpc_server()
    return proc, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def started():
    procs = [_start_server() for _ in range(2)]
    yield procs
    for proc, _ in procs:
        stop_rpc_server(proc)


@pytest.fixture(scope="module")
def servers(started):
    return [endpoint for _, endpoint in started]


def test_a_tree_verified_over_two_rpc_servers_emits_plain_decodings_text(default_model_path, lm, servers):
    remote = LlamaModel(default_model_path, layout=parse_layout(rpc=",".join(servers)))
    try:
        assert remote.layout.rpc == tuple(servers)
        for text in QUESTIONS:
            prompt = lm.chat_prompt([{"role": "user", "content": text}])
            plain = run(remote.target(), prompt, parse_arm("ar"), 48).tokens
            for arm in ("tree:16", "adaspark"):
                assert run(remote.target(), prompt, parse_arm(arm), 48).tokens == plain, (text, arm)
            # locally the same text, up to a near tie where the kernels of the two layouts part
            local = run(lm.target(), prompt, parse_arm("ar"), 48).tokens
            i = next((i for i, (a, b) in enumerate(zip(local, plain)) if a != b), None)
            if i is not None:
                row = score(lm, prompt + local[: i + 1])[len(prompt) + i - 1]
                assert abs(row[local[i]] - row[plain[i]]) < NEAR_TIE, (text, i)
    finally:
        remote.close()


def test_a_prefill_over_rpc_returns_once_the_servers_computed_it(default_model_path, lm, servers):
    """A prefill reads no logits, and over RPC its compute goes out without waiting for a reply:
    the first verify then waited for the prompt's last chunk (2.1 s of a 2491-token prompt),
    counted as decoding. A prompt of several chunks, put in at once (``start``) or by a batched
    server's steps of prompt tokens alone, now ends in a read of its last row's logits: they are
    the prompt's next-token row, so the servers had computed the whole prompt."""
    prompt = lm.chat_prompt([{"role": "user", "content": " ".join(QUESTIONS) * 40}])
    want = score(lm, prompt)[-1]
    anchor = lm.tokenize("The", special=False)[0]
    remote = LlamaModel(default_model_path, layout=parse_layout(rpc=",".join(servers)))
    batch = None
    try:
        target = remote.target()
        assert len(prompt) > target._c.cap  # more than one chunk
        target.start(prompt + [anchor])
        batch = LlamaBatch(remote, 2, n_ctx=2048, prefill_per_step=256)
        slot = batch.slots[1]
        slot.start(prompt + [anchor], defer=True)
        while slot.pending:
            batch.verify([], [slot])
        for context in (target._c, batch._c):
            got = int(context.logits(1)[0].argmax())
            assert abs(want[got] - want.max()) < NEAR_TIE
    finally:
        if batch is not None:
            batch.close()
        remote.close()


def test_the_store_commands_find_the_store_a_run_over_rpc_learned(tmp_path, servers, monkeypatch):
    """A run over RPC learns into a store of its own layout; the device options lead the store
    commands to it, and without them they name the local CPU's (none in this test's own home)."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "models").symlink_to(models_dir(), target_is_directory=True)  # the prepared models, shared
    monkeypatch.setenv("ADASPARK_HOME", str(home))
    prompt = tmp_path / "p.txt"
    prompt.write_text("List three uses of copper.")
    rpc = ",".join(servers)
    assert adaspark("decode", prompt, "--rpc", rpc, "-n", "16").returncode == 0
    shown = adaspark("store", "show", "--rpc", rpc)
    assert shown.returncode == 0, shown.stderr
    assert f"RPC servers {', '.join(servers)}" in shown.stdout
    exported = tmp_path / "export.json"
    assert adaspark("store", "export", str(exported), "--rpc", rpc).returncode == 0
    assert orjson.loads(exported.read_bytes())["fingerprint"]["layout"]["rpc"] == servers
    assert "no store yet" in adaspark("store", "show").stderr  # the local CPU's: never learned here


def test_an_unreachable_server_is_one_line_at_once(tmp_path):
    closed = free_port()  # nothing listens there
    t0 = time.monotonic()
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello.")
    res = adaspark("decode", prompt, "--rpc", f"127.0.0.1:{closed}", "-n", "4")
    assert_one_error_line(res, "--rpc", "cannot reach the RPC server", str(closed))
    assert time.monotonic() - t0 < 60


def _fake_rpc_server(answer: bytes | None) -> socket.socket:
    """A loopback listener standing for a server: with ``answer``, each connection's hello gets
    it; without, nothing is ever read or said (a port of some other service that waits)."""
    listener = socket.create_server(("127.0.0.1", 0))
    if answer is not None:
        def serve():
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                with conn:
                    conn.recv(1 + 8 + 24, socket.MSG_WAITALL)
                    conn.sendall(answer)
                    conn.recv(1)  # until the client goes
        threading.Thread(target=serve, daemon=True).start()
    return listener


def test_a_port_that_never_answers_the_hello_is_one_line_in_bounded_time(tmp_path):
    silent = _fake_rpc_server(None)
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello.")
    try:
        t0 = time.monotonic()
        res = adaspark("decode", prompt, "--rpc", f"127.0.0.1:{silent.getsockname()[1]}", "-n", "4")
        assert_one_error_line(res, "--rpc", "did not answer a hello within 5 s")
        assert time.monotonic() - t0 < 60
    finally:
        silent.close()


def test_a_server_of_another_protocol_is_one_line_naming_it(tmp_path):
    old = _fake_rpc_server(struct.pack("<Q", 28) + bytes([6, 1, 0, 0]) + bytes(24))  # protocol 6.1.0
    prompt = tmp_path / "p.txt"
    prompt.write_text("Hello.")
    try:
        res = adaspark("decode", prompt, "--rpc", f"127.0.0.1:{old.getsockname()[1]}", "-n", "4")
        assert_one_error_line(res, "--rpc", "speaks RPC protocol 6.1.0", "same llama.cpp")
    finally:
        old.close()


def test_a_server_that_dies_mid_run_is_one_line_and_status_1(tmp_path):
    proc, endpoint = _start_server()
    other, endpoint2 = _start_server()
    prompt = tmp_path / "p.txt"
    prompt.write_text("Write a long story about the sea.")
    try:
        run_ = subprocess.Popen([sys.executable, "-m", "adaspark_cli.main", "decode", str(prompt), "-n", "2000",
                                 "--arm", "ar", "--rpc", f"{endpoint},{endpoint2}", "--store", str(tmp_path / "s.json")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert run_.stdout.read(40)  # decoding over both servers
        stop_rpc_server(proc)
        _, err = run_.communicate(timeout=60)
        assert run_.returncode == 1
        lines = err.strip().splitlines()
        assert lines[-1].startswith("adaspark: error: llama.cpp stopped, an RPC server lost"), err
    finally:
        stop_rpc_server(proc)
        stop_rpc_server(other)


def test_a_server_that_stops_answering_ends_the_run_within_its_timeout_and_keeps_what_was_learned(tmp_path):
    """A stopped server (SIGSTOP: its connection stays open, nothing comes back) would hold
    ggml's read for ever; with --rpc-timeout the run ends in one line, status 1, and the rounds
    learned before are in the store."""
    proc, endpoint = _start_server()
    other, endpoint2 = _start_server()
    prompt, store = tmp_path / "p.txt", tmp_path / "s.json"
    prompt.write_text("Write a long story about the sea.")
    try:
        run_ = subprocess.Popen([sys.executable, "-m", "adaspark_cli.main", "decode", str(prompt), "-n", "2000",
                                 "--rpc", f"{endpoint},{endpoint2}", "--rpc-timeout", "2", "--store", str(store)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert run_.stdout.read(40)  # decoding over both servers
        os.kill(other.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        _, err = run_.communicate(timeout=60)
        assert time.monotonic() - stopped < 30
        assert run_.returncode == 1
        assert err.strip().splitlines()[-1].startswith("adaspark: error: llama.cpp stopped, an RPC server lost or not "
                                                       "answering"), err
        cost = orjson.loads(store.read_bytes())["sections"]["width"]["cost"]
        assert cost["rounds"] > 0
    finally:
        os.kill(other.pid, signal.SIGCONT)
        stop_rpc_server(proc)
        stop_rpc_server(other)


def test_a_local_model_loaded_after_the_servers_are_gone_touches_none_of_their_devices(default_model_path, lm,
                                                                                       started, servers):
    """The servers' devices stay registered in this process; a model of the local CPU's layout
    is given no device, so llama.cpp never asks the dead servers for anything."""
    for proc, _ in started:
        stop_rpc_server(proc)
    prompt = lm.chat_prompt([{"role": "user", "content": QUESTIONS[0]}])
    local = LlamaModel(default_model_path)
    try:
        assert run(local.target(), prompt, parse_arm("ar"), 8).tokens == run(lm.target(), prompt, parse_arm("ar"), 8).tokens
    finally:
        local.close()
