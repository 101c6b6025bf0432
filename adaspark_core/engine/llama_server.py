"""llama.cpp's own ``llama-server`` as a process: the binary, its command line, starting it, waiting
for ``/health``, stopping it. The peer arms of ``adaspark compare`` (evaluate/peer.py) and the load
benchmarks run it; here because only the engine runs a model.

The server is built by ``make peer`` from the llama.cpp that the llama-cpp-python sdist vendors,
the same commit our engine runs, into ``build/peer/bin/llama-server``; ``ADASPARK_LLAMA_SERVER``
names another binary."""

from __future__ import annotations

import atexit
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from adaspark_core.base.errors import InputError

ENV_BINARY = "ADASPARK_LLAMA_SERVER"
DEFAULT_BINARY = Path(__file__).resolve().parents[2] / "build" / "peer" / "bin" / "llama-server"
HOST = "127.0.0.1"
HEALTH_TIMEOUT_S = 300.0


def server_binary(path: str | os.PathLike | None = None) -> Path:
    """The llama-server binary: ``path``, else $ADASPARK_LLAMA_SERVER, else what ``make peer`` builds."""
    p = Path(path or os.environ.get(ENV_BINARY) or DEFAULT_BINARY)
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise InputError(f"no llama-server binary at {p}: run `make peer` (or set {ENV_BINARY})")
    return p


def draft_args(draft_path, threads: int) -> list[str]:
    """The draft model's flags: its file, the target's threads (generation and batch) and the CPU
    (``-ngld 0``). This version has no draft context-size flag: the server sizes the draft context
    as the target's (``common/speculative.cpp``)."""
    return ["-md", str(draft_path), "-td", str(threads), "-tbd", str(threads), "-ngld", "0"]


def server_command(binary: Path, model_path, n_ctx: int, threads: int, port: int, spec_args: list[str],
                   draft_path=None) -> list[str]:
    """One slot on ``HOST:port`` decoding as our engine does: no web UI, flash attention off, no
    prompt cache (every reply prefills, as ours do), greedy unless a request says otherwise; then
    the draft model's flags (``draft_path``) and the speculation flags ``spec_args``."""
    return [str(binary), "-m", str(model_path), "-c", str(n_ctx), "-t", str(threads), "-tb", str(threads),
            "-np", "1", "--host", HOST, "--port", str(port), "--no-ui",
            "-fa", "off",  # as our engine (FLASH_ATTN_NOTE in engine/bindings.py); the draft's context too
            "--cache-ram", "0", "--no-cache-prompt",
            "--temp", "0", "--top-k", "1", "--seed", "0",
            *(draft_args(draft_path, threads) if draft_path is not None else []),
            *spec_args]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child
    # Linux: the server gets SIGTERM if this process dies without closing it (a SIGKILL, a crash).
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:
        pass


class LlamaServer:
    """One llama-server process; stderr and stdout go to a log file in a temp dir."""

    def __init__(self, cmd: list[str], port: int, name: str):
        self.cmd, self.port, self.name = cmd, port, name
        self.dir = Path(tempfile.mkdtemp(prefix="adaspark-peer-"))
        self.log_path = self.dir / "llama-server.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = HEALTH_TIMEOUT_S, poll_s: float = 0.1) -> None:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                         preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise InputError(f"llama-server for {self.name} exited ({self.proc.returncode}) while starting: "
                                 f"{self.log_tail()}")
            if self.healthy():
                return
            if time.monotonic() > deadline:
                self.stop()
                raise InputError(f"llama-server for {self.name} was not ready after {timeout:.0f} s: {self.log_tail()}")
            time.sleep(poll_s)

    def healthy(self) -> bool:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200  # 503 while the model loads
        except OSError:
            return False
        finally:
            conn.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 3) -> str:
        """The last ``n`` non-empty log lines, as one line."""
        try:
            lines = [ln.strip() for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no log)"
        return " | ".join(lines[-n:]) or "(empty log)"

    def stop(self) -> None:
        """Terminate, then kill; remove the log dir. Safe to call twice."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        atexit.unregister(self.stop)
        shutil.rmtree(self.dir, ignore_errors=True)
