"""Every file a command reads is a regular file of a bounded size (issue 39, cases 3 and 4): a
device, a folder, a FIFO or a link to a device where a file is read is one error line naming the
path and what it is, before a byte is read (files.read_regular, files.open_regular).

The commands run in subprocesses, all kinds of one reader at once, each under a timeout and an
address-space cap: a reader that blocks on a FIFO then fails at the timeout instead of hanging the
suite, and one that reads /dev/zero fails at the cap (MemoryError, a traceback) instead of taking
the machine's RAM, as `simulate --costs /dev/zero` took 2.6 GB in 4 s."""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PROMPTS, SIM
from helpers import assert_one_error_line

from adaspark_core.base.errors import InputError
from adaspark_core.base.files import TooLarge, open_regular, read_regular
from adaspark_core.candidates import memory_file
from adaspark_core.evaluate.tracesim import Trace, read_traces, write_trace
from adaspark_core.store.store import Store

FIXTURE_LOG = PROMPTS.parent / "logs" / "rounds.jsonl"
TIMEOUT = 20  # s: a refusal takes the interpreter's start-up; a blocked read never ends
CAP = 3 << 30  # bytes of address space: a decode on the simulated model runs within 1 GB of it
KINDS = ("device", "folder", "FIFO", "link")
FP = {"model": {"size": 1, "sha256": "ab"}, "machine": {"cpu": "test"}}


def bad(kind: str, path: Path) -> tuple[Path, tuple[str, ...]]:
    """A path of ``kind`` (made at ``path``, except the device itself) and the words its refusal
    must hold: the path, what it is, and for a link the device it leads to."""
    if kind == "device":
        return Path("/dev/zero"), ("/dev/zero", "it is a device")
    if kind == "folder":
        path.mkdir()
        return path, (str(path), "it is a directory")
    if kind == "FIFO":
        os.mkfifo(path)
        return path, (str(path), "it is a FIFO")
    path.symlink_to("/dev/zero")
    return path, (str(path), "(a link to /dev/zero)", "it is a device")


