"""The HTTP side of ``adaspark serve`` (the ``adaspark[server]`` extra): a FastAPI app on uvicorn
in front of one decoding thread. It prints nothing itself: what the operator should read goes to
the caller's ``warn``, ``error`` and ``announce`` (the CLI writes them to stderr).

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

What one client may take is bounded (``Limits``): a request body is refused with 413 past
``--max-body-mb``, read incrementally, never whole before it is measured; a connection must send
its request's headers within ``--header-timeout`` of opening (or of its previous response); at
``--max-connections`` open connections a new one takes the place of the one that has waited
longest without a request in progress (idle, or its headers incomplete; one that was never
answered goes before a kept-alive one that was), and only when every
open one has a request in progress is it answered 503 and closed at once. uvicorn has neither of
the last two (its keep-alive timer starts only after a response; its ``limit_concurrency`` acts
only once a request's headers are in), so ``_Protocol`` adds them, and a lingering close for a
connection closed while its client is still sending a body (``_LingeringClose``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import h11
import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import fcntl
    import termios
except ImportError:  # not a Unix: a request not yet read is not told from none (_unread)
    fcntl = termios = None

from adaspark_core.base.errors import InputError
from adaspark_core.decode.runtime import Runtime
from adaspark_core.serve import openai_api as api
from adaspark_core.serve.service import BatchServer, Reply, keep, serve_request
from adaspark_core.store.record import LogWriteError

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this (uvicorn's and llama-server's default)
MAX_HEADERS = 16 * 1024  # a request line and headers past this get 400 (h11's default, said here as a limit)
BACKLOG = 128  # connections the kernel holds until accepted; also the most asyncio accepts at once
FULL_WARNING_S = 60  # at most one warning a minute about connections refused at the cap
# The order in which connections began to wait for a request's headers: the oldest is shed first
# at the cap. A count, not the loop's clock: connections accepted in one loop iteration tie on it.
_IDLE_ORDER = itertools.count()
# After a refused body's reply, the rest of the body is read and dropped for at most this long and
# this much (nginx lingers up to 30 s; by either bound the reply has long reached the client)
LINGER_S = 2.0
LINGER_BYTES = 8 * 2 ** 20


@dataclass(frozen=True)
class Limits:
    """What one client may take of the server: ``adaspark serve``'s --max-body-mb,
    --max-connections and --header-timeout."""

    max_body: int  # bytes of one request's body
    max_connections: int
    header_timeout: float  # seconds


@dataclass(eq=False)
class Job:
    """One request between the event loop and the decoding thread."""

    req: api.CompletionRequest
    name: str  # the response's id, and the request's name in the round log
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the client went away

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
            prompt, max_tokens = self._prompt(job)
            req = job.req
            server.admit(prompt, max_tokens, job.name, stops=req.stops, sampling=req.sampling,
                         on_text=(lambda text: job.emit("text", text)) if req.stream else None,
                         cancelled=lambda: job.cancelled or self.stopping)
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

    def _prompt(self, job: Job) -> tuple[list[int], int]:
        """The request's prompt tokens and token budget, or the APIError that refuses it."""
        rt, req = self.rt, job.req
        if req.chat:
            prompt = rt.chat(req.messages)
        else:
            prompt = list(req.prompt) if isinstance(req.prompt, list) else rt.tokens(req.prompt)
        n_ctx = rt.target.n_ctx
        if len(prompt) >= n_ctx:
            raise api.APIError(400, f"the prompt has {len(prompt)} tokens; the context holds {n_ctx} "
                                    "(start the server with a larger --n-ctx)",
                               param="messages" if req.chat else "prompt", code="context_length_exceeded")
        if not req.chat and isinstance(req.prompt, list) and max(prompt) >= rt.target.n_vocab:
            raise api.bad("prompt", f"token id {max(prompt)} is outside the vocabulary ({rt.target.n_vocab})")
        return prompt, req.max_tokens or n_ctx

    def _decode(self, job: Job) -> Reply:
        rt, req = self.rt, job.req
        try:
            prompt, max_tokens = self._prompt(job)
            return serve_request(
                rt, prompt, max_tokens, name=job.name, stops=req.stops,
                sampling=req.sampling,
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


def _json(obj, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


def _error(e: api.APIError) -> Response:
    response = _json(e.body(), e.status)
    if e.status == 413:
        # The rest of the body is not read: the connection closes after the reply, or the
        # client's next request would be looked for in the middle of this one's body.
        response.headers["connection"] = "close"
    return response


def _mb(n: int) -> str:
    return f"{n / 2 ** 20:g} MB"


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or 413 once it is over ``limit`` bytes: at once by its Content-Length
    (nothing of it read), else (a chunked one) as soon as what came passes the limit. Read in the
    server's pieces, so a refused body never sits whole in memory."""
    too_large = api.APIError(413, f"the request body is over the server's limit of {_mb(limit)} "
                                  "(start the server with a larger --max-body-mb)", code="request_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and int(declared) > limit:  # h11 answered 400 to one that is not a number
        raise too_large
    parts, size = [], 0
    async for part in request.stream():
        size += len(part)
        if size > limit:
            raise too_large
        parts.append(part)
    return b"".join(parts)


def make_app(decoder: Decoder, model_id: str, default_temperature: float, max_body: int) -> FastAPI:
    app = FastAPI(title="adaspark", docs_url=None, redoc_url=None, openapi_url=None)
    # sse-starlette would cut every stream the moment shutdown begins; ours end by themselves,
    # after the current round, with finish_reason "interrupted" (Decoder.stop).
    AppStatus.disable_automatic_graceful_drain()
    started = int(time.time())

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        what = "route" if exc.status_code == 404 else "method" if exc.status_code == 405 else "request"
        return _error(api.APIError(exc.status_code, f"no such {what}: {request.method} {request.url.path}",
                                   code="not_found" if exc.status_code == 404 else None))

    @app.get("/health")
    async def health() -> Response:
        status, body = decoder.health()
        return _json({**body, "model": model_id}, status)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json({"object": "list", "data": [{"id": model_id, "object": "model", "created": started,
                                                  "owned_by": "adaspark"}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    async def _complete(request: Request, chat: bool) -> Response:
        env = api.Envelope.new(model_id, chat)
        try:
            req = api.parse(await read_body(request, max_body), chat, default_temperature)
            job = Job(req, env.id, asyncio.get_running_loop())
            decoder.submit(job)
        except api.APIError as e:
            return _error(e)
        if req.stream:
            # The status is known when the first event comes: an error before any text is a
            # plain error response, not a stream.
            kind, value = await _next(job, request)
            if kind == "error":
                return _error(value)
            return EventSourceResponse(_stream(job, env, kind, value), ping=15)
        while True:  # not streamed: no text pieces come, the reply comes whole with "done"
            kind, value = await _next(job, request)
            if kind == "error":
                return _error(value)
            if kind == "done":
                return _json(env.response(value))

    async def _next(job: Job, request: Request):
        """The job's next event; a client that leaves meanwhile cancels the job (it ends at the
        next round) and the wait ends with a 499-style error nobody reads."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancelled = True
                    return "error", api.APIError(499, "the client closed the request")

    async def _stream(job: Job, env: api.Envelope, kind: str, value):
        first = True
        held = None  # an event taken while joining texts, not yet handled
        try:
            while True:
                if kind == "text":
                    # The text of every round that ended while the loop was busy, in one chunk:
                    # a slow reader costs fewer writes, and the decoding thread less time.
                    while held is None and not job.events.empty():
                        held = job.events.get_nowait()
                        if held[0] == "text":
                            value, held = value + held[1], None
                    yield orjson.dumps(env.chunk(value, first)).decode()
                    first = False
                elif kind == "done":
                    if first:
                        yield orjson.dumps(env.chunk("", True)).decode()
                    yield orjson.dumps(env.last_chunk(value)).decode()
                    if job.req.include_usage:
                        yield orjson.dumps(env.usage_chunk(value)).decode()
                    yield "[DONE]"
                    return
                else:  # an error after the stream began: said in the stream, as OpenAI does
                    yield orjson.dumps(value.body()).decode()
                    return
                (kind, value), held = (held, None) if held is not None else (await job.events.get(), None)
        finally:
            job.cancelled = True  # a client gone mid-stream: the decode ends at the next round

    return app


class _Server(uvicorn.Server):
    """uvicorn, with shutdown that lets the running reply end after its round. uvicorn's own
    handler would re-raise the signal after serving (killing the process before the store is
    saved); this one only records it. It also stops once the decoding thread has failed: a
    server that can answer nothing but 503 is better restarted than kept."""

    def __init__(self, config: uvicorn.Config, decoder: Decoder):
        super().__init__(config)
        self.decoder = decoder
        self.signal: int | None = None

    @property
    def exit_code(self) -> int:
        """1 if the decoding thread failed, else 128 + the signal that stopped it (0: none)."""
        if self.decoder.failure is not None:
            return 1
        return 128 + self.signal if self.signal is not None else 0

    async def on_tick(self, counter: int) -> bool:
        # uvicorn's main loop asks this every 0.1 s whether to stop; the decoding thread knows
        # nothing of the server it serves.
        if self.decoder.failure is not None:
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame) -> None:
        if self.signal is not None and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C: stop waiting for open connections
        self.signal = sig
        self.decoder.stop()
        self.should_exit = True


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the two guards uvicorn lacks against slow clients.

    A deadline for a request's headers, from the connection's opening and again from each
    response on a kept-alive one: a connection that sends nothing, or trickles its request line
    and headers, is closed when it passes, instead of holding its descriptor for ever (uvicorn's
    keep-alive timer starts only after a response, and any byte stops it). The body is not under
    this deadline: it is bounded by --max-body-mb, and a request in progress counts against the
    cap below.

    A cap on open connections, checked as each is accepted. At the cap, the open connection that
    has waited longest without a request in progress (h11's IDLE: nothing sent since it opened or
    since its last response, or headers not yet complete) is closed quietly to make room, as an
    idle keep-alive connection past its timeout is: a loop of idle sockets cannot keep a client
    with a request out, and costs each of its sockets its place as soon as another comes. A
    connection that was never answered goes first: a kept-alive client that has been answered is
    between two requests for a moment only, and cut in that moment it would lose its next request
    to a reset (a burst of accepts can pass the whole cap in one loop iteration). Only
    when every open connection has a request in progress (or is being answered, or has sent bytes
    the loop has not read yet: a whole request may be in them) is the new one answered 503 and
    closed at once, before anything of it is read. Either way descriptors stay
    bounded and asyncio's accept never meets "Too many open files" (uvicorn's
    ``limit_concurrency`` answers 503 only once a request's headers are in, so connections that
    never finish them are not refused).

    Built on H11Protocol's long-standing internals (``connections``, ``conn``, ``transport``,
    ``loop``, ``on_response_complete``); checked on uvicorn 0.55."""

    def __init__(self, *args, limits: Limits, refused: "_Refused", **kwargs):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self.refused = refused
        self.header_deadline: asyncio.TimerHandle | None = None
        self.idle_since = 0  # when it last began to wait for a request's headers (``_IDLE_ORDER``)
        self.answered = False  # a response of it was complete: a kept-alive client, shed last
        self.lingering = False
        self.dropped = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections and not self._shed_one():
            # Not added to ``connections``: it never counts against the cap, nor gets a request.
            self.transport = transport  # for connection_lost
            transport.write(self.refused.reply)
            transport.close()
            self.refused.count(len(self.connections))
            return
        super().connection_made(_LingeringClose(transport, self))
        self._await_headers()

    def _shed_one(self) -> bool:
        """Close the connection that has waited longest for a request's headers, to make room for
        a new one, one never answered before a kept-alive one; False if every open connection has a request in progress. A request the loop
        has not read yet is in progress too: its client sent it (it may have come in the same
        loop iteration as the new connection), and cutting it would lose it unanswered."""
        idle = sorted((c for c in self.connections if c.conn.their_state is h11.IDLE and not c.transport.is_closing()),
                      key=lambda c: (c.answered, c.idle_since))
        oldest = next((c for c in idle if not _unread(c.transport)), None)
        if oldest is None:
            return False
        oldest.transport.close()
        # Out of the count at once: its socket closes when the loop next runs (connection_lost).
        self.connections.discard(oldest)
        return True

    def data_received(self, data: bytes) -> None:
        if self.lingering:  # the rest of a body the reply refused: read and dropped
            self.dropped += len(data)
            if self.dropped > LINGER_BYTES:
                self.transport.close()
            return
        super().data_received(data)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.answered = True
        if not self.transport.is_closing():
            self._await_headers()  # the next request's headers, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
        self.idle_since = next(_IDLE_ORDER)
        self.header_deadline = self.loop.call_later(self.limits.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        # h11's view of the client: IDLE until a request's headers are complete (then SEND_BODY,
        # DONE); a request in progress, or one answered meanwhile, is not cut.
        self.header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()  # quietly, as uvicorn's keep-alive timeout does


def _unread(transport: asyncio.Transport) -> int:
    """Bytes a connection's client sent that the loop has not read yet (FIONREAD; 0 where the
    system has no such call)."""
    if fcntl is None:
        return 0
    try:
        n = fcntl.ioctl(transport.get_extra_info("socket").fileno(), termios.FIONREAD, bytes(4))
    except (OSError, ValueError):  # closed meanwhile
        return 0
    return int.from_bytes(n, sys.byteorder)


class _LingeringClose:
    """A connection's transport whose close, while the client is still sending its request's body
    (a 413 refused it, or h11 found it malformed), is a lingering close, as nginx and Apache do:
    the reply is flushed and followed by a FIN, the rest of the body is read and dropped, and the
    socket is closed when the client closes its side, or past LINGER_S or LINGER_BYTES. Closed at
    once with unread bytes in its receive buffer, the socket would answer them with a reset, which
    can cut the reply off before it is sent or read: the client would see its request cut off
    instead of the 413 that says why. Any other close, and a second close (the server shutting
    down), is immediate."""

    def __init__(self, transport: asyncio.Transport, protocol: _Protocol):
        self._transport = transport
        self._protocol = protocol

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._protocol.lingering or self._transport.is_closing()

    def close(self) -> None:
        p = self._protocol
        if p.lingering or p.conn.their_state not in (h11.SEND_BODY, h11.ERROR) or not self._transport.can_write_eof():
            self._transport.close()
            return
        p.lingering = True
        self._transport.write_eof()  # after the reply's bytes
        self._transport.resume_reading()  # uvicorn may have paused it while the body was coming
        p.loop.call_later(LINGER_S, self._transport.close)  # a client that never stops sending


class _Refused:
    """The reply to a connection refused at the cap (every open one has a request in progress), and
    the warning about them: at the first, then at most once a minute with how many were refused
    meanwhile (a flood must not flood stderr)."""

    def __init__(self, max_connections: int, warn):
        self.warn = warn
        err = api.APIError(503, f"the server has {max_connections} connections open, its --max-connections, each "
                                "with a request in progress; retry later", "server_error", code="too_many_connections")
        body = orjson.dumps(err.body())
        self.reply = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                      b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.n = 0
        self.warned: float | None = None

    def count(self, open_now: int) -> None:
        self.n += 1
        now = time.monotonic()
        if self.warned is None:
            self.warn(f"refusing connections: {open_now} are open, the --max-connections cap, each with a request "
                      "in progress; refusals are counted here once a minute")
        elif now - self.warned >= FULL_WARNING_S:
            self.warn(f"{self.n} connections refused in {now - self.warned:.0f} s at the --max-connections cap")
        else:
            return
        self.n, self.warned = 0, now


def url(host: str, port: int) -> str:
    """http://HOST:PORT, an IPv6 address in brackets (RFC 3986)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def listen(host: str, port: int, max_connections: int) -> socket.socket:
    """The server's socket, bound and listening (port 0: a free one); InputError if it cannot be.
    Opened before the model loads, so a port in use is found at once; a client that connects
    while the model loads waits in the backlog. First the process is let open the descriptors its
    connections may take, or refused if the system does not allow that many."""
    _allow_open_files(max_connections)
    try:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=BACKLOG)
    except OSError as e:
        raise InputError(f"cannot listen on {url(host, port)[len('http://'):]}: {e.strerror or e}") from None


def _allow_open_files(max_connections: int) -> None:
    """Raise the soft limit of open files to what the connections may need: the cap; those being
    refused (asyncio accepts up to BACKLOG a loop iteration, and a refused one is closed three
    iterations later: its task, connection_made, connection_lost); and the process's own (the
    model, the store, the log, the loop's)."""
    try:
        import resource
    except ImportError:  # not a Unix: no such limit to raise
        return
    need = max_connections + 4 * BACKLOG + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise InputError(f"--max-connections {max_connections} needs about {need} open files; this system "
                         f"allows {hard} (ulimit -Hn): lower it")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def make_server(rt: Runtime, queue_size: int, default_temperature: float, limits: Limits, warn,
                error=None) -> _Server:
    """The server ``run`` runs, its decoding thread started (``server.decoder``): the app on uvicorn
    with our protocol."""
    decoder = Decoder(rt, queue_size, warn, error)
    app = make_app(decoder, rt.model.path.name, default_temperature, limits.max_body)
    # uvicorn's limit_concurrency is left unset: it counts the same connections as our cap, so
    # at the cap it would answer 503 (in plain text) to the clients already admitted; requests
    # past what can wait for the decoder get the queue's OpenAI-shaped 503 instead.
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=None, timeout_keep_alive=KEEP_ALIVE_S, backlog=BACKLOG,
                            h11_max_incomplete_event_size=MAX_HEADERS,
                            http=functools.partial(_Protocol, limits=limits,
                                                   refused=_Refused(limits.max_connections, warn)))
    return _Server(config, decoder)


def run(rt: Runtime, sock: socket.socket, queue_size: int, default_temperature: float, limits: Limits,
        warn: Callable[[str], None], error: Callable[[str, str], None], announce: Callable[[str], None]) -> int:
    """Serve on ``sock`` until a signal (or the decoding thread's failure); returns the exit code
    (``_Server.exit_code``). The runtime is closed (its learning saved) on the way out.
    ``announce`` gets the line that says where the server listens, once it does."""
    server = make_server(rt, queue_size, default_temperature, limits, warn, error)
    decoder = server.decoder
    host, port = sock.getsockname()[:2]
    together = "one decode at a time" if decoder.parallel == 1 else f"{decoder.parallel} requests decoded together"
    announce(f"listening on {url(host, port)} ({rt.model.path.name}, arm {rt.arm.name}"
             f"{', store ' + str(rt.store.path) if rt.store else ''}; {together}, {queue_size} may wait; "
             f"at most {limits.max_connections} connections, bodies up to {_mb(limits.max_body)})")
    try:
        server.run(sockets=[sock])
    finally:
        decoder.close()
    return server.exit_code
