"""What one client of ``adaspark serve`` may take (``Limits``), and the uvicorn protocol that holds
it to that (``http_protocol``, for the server of http_app.py).

A request body is refused with 413 past ``--max-body-mb``, read incrementally, never whole before
it is measured (http_app.read_body); a connection must send its request's headers within
``--header-timeout`` of opening (or of its previous response); at ``--max-connections`` open
connections a new one takes the place of the one that has waited longest without a request in
progress (idle, or its headers incomplete; one that was never answered goes before a kept-alive
one that was), and only when every open one has a request in progress is it answered 503 and
closed at once. uvicorn has neither of the last two (its keep-alive timer starts only after a
response; its ``limit_concurrency`` acts only once a request's headers are in), so ``_Protocol``
adds them, and a lingering close for a connection closed while its client is still sending a body
(``_LingeringClose``).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import sys
import time
from dataclasses import dataclass
from typing import Callable

import h11
import orjson
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    import fcntl
    import termios
except ImportError:  # not a Unix: a request not yet read is not told from none (_unread)
    fcntl = termios = None

from adaspark_core.serve import openai_api as api

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


def http_protocol(limits: Limits, warn: Callable[[str], None]) -> Callable[..., H11Protocol]:
    """uvicorn's ``http`` setting: our protocol under ``limits``; ``warn`` gets the warnings about
    connections refused at the cap."""
    return functools.partial(_Protocol, limits=limits, refused=_Refused(limits.max_connections, warn))


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
