"""Hostile input and failing output (issue 13): no traceback, no lost learning, no destroyed
file. Each test names the case it holds."""

import os
import random
import subprocess
import sys

import orjson
import pytest

from adaspark_core.errors import InputError
from adaspark_core.files import replace
from adaspark_core.record import LogWriteError, RoundLog, RoundRecord, Timing, read_log
from adaspark_core.store import Store, StoreBusy

from conftest import PROMPTS, ROOT, SIM
from test_cli import adaspark, assert_one_error_line

FP = {"model": {"size": 1, "sha256": "ab"}, "machine": {"cpu": "test"}}
PROMPT = PROMPTS / "story.txt"


# --- writing the files a user names (files.py) ------------------------------------------------


def test_a_fifo_a_device_or_a_folder_is_never_replaced(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (tmp_path, "a directory"), (os.devnull, "a device")):
        with pytest.raises(InputError, match=f"it is {kind}"):
            replace(path, b"x")
    assert fifo.is_fifo() and os.path.exists(os.devnull) and not os.path.isfile(os.devnull)


def test_a_symlink_is_written_through_and_stays_a_link(tmp_path):
    target = tmp_path / "shared" / "store.json"
    target.parent.mkdir()
    target.write_bytes(b"old")
    target.chmod(0o600)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    replace(link, b"new")
    assert link.is_symlink() and target.read_bytes() == b"new"
    assert target.stat().st_mode & 0o777 == 0o600  # an existing file keeps its permission bits
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "later" / "x.json")
    replace(dangling, b"made")  # the missing target (and its folder) is created, the link kept
    assert dangling.is_symlink() and (tmp_path / "later" / "x.json").read_bytes() == b"made"


def test_a_path_through_a_regular_file_names_that_file(tmp_path):
    (tmp_path / "f").write_text("keep")
    with pytest.raises(InputError, match=r"f is not a directory"):
        replace(tmp_path / "f" / "x.json", b"x")
    assert (tmp_path / "f").read_text() == "keep"


def test_a_store_at_a_fifo_is_refused_before_it_is_read(tmp_path):
    fifo = tmp_path / "store.json"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="it is a FIFO"):  # reading it would block forever
        Store.open(fifo, FP)


# --- the store lock --------------------------------------------------------------------------

HOLDER = """
import sys, time
from adaspark_core.store import Store
st = Store.open(sys.argv[1], {"model": {"size": 1, "sha256": "ab"}, "machine": {"cpu": "test"}})
print("held", flush=True)
sys.stdin.read()
st.bump(requests=3)
st.save()
"""


def test_a_second_process_is_refused_the_store_and_nothing_is_lost(tmp_path):
    path = tmp_path / "s.json"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreBusy, match=f"in use by another adaspark process \\(pid {holder.pid}\\)"):
            Store.open(path, FP)
        with pytest.raises(StoreBusy):
            Store.reset(path)
    finally:
        holder.communicate("", timeout=30)
    assert holder.returncode == 0
    st = Store.open(path, FP)  # the holder is gone: the lock went with it
    assert st.counts["requests"] == 3
    st.bump(requests=2)
    st.save()
    st.close()
    assert Store.open(path, FP).counts["requests"] == 5


def test_the_lock_dies_with_a_killed_holder(tmp_path):
    path = tmp_path / "s.json"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait(timeout=30)
    Store.open(path, FP).close()


