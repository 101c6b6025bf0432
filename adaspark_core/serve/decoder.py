"""The decoding thread behind ``adaspark serve``'s HTTP app (http_app.py), and its bounded queue.

One decoding thread on the one model: it owns the Runtime (model, learners, store, log) and
nothing else touches it; it decodes one request at a time, or with ``--parallel N`` up to N
together, one batched step at a time (``Decoder``); requests wait in a queue of ``queue_size``,
and one that finds it full gets 503. Each request's events (text pieces, then the reply or an error)
cross to the event loop through an asyncio queue. A client that goes away (a closed stream, a
dropped connection) marks its job cancelled: a waiting job is skipped, a running one ends at the
next round, its learning kept. SIGINT/SIGTERM: running replies end after their current round
with finish_reason "interrupted", waiting ones get 503, the store is saved, and the process exits
128 + the signal's number.

A failure is the request's own: whatever raises while one request is admitted, stepped, closed or
logged ends that request with a 500 (an error event in its stream) and the thread goes on with
the others and the queue (decode/batch.py: a failure of a step's shared verify ends every request
it held). If the thread itself cannot go on, it answers every request it holds 500 and every
waiting or new one 503, ``/health`` says ``failed`` (503), and the server stops: the process
exits 1 instead of hanging.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import traceback
from dataclasses import dataclass, field
from typing import Callable

from adaspark_core.base.errors import InputError
from adaspark_core.decode.grammar import Grammar, LazyGrammar
from adaspark_core.decode.runtime import Runtime
from adaspark_core.serve import openai_api as api
from adaspark_core.serve.service import BatchServer, Reply, keep, serve_request
from adaspark_core.serve.tool_calls import ToolError, ToolReply, prepare
from adaspark_core.store.record import LogWriteError


@dataclass(eq=False)
class Job:
    """One request between the event loop and the decoding thread."""

    req: api.CompletionRequest
    name: str  # the response's id, and the request's name in the round log
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the client went away
    # How the reply's tool calls are read back (serve/tool_calls.py): set with the prompt, before
    # any event of the reply; None: the reply is text.
    tool_reply: ToolReply | None = None

    def emit(self, kind: str, value) -> None:
        """From the decoding thread: an event for the request's handler. After a forced exit
        (a second Ctrl-C) the event loop is gone: nobody is listening, so the job is dropped."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the loop is closed
            self.cancelled = True


