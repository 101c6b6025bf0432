"""The HTTP side of ``adaspark serve`` (the ``adaspark[server]`` extra): a FastAPI app on uvicorn
in front of one decoding thread (``Decoder``, decoder.py). It prints nothing itself: what the operator
should read goes to the caller's ``warn``, ``error`` and ``announce`` (the CLI writes them to stderr).

The routes are OpenAI's completion API (openai_api.py): POST /v1/chat/completions and
/v1/completions, streamed or not, GET /v1/models and /health; an HTTP error of the framework (no
such route) is answered in OpenAI's shape too. SIGINT/SIGTERM: running replies end after their
current round with finish_reason "interrupted", waiting ones get 503, the store is saved, and the
process exits 128 + the signal's number; a decoding thread that fails stops the server, which exits
1 (``_Server``). What one client may take is bounded (``Limits``, http_limits.py).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import time
from dataclasses import dataclass
from typing import Callable

import orjson
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from sse_starlette.sse import AppStatus, EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from adaspark_core.base.errors import InputError
from adaspark_core.decode.runtime import Runtime
from adaspark_core.serve import openai_api as api
from adaspark_core.serve.decoder import Decoder, Job
from adaspark_core.serve.http_limits import Limits, http_protocol

DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there
KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this (uvicorn's and llama-server's default)
MAX_HEADERS = 16 * 1024  # a request line and headers past this get 400 (h11's default, said here as a limit)
BACKLOG = 128  # connections the kernel holds until accepted; also the most asyncio accepts at once


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
    """The app in front of ``decoder``: its routes (``_Routes``) and OpenAI-shaped HTTP errors."""
    app = FastAPI(title="adaspark", docs_url=None, redoc_url=None, openapi_url=None)
    # sse-starlette would cut every stream the moment shutdown begins; ours end by themselves,
    # after the current round, with finish_reason "interrupted" (Decoder.stop).
    AppStatus.disable_automatic_graceful_drain()
    app.add_exception_handler(StarletteHTTPException, _http_error)
    routes = _Routes(decoder, model_id, default_temperature, max_body, started=int(time.time()))
    app.get("/health")(routes.health)
    app.get("/v1/models")(routes.models)
    app.post("/v1/chat/completions")(routes.chat)
    app.post("/v1/completions")(routes.completions)
    return app


@dataclass
class _Routes:
    """The app's endpoints, in front of one decoding thread: the model they serve (``model_id``,
    listed as made at ``started``, Unix seconds) and how a completion request is read (the
    server's ``default_temperature``, a body of at most ``max_body`` bytes)."""

    decoder: Decoder
    model_id: str
    default_temperature: float
    max_body: int
    started: int

    async def health(self) -> Response:
        status, body = self.decoder.health()
        return _json({**body, "model": self.model_id}, status)

    async def models(self) -> Response:
        return _json({"object": "list", "data": [{"id": self.model_id, "object": "model", "created": self.started,
                                                  "owned_by": "adaspark"}]})

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, chat=True)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, chat=False)

    async def _complete(self, request: Request, chat: bool) -> Response:
        """A completion request: read, queued for the decoding thread, answered whole or streamed."""
        env = api.Envelope.new(self.model_id, chat)
        try:
            req = api.parse(await read_body(request, self.max_body), chat, self.default_temperature)
            job = Job(req, env.id, asyncio.get_running_loop())
            self.decoder.submit(job)
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
                if job.tool_reply is None:
                    return _json(env.response(value))
                content, calls = job.tool_reply.split(value.text)
                return _json(env.response(value, calls, content))


async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Every HTTP error of the framework (no such route or method, a malformed request) in OpenAI's shape."""
    what = "route" if exc.status_code == 404 else "method" if exc.status_code == 405 else "request"
    return _error(api.APIError(exc.status_code, f"no such {what}: {request.method} {request.url.path}",
                               code="not_found" if exc.status_code == 404 else None))


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
    """A streamed reply's events, from its first (``kind``, ``value``) on: its text in chunks, then
    the last chunk (with usage if asked) and [DONE], or an error said in the stream."""
    first = True
    held = None  # an event taken while joining texts, not yet handled
    # A reply that may call tools lets out only the text before a call (ToolStream); the calls
    # go out whole once the reply has ended.
    tools = job.tool_reply.stream() if job.tool_reply is not None else None
    try:
        while True:
            if kind == "text":
                # The text of every round that ended while the loop was busy, in one chunk:
                # a slow reader costs fewer writes, and the decoding thread less time.
                while held is None and not job.events.empty():
                    held = job.events.get_nowait()
                    if held[0] == "text":
                        value, held = value + held[1], None
                if tools is not None:
                    value = tools.feed(value)
                if value:
                    yield orjson.dumps(env.chunk(value, first)).decode()
                    first = False
            elif kind == "done":
                calls = []
                if tools is not None:
                    rest, calls = tools.finish()
                    if rest or (first and not calls):
                        yield orjson.dumps(env.chunk(rest, first)).decode()
                        first = False
                if calls:
                    yield orjson.dumps(env.calls_chunk(calls, first)).decode()
                elif first:
                    yield orjson.dumps(env.chunk("", True)).decode()
                yield orjson.dumps(env.last_chunk(value, called=bool(calls))).decode()
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
                            h11_max_incomplete_event_size=MAX_HEADERS, http=http_protocol(limits, warn))
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