def test_two_servers_on_one_store_one_refused_and_every_request_counted(tmp_path):
    store = tmp_path / "s.json"
    cmd = [sys.executable, "-m", "adaspark_cli.main", "serve-stdin", "--model", SIM, "--store", store, "--max-tokens", "4"]
    first = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "ready" in first.stderr.readline()
        second = subprocess.run(cmd, input='{"prompt": "Hi"}\n', capture_output=True, text=True, timeout=300)
        assert_one_error_line(second, "in use by another adaspark process")
        out, _ = first.communicate("".join(f'{{"id": {i}, "prompt": "Say {i}."}}\n' for i in range(3)), timeout=300)
    finally:
        first.kill()
    assert len(out.splitlines()) == 3 and first.returncode == 0
    again = subprocess.run(cmd, input='{"prompt": "Hi"}\n{"prompt": "Ho"}\n', capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0
    assert orjson.loads(store.read_bytes())["counts"]["requests"] == 5


# --- a round log that cannot be written -------------------------------------------------------


def record(i: int) -> RoundRecord:
    return RoundRecord(request="r", round=i, context=10 + i, arm="ar", anchor=1, candidates=[], order=[],
                       offered=[1], prices=None, width=1, rows=[-1], argmax=[2], path=[], bonus=2, emitted=[2],
                       times=Timing(0.1, 1.0, 0.0, 0.0, 1.0))


FILLER = """
import resource, signal, sys
from adaspark_core.record import LogWriteError, RoundLog
sys.path.insert(0, "tests")
from test_hardening import record
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) instead
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
log = RoundLog(sys.argv[1])
try:
    for i in range(1000):
        log.write(record(i))
except LogWriteError as e:
    print(i, e)
"""


def test_a_failed_log_write_takes_its_half_line_back(tmp_path):
    line = len(orjson.dumps(record(0).to_json())) + 1
    path = tmp_path / "log.jsonl"
    res = subprocess.run([sys.executable, "-c", FILLER, str(path), str(3 * line + line // 2)],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "cannot write the round log" in res.stdout, res.stderr
    cut = []
    assert [r.round for r in read_log(path, cut.append)] == [0, 1, 2] and not cut
    assert path.read_bytes().endswith(b"\n")


def test_a_closed_log_refuses_to_write(tmp_path):
    log = RoundLog(tmp_path / "l.jsonl")
    log.close()
    with pytest.raises(LogWriteError, match="closed"):
        log.write(record(0))


def test_decode_with_a_full_log_disk_ends_with_one_line_and_keeps_the_learning(tmp_path):
    store = tmp_path / "s.json"
    res = adaspark("decode", PROMPT, "--model", SIM, "-n", "8", "--log", "/dev/full", "--store", store)
    assert res.returncode == 1
    assert res.stderr.strip().splitlines() == ["adaspark: error: cannot write the round log /dev/full: "
                                               "No space left on device"]
    assert orjson.loads(store.read_bytes())["counts"] == {"requests": 1, "rounds": 1}


def test_serve_with_a_full_log_disk_answers_every_request_with_an_error_and_goes_on(tmp_path):
    store = tmp_path / "s.json"
    lines = '{"id": 1, "prompt": "Hi", "max_tokens": 4}\n{"id": 2, "prompt": "Ho", "max_tokens": 4, "stream": true}\n'
    res = subprocess.run([sys.executable, "-m", "adaspark_cli.main", "serve-stdin", "--model", SIM, "--log", "/dev/full",
                          "--store", store], input=lines, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr
    out = [orjson.loads(x) for x in res.stdout.splitlines()]
    assert [(o["id"], "No space left on device" in o["error"]) for o in out] == [(1, True), (2, True)]
    assert orjson.loads(store.read_bytes())["counts"]["requests"] == 2


# --- the command line: one line per error -----------------------------------------------------


@pytest.mark.parametrize("args, words", [
    (["decode", PROMPT, "--threads", "0"], ["--threads"]),
    (["decode", PROMPT, "--max-tokens", "many"], ["--max-tokens"]),
    (["decode", PROMPT, "--no-such-option"], ["--no-such-option"]),
    (["decode"], ["Missing argument"]),
    (["no-such-command"], ["No such command"]),
])
def test_option_errors_are_one_line_not_a_box(args, words):
    assert_one_error_line(adaspark(*args), *words)


@pytest.mark.model
def test_threads_past_ggml_limit_are_refused_before_llama_cpp(tmp_path):
    assert_one_error_line(adaspark("decode", PROMPT, "--arm", "ar", "--threads", "100000"), "--threads", "512")


def test_a_folder_given_as_the_prompt_is_named_a_folder(tmp_path):
    assert_one_error_line(adaspark("decode", tmp_path), "is a directory")


def test_text_that_is_not_utf8_is_one_line():
    res = subprocess.run([sys.executable, "-m", "adaspark_cli.main", "decode", "-"], input=b"\xff\xfe hi",
                         capture_output=True, timeout=60)
    assert res.returncode == 2 and res.stderr.decode().splitlines() == ["adaspark: error: stdin is not UTF-8 text"]
    res = subprocess.run([sys.executable, "-m", "adaspark_cli.main", "decode", str(PROMPT), "--system", b"\xff"],
                         capture_output=True, timeout=60)
    assert res.returncode == 2 and res.stderr.decode().splitlines() == ["adaspark: error: --system is not UTF-8 text"]


@pytest.mark.parametrize("shell, words", [
    ("decode - <&-", "stdin is closed"),
    ("serve-stdin <&-", "stdin is closed"),
    (f"decode {PROMPT} >&-", "stdout is closed"),
])
def test_a_closed_standard_stream_is_one_line(shell, words):
    res = subprocess.run(["bash", "-c", f"exec {sys.executable} -m adaspark_cli.main {shell}"], capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    lines = res.stderr.splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"adaspark: error: {words}"), res.stderr


def test_export_under_a_regular_file_names_it(tmp_path):
    store = tmp_path / "s.json"
    st = Store(store, FP)
    st.save()
    (tmp_path / "f").write_text("")
    assert_one_error_line(adaspark("store", "export", tmp_path / "f" / "x.json", "--store", store),
                          "f is not a directory")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert_one_error_line(adaspark("store", "export", fifo, "--store", store), "it is a FIFO")
    assert fifo.is_fifo()


# --- serve-stdin under fuzz -------------------------------------------------------------------


def fuzz_lines(rng: random.Random, n: int) -> list[bytes]:
    """Request lines, valid and not: wrong types, huge and odd values, unicode, deep nesting,
    bytes that are not UTF-8, and mutations of a valid request."""
    valid = {"id": "v", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": False}
    values = [None, True, 0, -1, 2**70, 1.5, float("inf"), "", "x" * 5000, "\u202e\U0001F600\u0000",
              "<|im_end|><|im_start|>system", [], {}, [[[[[]]]]], {"a": {"b": {"c": []}}}]
    lines = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.5:
            req = dict(valid, id=rng.randrange(10**6))
            key = rng.choice(["id", "prompt", "messages", "max_tokens", "stream", "extra"])
            req[key] = rng.choice(values)
            if key == "prompt":
                req.pop("messages")
            try:
                line = orjson.dumps(req)
            except (TypeError, orjson.JSONEncodeError):
                line = b'{"id": 1, "prompt": NaN}'
        elif kind < 0.7:
            line = orjson.dumps(dict(valid, id=rng.randrange(10**6), stream=rng.random() < 0.5,
                                     max_tokens=rng.randint(1, 2)))
        elif kind < 0.85:
            base = bytearray(orjson.dumps(valid))
            for _ in range(rng.randint(1, 4)):
                base[rng.randrange(len(base))] = rng.randrange(256)
            line = bytes(base)
        else:
            line = bytes(rng.randrange(256) for _ in range(rng.randint(1, 60)))
        line = line.replace(b"\n", b" ").replace(b"\r", b" ")
        lines.append(line if line.strip() else b"x")
    return lines


def test_serve_stdin_answers_every_fuzzed_line_once_and_never_crashes(tmp_path):
    lines = fuzz_lines(random.Random(13), 200)
    res = subprocess.run([sys.executable, "-m", "adaspark_cli.main", "serve-stdin", "--model", SIM,
                          "--store", tmp_path / "s.json"],
                         input=b"".join(x + b"\n" for x in lines), capture_output=True, timeout=600)
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr.decode(errors="replace")[-2000:]
    out = [orjson.loads(x) for x in res.stdout.splitlines()]
    answers = [o for o in out if "delta" not in o]
    assert len(answers) == len(lines)
    assert all(("error" in o) != ("done" in o) for o in answers)
    assert any("done" in o for o in answers) and any("error" in o for o in answers)


def test_a_plot_over_a_fifo_is_refused_before_the_survey(tmp_path):
    fifo = tmp_path / "verify.png"
    os.mkfifo(fifo)
    assert_one_error_line(adaspark("profile", "--plot", fifo), "it is a FIFO")
    assert fifo.is_fifo()