class Decoder:
    """The decoding thread and its bounded queue. With several slots (``--parallel``) the thread
    decodes up to that many requests together, a step at a time, and takes the next waiting
    request into a slot as soon as one frees."""

    def __init__(self, rt: Runtime, queue_size: int, warn: Callable[[str], None],
                 error: Callable[[str, str], None] | None = None):
        self.rt = rt
        self.parallel = len(rt.slots)
        self.queue_size = queue_size
        self.warn = warn
        # error(line, traceback): the thread's own failure, which stops the server
        self.error = error or (lambda line, detail: warn(line))
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.pending = 0  # jobs queued or running
        self.served = 0
        self.stopping = False
        self.running: dict[str, Job] = {}  # the jobs in the thread's hands, by name (decoding thread only)
        self.failure: str | None = None  # why the thread stopped, once it has failed
        work = self._work if self.parallel == 1 else self._work_together
        self.thread = threading.Thread(target=self._run, args=(work,), name="adaspark-decoder", daemon=True)
        self.thread.start()

    def submit(self, job: Job) -> None:
        with self.lock:
            if self.failure is not None:
                raise self._failed()
            if self.stopping:
                raise api.APIError(503, "the server is shutting down", "server_error", code="shutting_down")
            if self.pending >= self.parallel + self.queue_size:
                raise api.APIError(503, f"the server is busy: {self.parallel} decoding and {self.queue_size} waiting; "
                                        "retry later", "server_error", code="queue_full")
            self.pending += 1
            # Queued under the lock: a thread that fails meanwhile finds the job and answers it.
            self.jobs.put(job)

    @property
    def queued(self) -> int:
        return max(0, self.pending - self.parallel)

    def health(self) -> tuple[int, dict]:
        """``/health`` but the model: (status code, body), 503 once the thread has failed."""
        body = {"status": "failed" if self.failure is not None else "shutting_down" if self.stopping else "ok",
                "busy": self.pending > 0, "queued": self.queued, "served": self.served}
        if self.failure is not None:
            body["error"] = self.failure
        return (503 if self.failure is not None else 200), body

    def stop(self) -> None:
        """Shutdown: the running reply ends after its round, waiting ones are refused."""
        with self.lock:
            self.stopping = True

    def close(self) -> None:
        """After the HTTP server stopped: end the thread, save the learned state, free the model.
        A thread that failed saves nothing more: its learners may have stopped inside a round, and
        the store keeps what the last reply saved."""
        self.stop()
        self.jobs.put(None)
        self.thread.join()
        try:
            if self.failure is None:
                keep(self.rt, 0, 0, self.warn)
        finally:
            self.rt.close()

    def _run(self, work) -> None:
        """The thread: ``work`` answers each request's failure itself; what escapes it means the
        thread cannot go on, and every request is answered so that none waits for ever."""
        try:
            work()
        except BaseException as e:
            with self.lock:
                self.failure = f"the decoding thread failed ({type(e).__name__}: {e})"
            self.error(f"{self.failure}; the server stops", traceback.format_exc())
            for job in list(self.running.values()):
                self._reply(job, api.APIError(500, f"internal error: {self.failure}", "server_error"))
            while True:
                try:
                    job = self.jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    self._reply(job, self._failed())

    def _failed(self) -> api.APIError:
        return api.APIError(503, f"{self.failure}; the server is stopping", "server_error", code="decoder_failed")

    def _work(self) -> None:
        while (job := self.jobs.get()) is not None:
            self.running[job.name] = job
            try:
                if self.stopping:
                    raise api.APIError(503, "the server is shutting down", "server_error", code="shutting_down")
                outcome = None if job.cancelled else self._decode(job)
            except api.APIError as e:
                outcome = e
            except Exception as e:  # the request fails, serving goes on
                outcome = _internal(e)
            self._reply(job, outcome)

    def _work_together(self) -> None:
        """Up to ``parallel`` requests decoded together (BatchServer): between steps, waiting jobs
        take the free slots (blocking only while nothing decodes); after each step, every request
        that ended or failed is answered and its slot is free."""
        server = BatchServer(self.rt, self.warn)
        closing = False
        while not closing or server.active:
            while not closing and not server.full:
                try:
                    job = self.jobs.get(block=not server.active)
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                else:
                    self._admit(server, job)
            if server.active:
                for name, outcome in server.step():
                    answer = outcome if isinstance(outcome, Reply) else _internal(outcome)
                    if name in self.running:  # else a clean-up's failure after its answer: stderr only
                        self._reply(self.running[name], answer)

    def _admit(self, server: BatchServer, job: Job) -> None:
        """Start ``job`` in a free slot, or answer it if it is not to be decoded."""
        self.running[job.name] = job
        try:
            if self.stopping:
                raise api.APIError(503, "the server is shutting down", "server_error", code="shutting_down")
            if job.cancelled:
                self._reply(job, None)
                return
            prompt, max_tokens, grammar = self._prompt(job)
            req = job.req
            server.admit(prompt, max_tokens, job.name, stops=req.stops, sampling=req.sampling,
                         on_text=(lambda text: job.emit("text", text)) if req.stream else None,
                         cancelled=lambda: job.cancelled or self.stopping, grammar=grammar)
        except InputError as e:
            self._reply(job, api.APIError(400, str(e)))
        except api.APIError as e:
            self._reply(job, e)
        except Exception as e:
            self._reply(job, _internal(e))

    def _reply(self, job: Job, outcome: Reply | api.APIError | None) -> None:
        """``job`` leaves the thread's hands, answered with ``outcome`` (None: its client left).
        Counted before it is answered, so /health is right by the time its client reads it."""
        self.running.pop(job.name, None)  # a queued one was never in it
        with self.lock:
            self.pending -= 1
            if isinstance(outcome, Reply):
                self.served += 1
        if outcome is not None:
            job.emit("done" if isinstance(outcome, Reply) else "error", outcome)

    def _prompt(self, job: Job) -> tuple[list[int], int, Grammar | LazyGrammar | None]:
        """The request's prompt tokens, token budget and reply grammar (``response_format``), or
        the APIError that refuses it."""
        rt, req = self.rt, job.req
        schema, param, opens = req.json_schema, "response_format", None
        if req.chat:
            try:
                plan = prepare(req.tools, rt.model, req.parallel_tool_calls)
            except ToolError as e:
                raise api.bad(e.param, str(e)) from None
            job.tool_reply = plan.reply
            if plan.call_schema is not None:  # a required call's grammar, or (auto) its calls' lazy one
                schema, param, opens = plan.call_schema, "tools", plan.opens
            prompt = rt.chat(req.messages, plan.tools, plan.reply_start)
        else:
            prompt = list(req.prompt) if isinstance(req.prompt, list) else rt.tokens(req.prompt)
        n_ctx = rt.target.n_ctx
        if len(prompt) >= n_ctx:
            raise api.APIError(400, f"the prompt has {len(prompt)} tokens; the context holds {n_ctx} "
                                    "(start the server with a larger --n-ctx)",
                               param="messages" if req.chat else "prompt", code="context_length_exceeded")
        if not req.chat and isinstance(req.prompt, list) and max(prompt) >= rt.target.n_vocab:
            raise api.bad("prompt", f"token id {max(prompt)} is outside the vocabulary ({rt.target.n_vocab})")
        grammar = None
        if schema is not None:
            try:
                grammar = rt.json_grammar(schema) if opens is None else rt.lazy_grammar(opens, schema)
            except InputError as e:
                raise api.bad(param, str(e)) from None
        return prompt, req.max_tokens or n_ctx, grammar

    def _decode(self, job: Job) -> Reply:
        rt, req = self.rt, job.req
        try:
            prompt, max_tokens, grammar = self._prompt(job)
            return serve_request(
                rt, prompt, max_tokens, name=job.name, stops=req.stops,
                sampling=req.sampling, grammar=grammar,
                # a whole response needs no pieces: waking the event loop every round costs the decode
                on_text=(lambda text: job.emit("text", text)) if req.stream else None,
                cancelled=lambda: job.cancelled or self.stopping, on_warning=self.warn)
        except InputError as e:
            raise api.APIError(400, str(e)) from None


def _internal(e: Exception) -> api.APIError:
    """The 500 of a request that failed on ``e``: a round log that could not be written (a full
    disk) is said as such; anything else is a bug, its traceback on stderr."""
    if isinstance(e, LogWriteError):
        return api.APIError(500, f"{e}; the reply was cut short", "server_error")
    traceback.print_exception(type(e), e, e.__traceback__)
    return api.APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
