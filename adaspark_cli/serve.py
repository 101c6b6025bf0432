"""``adaspark serve-stdin``: JSON lines in, JSON lines out, one request at a time, learning while
it serves (request format: adaspark_core/serving.py).

Responses, one JSON object per line on stdout:

    {"id": ..., "delta": "text"}                                  (streamed requests, per round)
    {"id": ..., "done": true, "text": "...", "finish": "stop"|"length"|"context"|"interrupted",
     "stats": {"generated_tokens", "decode_tok_s", "tokens_per_round", "widths", ...}}
    {"id": ... or null, "error": "what was wrong"}                 (the server goes on serving)

The learners persist across requests, and the store is saved atomically after every request and
on exit. EOF ends the server (exit 0). SIGINT or SIGTERM between requests ends it at once; during
a request, after the current round: the reply ends with finish "interrupted", and the server
saves and exits (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Optional

import orjson
import typer

from adaspark_core.errors import InputError, OutputError


class Shutdown(Exception):
    """A signal arrived while the server was idle."""


class _Signals:
    """SIGINT and SIGTERM: raise Shutdown when idle (a blocked read must end); when busy, only
    note the signal, so a round and a store write are never cut in half."""

    def __init__(self):
        self.got: int | None = None
        self.busy = False

    def __call__(self, signum, frame):
        self.got = signum
        if not self.busy:
            raise Shutdown

    def install(self) -> None:
        signal.signal(signal.SIGINT, self)
        signal.signal(signal.SIGTERM, self)


def _emit(obj: dict) -> None:
    sys.stdout.write(orjson.dumps(obj).decode() + "\n")
    sys.stdout.flush()


def serve_stdin(
    model: Optional[Path] = typer.Option(None, "--model", "-m", help="GGUF model file (default: SmolLM2-135M-Instruct, Q4_0)."),
    arm: str = typer.Option("adaspark", "--arm", help="adaspark, cost, pinned:N, tree:N, chain:N or ar."),
    drafter: str = typer.Option("none", "--drafter", help="none, dspark:FILE or model:FILE (as for decode)."),
    block: Optional[int] = typer.Option(None, "--block", min=1, help="Positions a model drafter proposes per round (B)."),
    top_k: int = typer.Option(8, "--top-k", min=1, help="Candidates a model drafter keeps per position (K)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-n", min=1, help="A request's reply cap when it sets none."),
    store: Optional[Path] = typer.Option(None, "--store", help="Learned state (default: one per model, drafter and machine, in the cache)."),
    log: Optional[Path] = typer.Option(None, "--log", help="Append one JSON line per round to this file."),
    n_ctx: Optional[int] = typer.Option(None, "--n-ctx", min=16, help="Context size (default: the model's, at most 8192)."),
    threads: Optional[int] = typer.Option(None, "--threads", min=1, help="CPU threads (default: all)."),
) -> None:
    """Serve requests read as JSON lines on stdin, one at a time, answering in JSON lines on
    stdout. A request: {"id", "prompt" (raw text) or "messages" (chat), "max_tokens", "stream"}."""
    from adaspark_cli.main import fail, load_engine, open_learned, reported, save_learned
    from adaspark_core.record import RoundLog
    from adaspark_core.scheduler import parse_arm

    if sys.stdin is None:
        fail("stdin is closed: serve-stdin reads its requests there")
    with reported():
        the_arm = parse_arm(arm)
        lm, target, the_drafter = load_engine(model, n_ctx, threads, drafter, block, top_k)
        learned = open_learned(store, lm.path, the_drafter) if the_arm.learns else None
        round_log = RoundLog(log) if log else None
    server = Server(lm, target, the_drafter, the_arm, learned, round_log, max_tokens, save_learned)
    signals = _Signals()
    signals.install()
    code = 0
    try:
        server.run(signals)
    except Shutdown:
        pass
    except BrokenPipeError:  # the reader went away: save and end quietly
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    finally:
        signals.busy = True
        server.close()
        if signals.got is not None:
            code = 128 + signals.got
    raise typer.Exit(code)


class Server:
    def __init__(self, lm, target, drafter, arm, learned, round_log, max_tokens: int, save):
        self.lm, self.target, self.drafter, self.arm = lm, target, drafter, arm
        self.learned = learned
        self.learners = learned[1] if learned else None
        self.log = round_log
        self.max_tokens = max_tokens
        self._save = save
        self.served = 0

    def run(self, signals: _Signals) -> None:
        from adaspark_core.serving import RequestError, parse_request

        typer.echo(f"adaspark serve-stdin: ready ({self.lm.path.name}, arm {self.arm.name}"
                   f"{', store ' + str(self.learned[0].path) if self.learned else ''})", err=True)
        number = 0
        for line in sys.stdin.buffer:
            if not line.strip():
                continue
            number += 1
            signals.busy = True
            try:
                req = parse_request(line, self.max_tokens, number)
                self.serve(req, stop=lambda: signals.got is not None)
            except RequestError as e:
                _emit({"id": e.id, "error": str(e)})
            finally:
                signals.busy = False
            if signals.got is not None:
                raise Shutdown

    def serve(self, req, stop) -> None:
        from adaspark_cli.main import stream
        from adaspark_core.record import LogWriteError
        from adaspark_core.scheduler import Generation
        from adaspark_core.serving import RequestError

        try:
            prompt = self.lm.tokenize(req.prompt) if req.prompt is not None else self.lm.chat_prompt(req.messages)
            gen = Generation(self.target, prompt, self.arm, req.max_tokens, request_id=req.name, log=self.log,
                             learners=self.learners, drafter=self.drafter)
        except InputError as e:
            raise RequestError(str(e), req.id) from None
        on_text = (lambda text: _emit({"id": req.id, "delta": text})) if req.stream else None
        try:
            text = stream(gen, self.lm.piece, on_text=on_text, stop=stop)
        except LogWriteError as e:
            # The round log could not take a round (a full disk): the request ends with an
            # error, what the learners took from its rounds is saved, and the next request
            # tries the log again.
            raise RequestError(f"{e}; the reply was cut after {gen.stats.generated} tokens", req.id) from None
        finally:
            if gen.stats.rounds:
                self._keep(gen.stats.rounds)
        st = gen.stats
        self.served += 1
        stats = st.to_json()
        _emit({"id": req.id, "done": True, "text": text, "finish": gen.finish or "interrupted",
               "prompt_tokens": len(prompt), "stats": stats})

    def _keep(self, rounds: int, requests: int = 1) -> None:
        """Save the learned state; a store that cannot be written (a full disk) is said on
        stderr and the server goes on, the learning kept in memory for the next save."""
        if not self.learned:
            return
        try:
            self._save(self.learned, rounds, requests=requests)
        except OutputError as e:
            typer.echo(f"adaspark: warning: {e}", err=True)

    def close(self) -> None:
        """Save the learned state (a request's is saved when it ends; this covers a run with none)
        and close the log."""
        self._keep(0, requests=0)
        if self.log:
            self.log.close()
