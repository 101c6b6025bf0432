"""What several test modules share: the CLI as a subprocess and its one-line errors, the greedy
check of a reply against a re-score and the KV invariants, and ``adaspark serve`` in a subprocess."""

import re
import signal
import subprocess
import sys
import threading

import httpx
import orjson
from conftest import NEAR_TIE

from adaspark_core.decode.arms import parse_arm
from adaspark_core.decode.generation import Generation
from adaspark_core.engine.llama_sequence import rescore

# NEAR_TIE (conftest): with flash attention off, a verify of two rows or more computes every row
# bit for bit as the one-batch re-score does; a one-row verify runs another kernel, whose logits
# differ by up to 1.2 (measured on the default model) and whose argmax differed from the
# re-score's at gaps of at most 0.28 over 348 tokens of six prompts.


def adaspark(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "adaspark_cli.main", *map(str, args)],
                          input=stdin, capture_output=True, text=True, timeout=300)


def assert_one_error_line(res, *words):
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adaspark: error: "), res.stderr
    for w in words:
        assert w in lines[0]
    assert res.stdout == ""


def check_kv(target, sizes):
    """Sequence 0 holds exactly the committed positions 0..n_past-1 and nothing else; a leaf
    sequence holds exactly the first ``synced`` of those cells and no cell of its own (leaf
    sequences are synced lazily, see engine/llama_target.py). "Exactly": a sequence's saved-state size is
    affine in its cell count with one slope for all, so no sequence hides an extra cell."""
    ranges = target.seq_ranges()
    assert ranges.pop(0) == (0, target.n_past - 1)
    for s, (lo, hi) in ranges.items():
        assert lo == 0 and hi == target.synced(s) - 1 <= target.n_past - 1
    sizes.append((target.n_past, target.seq_state_bytes(0)))
    sizes += [(hi + 1, target.seq_state_bytes(s)) for s, (lo, hi) in ranges.items()]
    (n0, b0) = sizes[0]
    others = [(n, b) for n, b in sizes if n != n0]
    if others:
        n1, b1 = others[0]
        per_cell = (b1 - b0) / (n1 - n0)
        for n, b in sizes:
            assert b == b0 + per_cell * (n - n0)


def check_greedy(lm, prompt, reply, finish, widths):
    """Every emitted token is the argmax of a one-batch re-score of the emitted sequence, except
    near ties. ``widths[i]`` is the width of the verify that produced reply[i]. Returns the
    near-tie mismatches as (from one-row verifies, from wider verifies)."""
    seq = prompt + reply
    argmax, gap = rescore(lm, seq)
    near = [0, 0]
    for i, tok in enumerate(reply):
        at = len(prompt) + i - 1  # the row that predicts reply[i]
        if argmax[at] != tok:
            assert gap[at] < NEAR_TIE, f"token {i}: emitted {tok}, target argmax {argmax[at]} (gap {gap[at]:.3f})"
            near[widths[i] > 1] += 1
    if finish == "stop" and not lm.is_eog(argmax[len(seq) - 1]):
        assert gap[len(seq) - 1] < NEAR_TIE, "stopped but the target's argmax is not an end token"
        near[widths[-1] > 1] += 1
    return near


def decode_checked(lm, target, prompt, arm, max_tokens, per_round=None, **kw):
    """Decode a reply with ``arm``, checking the target's KV cache and ``per_round(gen)`` after
    every round and every emitted token against a re-score at the end. Returns (gen, near ties
    from one-row verifies, from wider ones)."""
    gen = Generation(target, prompt, parse_arm(arm), max_tokens=max_tokens, **kw)
    sizes = []
    widths = []  # the width of the verify that produced each emitted token
    for emitted in gen:
        check_kv(target, sizes)
        if per_round is not None:
            per_round(gen)
        widths += [gen.last_width] * len(emitted)
    if gen.finish == "stop":
        widths.append(gen.last_width)
    return (gen, *check_greedy(lm, prompt, gen.tokens, gen.finish, widths))


READY = re.compile(r"listening on (http://\S+:\d+) \(")


class Server:
    """``adaspark serve`` in a subprocess on a free port; stderr collected by a thread."""

    def __init__(self, *args, timeout=120):
        self.proc = subprocess.Popen([sys.executable, "-m", "adaspark_cli.main", "serve", "--port", "0",
                                      *map(str, args)], stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self.url = None
        listening = threading.Event()

        def drain():  # a thread, so waiting for the banner is bounded even if it never comes
            for line in self.proc.stderr:
                self.err.append(line)
                if self.url is None and (m := READY.search(line)):
                    self.url = m.group(1)
                    listening.set()
            listening.set()

        self._drain = threading.Thread(target=drain, daemon=True)
        self._drain.start()
        try:
            assert listening.wait(timeout) and self.url, f"the server did not listen in time or ended: {self.stderr}"
            self.http = httpx.Client(base_url=self.url, timeout=300)
        except BaseException:  # no server left behind
            self.proc.kill()
            self.proc.wait(timeout=30)
            raise

    def post(self, path, body):
        return self.http.post(path, content=body if isinstance(body, bytes) else orjson.dumps(body))

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=self.url + "/v1", api_key="not-needed", max_retries=0, timeout=300)

    def stop(self, sig=signal.SIGTERM) -> int:
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=120)
        self._drain.join(timeout=10)
        return code

    @property
    def stderr(self) -> str:
        return "".join(self.err)


def chat_body(text, **kw):
    return {"messages": [{"role": "user", "content": text}], **kw}


def stream_events(lines):
    """The data of each server-sent event, as they come."""
    return (line[len("data: "):] for line in lines if line.startswith("data: "))