def refused(cases, what: str) -> None:
    """Run every ``(argv, words)`` of ``cases`` as an adaspark command at once and check that each
    ends within TIMEOUT with one error line holding ``what`` and its words."""
    procs = []
    try:
        for argv, _ in cases:
            p = subprocess.Popen([sys.executable, "-m", "adaspark_cli.main", *map(str, argv)],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            resource.prlimit(p.pid, resource.RLIMIT_AS, (CAP, CAP))  # before it has read anything
            procs.append(p)
        for p, (_, words) in zip(procs, cases):
            out, err = p.communicate(timeout=TIMEOUT)
            assert_one_error_line(subprocess.CompletedProcess(p.args, p.returncode, out, err), what, *words)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def trace_file(tmp_path) -> Path:
    path = tmp_path / "traces.jsonl"
    write_trace(path, Trace("r0", "specbench", "c0", 0, 0, [1, 2, 3, 4], [5, 6, 7], "length"))
    return path


def empty_store(path: Path) -> Path:
    with Store.open(path, FP) as st:
        st.save()
    return path


# --- the readers ---------------------------------------------------------------------------------


def test_read_regular_refuses_each_kind_by_name_before_reading(tmp_path):
    for kind in KINDS:
        path, words = bad(kind, tmp_path / f"{kind}.json")
        with pytest.raises(InputError) as e:
            read_regular(path, "the thing", 1 << 20)
        assert str(e.value).startswith(f"cannot read the thing {path}")
        assert all(w in str(e.value) for w in words) and "\n" not in str(e.value)
    with pytest.raises(FileNotFoundError):
        read_regular(tmp_path / "none.json", "the thing", 1 << 20)
    (tmp_path / "big").write_bytes(b"x" * 101)
    with pytest.raises(TooLarge, match="holds 101 bytes, more than the 100"):
        read_regular(tmp_path / "big", "the thing", 100)
    assert read_regular(tmp_path / "big", "the thing", 101) == b"x" * 101


def test_open_regular_streams_lines_each_bounded_and_refuses_as_read_regular_does(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_bytes(b"one\n\ntwo\ncut")
    with open_regular(log, "the log", 100, 4) as lines:
        assert list(lines) == [b"one\n", b"\n", b"two\n", b"cut"]  # the cut last line keeps no newline
    log.write_bytes(b"one\nthree\n")
    with open_regular(log, "the log", 100, 5) as lines, pytest.raises(TooLarge, match=r"log.jsonl:2: a line longer than 5 bytes"):
        list(lines)
    with pytest.raises(TooLarge, match="holds 10 bytes, more than the 9"):
        open_regular(log, "the log", 9, 100)
    with open_regular(log, "the log", 100, 60) as lines:  # a file that grew while it was read
        first = next(lines)
        with open(log, "ab") as f:
            f.write((b"x" * 49 + b"\n") * 3)  # lines within their bound, past the file's
        with pytest.raises(TooLarge, match="the log .* holds more than the 100 bytes"):
            list(lines)
    assert first == b"one\n"
    for kind in KINDS:
        path, words = bad(kind, tmp_path / f"{kind}.jsonl")
        with pytest.raises(InputError) as e:
            open_regular(path, "the log", 1 << 20, 1 << 10)
        assert all(w in str(e.value) for w in words)


def test_a_trace_line_that_is_not_an_object_is_named(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(trace_file(tmp_path).read_bytes() + b"[1, 2]\n")
    with pytest.raises(InputError, match=r"t.jsonl:2: not a trace line"):
        read_traces([path])


# --- the commands --------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["the trace file", "the round log"])
def test_simulate_refuses_traces_and_cost_logs_that_are_not_regular_files(tmp_path, what):
    traces = trace_file(tmp_path)
    cases = []
    for kind in KINDS:
        path, words = bad(kind, tmp_path / f"{kind}.jsonl")
        argv = [path, "--costs", FIXTURE_LOG] if what == "the trace file" else [traces, "--costs", path]
        cases.append((["simulate", *argv], words))
    refused(cases, what)


def test_compare_refuses_set_and_prompt_files_that_are_not_regular_files(tmp_path):
    cases = []
    for kind in ("device", "FIFO", "link"):  # named (a folder named is a folder of sets): not .json, a prompt file
        path, words = bad(kind, tmp_path / f"{kind}.txt")
        cases.append((["compare", "--model", SIM, "--sets", path], ("the prompt file", *words)))
    for kind in KINDS[1:]:  # in a folder of sets, where z.json sorts after the good one
        folder = tmp_path / kind
        folder.mkdir()
        (folder / "specbench.json").write_bytes((PROMPTS.parent / "testset" / "specbench.json").read_bytes())
        _, words = bad(kind, folder / "z.json")
        cases.append((["compare", "--model", SIM, "--sets", folder], ("the conversation set", *words)))
    refused(cases, "cannot read")


def test_memorize_refuses_corpus_files_that_are_not_regular_files(tmp_path):
    cases = []
    for kind in KINDS:
        path, words = bad(kind, tmp_path / f"{kind}.txt")
        cases.append((["store", "memorize", path, "--model", SIM, "--store", tmp_path / "s.json"], words))
    refused(cases, "the corpus file")
    assert not (tmp_path / "s.json").exists()  # refused before the store was made


def test_a_memory_that_is_not_a_regular_file_is_refused_by_show_and_decode(tmp_path):
    cases = []
    for kind in KINDS[1:]:  # a store's memory is named after it: the device is reached by a link
        shown = empty_store(tmp_path / f"shown-{kind}.json")  # show reads a store of any model
        _, words = bad(kind, memory_file.memory_path(shown))
        cases.append((["store", "show", "--store", shown], words))
        decoded = tmp_path / f"decoded-{kind}.json"  # decode starts a store of its own model
        _, words = bad(kind, memory_file.memory_path(decoded))
        cases.append((["decode", PROMPTS / "story.txt", "--model", SIM, "-n", 4, "--store", decoded], words))
    refused(cases, "the n-gram memory")



def test_decode_refuses_a_prompt_file_of_each_kind(tmp_path):
    """``decode PROMPT`` read a device whole (``/dev/zero`` filled the RAM) and blocked on a FIFO."""
    cases = []
    for kind in KINDS:
        path, words = bad(kind, tmp_path / f"prompt-{kind}.txt")
        cases.append((["decode", path, "--model", SIM, "--max-tokens", 4], words))
    refused(cases, "the prompt file")
