"""``adaspark serve`` against slow and huge clients (issues 27 and 39): a deadline for a request's
headers, a cap on open connections at which idle ones make room for new ones, a limit on a
request's body, and all of them at once under a flood of idle and slow connections and a 200 MB
body while a real request is served. On the simulated model, on 127.0.0.1 only; every socket and
wait is bounded."""

import os
import selectors
import signal
import socket
import threading
import time

import httpx
import orjson
from conftest import SIM
from helpers import Server, chat_body, stream_events

from adaspark_core.serve.http_app import BACKLOG
from adaspark_core.serve.http_limits import LINGER_BYTES

CHAT = orjson.dumps(chat_body("hi", max_tokens=8))
MB = 2 ** 20


def address(srv) -> tuple[str, int]:
    host, port = srv.url[len("http://"):].rsplit(":", 1)
    return host, int(port)


def connect(srv, timeout=10.0) -> socket.socket:
    s = socket.create_connection(address(srv), timeout=timeout)
    s.settimeout(timeout)
    return s


def post_head(path: str, length: int | None) -> bytes:
    size = b"content-length: %d" % length if length is not None else b"transfer-encoding: chunked"
    return b"POST %s HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n%s\r\n\r\n" % (path.encode(), size)


def read_reply(s: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection (a reset ends it too)."""
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def read_one_reply(s: socket.socket) -> bytes:
    """One reply with a Content-Length, on a connection that stays open."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))[15:])
    while len(body) < length:
        body += s.recv(65536)
    return head + b"\r\n\r\n" + body


def status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(body)


def wait_closed(socks: dict, deadline: float, trickle: set = frozenset(), every: float = 0.1) -> dict:
    """Wait until the server closes each socket (or the deadline passes), sending one more header
    byte every ``every`` seconds on those in ``trickle``. Returns {name: bytes received}, only for
    those closed."""
    sel = selectors.DefaultSelector()
    for name, s in socks.items():
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, name)
    got: dict = {name: b"" for name in socks}
    closed: dict = {}
    next_byte = time.monotonic()
    while len(closed) < len(socks) and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=every):
            name = key.data
            try:
                chunk = key.fileobj.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except ConnectionResetError:
                chunk = b""
            if chunk:
                got[name] += chunk
            else:
                closed[name] = got[name]
                sel.unregister(key.fileobj)
        if time.monotonic() >= next_byte:
            next_byte += every
            for name in trickle:
                if name not in closed:
                    try:
                        socks[name].send(b"x")
                    except (BlockingIOError, BrokenPipeError, ConnectionResetError):
                        pass
    sel.close()
    return closed


def upload_until_refused(srv, length: int | None, total: int, deadline: float,
                         connected: threading.Event | None = None) -> tuple[bytes, int]:
    """A POST of ``total`` bytes (with Content-Length ``length``, or chunked when None), sent as
    fast as the server takes it while reading what it answers; ends when the server closes the
    connection or the deadline passes. Returns (the reply, bytes of body sent)."""
    s = connect(srv)
    s.sendall(post_head("/v1/chat/completions", length))
    if connected is not None:
        connected.set()
    s.setblocking(False)
    piece = b"x" * 65536
    if length is None:
        piece = b"%x\r\n%s\r\n" % (len(piece), piece)
    sent, reply, sending = 0, b"", True
    sel = selectors.DefaultSelector()
    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
    try:
        while time.monotonic() < deadline:
            events = sel.select(timeout=0.1)
            if not events:
                continue
            mask = events[0][1]
            if mask & selectors.EVENT_READ:
                try:
                    chunk = s.recv(65536)
                except (BlockingIOError, InterruptedError):
                    chunk = None
                except ConnectionResetError:
                    chunk = b""
                if chunk == b"":
                    break
                if chunk:
                    reply += chunk
            if sending and mask & selectors.EVENT_WRITE:
                try:
                    sent += s.send(piece)
                except (BlockingIOError, InterruptedError):
                    pass
                except (BrokenPipeError, ConnectionResetError):
                    sending = False
                if sent >= total:
                    sending = False
                if not sending:
                    sel.modify(s, selectors.EVENT_READ)
    finally:
        sel.close()
        s.close()
    return reply, sent


def assert_too_large(reply: bytes):
    status, body = status_and_body(reply)
    err = body["error"]
    assert status == 413 and err["code"] == "request_too_large" and "--max-body-mb" in err["message"], reply
    assert set(err) == {"message", "type", "param", "code"}


def vm(pid: int) -> dict:
    """The process's resident memory now and at its peak, in MB."""
    fields = dict(line.split(":", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":" in line)
    return {k: int(fields[k].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}


def assert_shed(closed: dict) -> None:
    """Each connection was closed quietly to make room for a newer one, or refused with 503 at
    once: those came in a burst that the server accepted before reading the half headers of the
    others in it, and a request not read yet is not cut (it may be whole)."""
    for data in closed.values():
        assert data == b"" or status_and_body(data)[1]["error"]["code"] == "too_many_connections", data


def assert_clean(srv):
    assert srv.stop() == 128 + signal.SIGTERM
    err = srv.stderr
    assert "Traceback" not in err and "Too many open files" not in err, err[-3000:]
    assert len(err.encode()) < 10_000, err[-3000:]


def test_a_connection_that_does_not_finish_its_headers_in_time_is_closed(tmp_path):
    srv = Server("--model", SIM, "--store", tmp_path / "store.json", "--header-timeout", 1)
    socks, slow_body = {}, None
    try:
        socks |= {name: connect(srv) for name in ("silent", "part of a request line", "trickled headers",
                                                 "trickled after a reply")}
        socks["part of a request line"].sendall(b"GET /hea")
        socks["trickled headers"].sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ")
        kept = socks["trickled after a reply"]
        kept.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert read_one_reply(kept).startswith(b"HTTP/1.1 200 ")
        # the next request on the kept-alive connection comes a byte at a time: any byte stops
        # uvicorn's keep-alive timer, but not the header deadline
        kept.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-slow: ")
        # a request whose headers came in time is not cut, however slow its body
        slow_body = connect(srv)
        slow_body.sendall(post_head("/v1/chat/completions", len(CHAT)))

        def send_slowly():
            for i in range(0, len(CHAT), len(CHAT) // 4 + 1):
                time.sleep(0.5)
                slow_body.sendall(CHAT[i:i + len(CHAT) // 4 + 1])

        sender = threading.Thread(target=send_slowly)
        sender.start()
        closed = wait_closed(socks, time.monotonic() + 15, trickle={"trickled headers", "trickled after a reply"})
        sender.join(30)
        assert set(closed) == set(socks), f"still open: {set(socks) - set(closed)}"
        assert all(data == b"" for data in closed.values()), closed  # closed quietly, no reply
        status, body = status_and_body(read_reply(slow_body))
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        assert srv.http.get("/health").json()["status"] == "ok"
    finally:
        for s in [*socks.values(), *filter(None, [slow_body])]:
            s.close()
        assert_clean(srv)


def test_at_the_cap_a_new_connection_gets_503_at_once_only_if_every_open_one_has_a_request_in_progress(tmp_path):
    srv = Server("--model", SIM, "--store", tmp_path / "store.json", "--max-connections", 4, "--header-timeout", 3)
    srv.http.close()  # the helper's client holds no connection
    busy = {i: connect(srv) for i in range(4)}
    for s in busy.values():  # headers in, the body coming: a request in progress
        s.sendall(post_head("/v1/chat/completions", len(CHAT)) + CHAT[:10])
    extra = []
    try:
        for _ in range(3):  # refused at once: before their request, and with nothing of it read
            extra.append(connect(srv))
            status, body = status_and_body(read_reply(extra[-1]))
            assert status == 503 and body["error"]["code"] == "too_many_connections", body
            assert body["error"]["type"] == "server_error" and "--max-connections" in body["error"]["message"]
        with httpx.Client(base_url=srv.url, timeout=10) as client:  # a real client is told why
            r = client.get("/health")
            assert r.status_code == 503 and r.json()["error"]["code"] == "too_many_connections"
        for s in busy.values():
            s.sendall(CHAT[10:])
            assert status_and_body(read_one_reply(s))[0] == 200
        # answered and kept alive, each waits for its next request: a new connection takes the
        # place of the one that has waited longest, which is closed quietly
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            assert client.get("/health").json()["status"] == "ok"
            assert client.post("/v1/chat/completions", content=CHAT).status_code == 200
        assert wait_closed({0: busy[0]}, time.monotonic() + 10) == {0: b""}
    finally:
        for s in [*busy.values(), *extra]:
            s.close()
        assert_clean(srv)
    assert srv.stderr.count("refusing connections") == 1, srv.stderr  # one warning, not one a connection


def test_at_the_cap_a_kept_alive_client_between_two_requests_is_shed_after_every_never_answered_one(tmp_path):
    # A kept-alive client is idle for a moment between a reply and its next request; a burst of new
    # connections in that moment used to shed it as the oldest idle one, and its next request met a
    # reset (CI, stop 44). Here the moment is held open while twice the cap of idle sockets come.
    srv = Server("--model", SIM, "--store", tmp_path / "store.json", "--max-connections", 4, "--header-timeout", 30)
    srv.http.close()
    kept = connect(srv)
    idle = {}
    try:
        kept.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert read_one_reply(kept).startswith(b"HTTP/1.1 200 ")
        for i in range(8):  # silent: a socket whose bytes the loop has not read yet is never shed
            idle[i] = connect(srv)
        # the three newest idle sockets and the kept-alive client hold the cap; the rest made room
        closed = wait_closed(idle, time.monotonic() + 2)
        assert sorted(closed) == list(range(5)), sorted(closed)
        assert_shed(closed)
        kept.sendall(post_head("/v1/chat/completions", len(CHAT)) + CHAT)
        status, body = status_and_body(read_one_reply(kept))
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
    finally:
        for s in [kept, *idle.values()]:
            s.close()
        assert_clean(srv)


def test_400_idle_sockets_at_the_cap_keep_no_request_out_and_one_in_progress_is_not_shed(tmp_path):
    # the default cap (64) and a header deadline long past the test: before issue 39 each idle
    # socket held its place for the deadline, and the real request below got 503
    srv = Server("--model", SIM, "--store", tmp_path / "store.json", "--header-timeout", 60)
    srv.http.close()
    in_progress = connect(srv)
    in_progress.sendall(post_head("/v1/chat/completions", len(CHAT)) + CHAT[:10])
    idle = {}
    try:
        for i in range(400):  # half a header each, then nothing
            idle[i] = connect(srv)
            idle[i].sendall(b"GET /health HTTP/1.1\r\nhost: x\r\nx-half: ")
        with httpx.Client(base_url=srv.url, timeout=10) as client:  # a sixth of the idle sockets' deadline
            r = client.post("/v1/chat/completions", content=CHAT)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        in_progress.sendall(CHAT[10:])
        status, body = status_and_body(read_one_reply(in_progress))
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
        # the idle ones made room: at most the cap's worth is left open
        closed = wait_closed(idle, time.monotonic() + 2)
        assert len(closed) >= 400 - 64, sorted(set(idle) - set(closed))
        assert_shed(closed)
    finally:
        for s in [in_progress, *idle.values()]:
            s.close()
        assert_clean(srv)


def test_a_body_over_the_limit_gets_413_early_and_the_server_goes_on(tmp_path):
    srv = Server("--model", SIM, "--store", tmp_path / "store.json", "--max-body-mb", 1)
    try:
        # 200 MB declared: refused by its Content-Length before any of it is read
        reply, sent = upload_until_refused(srv, 200 * MB, 200 * MB, time.monotonic() + 30)
        assert_too_large(reply)
        assert sent < 64 * MB, sent
        # chunked, no length: refused once what came passes 1 MB
        reply, sent = upload_until_refused(srv, None, 200 * MB, time.monotonic() + 30)
        assert_too_large(reply)
        assert sent < 64 * MB, sent
        # a client that goes on sending after the 413 still gets the whole reply: the server reads
        # and drops the rest of the body and ends with a FIN (closed with the body unread, its
        # socket would send a reset, which can cut the reply off before it is sent or read)
        for length in (200 * MB, None):
            s = connect(srv)
            s.sendall(post_head("/v1/chat/completions", length))
            piece = b"x" * 65536 if length else b"10000\r\n%s\r\n" % (b"x" * 65536)
            for _ in range(LINGER_BYTES // 2 // len(piece)):  # inside the server's bounds on lingering
                s.sendall(piece)  # a reset would raise here
            s.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := s.recv(65536):  # and here
                reply += chunk
            assert_too_large(reply)
            s.close()
        # the openai client's HTTP stack sees the 413 (a whole body, and a generated one it
        # stops generating)
        pulled = 0

        def pieces():
            nonlocal pulled
            while pulled < 200 * MB:
                pulled += 65536
                yield b" " * 65536

        r = srv.post("/v1/chat/completions", b" " * (MB + 1))
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        r = srv.http.post("/v1/chat/completions", content=pieces())
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
        assert pulled < 64 * MB
        # just under the limit is read and answered, with a length or chunked
        padded = CHAT + b" " * (MB - len(CHAT))
        assert srv.post("/v1/chat/completions", padded).status_code == 200
        r = srv.http.post("/v1/chat/completions", content=iter([padded[:MB // 2], padded[MB // 2:]]))
        assert r.status_code == 200
        assert srv.http.get("/health").json()["status"] == "ok"
    finally:
        assert_clean(srv)


def test_a_flood_of_idle_and_slow_connections_and_a_huge_body_leave_the_server_serving(tmp_path):
    cap, timeout, n_idle, n_slow = 48, 3, 150, 150
    srv = Server("--model", SIM, "--store", tmp_path / "store.json", "--max-connections", cap,
                 "--header-timeout", timeout, "--n-ctx", 8192)
    srv.http.close()
    pid = srv.proc.pid
    flood: dict = {}
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:  # warm: the first reply's allocations
            assert client.post("/v1/chat/completions", content=CHAT).status_code == 200
        before = vm(pid)
        fds = [len(os.listdir(f"/proc/{pid}/fd"))]

        # The real client, admitted before the flood: a long streamed reply, then one request
        # after another on the same kept-alive connection until the flood is over.
        real: dict = {"replies": []}
        started, flood_over = threading.Event(), threading.Event()

        def real_client():
            try:
                with httpx.Client(base_url=srv.url, timeout=60) as client:
                    t = time.monotonic()
                    body = orjson.dumps(chat_body("Tell a long story.", max_tokens=4000, stream=True))
                    with client.stream("POST", "/v1/chat/completions", content=body) as r:
                        real["status"] = r.status_code
                        real["events"] = []
                        for event in stream_events(r.iter_lines()):
                            real["events"].append(event)
                            started.set()
                    real["seconds"] = time.monotonic() - t
                    while not flood_over.is_set():
                        t = time.monotonic()
                        try:
                            r = client.post("/v1/chat/completions",
                                            content=orjson.dumps(chat_body("And then?", max_tokens=200)))
                        except httpx.TransportError:
                            # Between two requests the connection is idle, and when every other one
                            # is mid-request it is the one the cap sheds: a client comes back on a
                            # new connection, as after any idle keep-alive close.
                            real["shed"] = real.get("shed", 0) + 1
                            continue
                        real["replies"].append((r.status_code, time.monotonic() - t))
            except Exception as e:  # said by the assertions below
                real["error"] = repr(e)
            finally:
                started.set()

        # Two 200 MB bodies, one declared, one chunked, also sent before the flood.
        huge: dict = {}
        connected = {n: threading.Event() for n in (200 * MB, None)}

        def huge_body(length):
            huge[length] = upload_until_refused(srv, length, 200 * MB, time.monotonic() + 40, connected[length])

        workers = [threading.Thread(target=real_client),
                   *(threading.Thread(target=huge_body, args=(n,)) for n in (200 * MB, None))]
        for w in workers:
            w.start()
        # all three are in the server's accept queue before any of the flood: admitted first
        assert started.wait(30) and all(e.wait(30) for e in connected.values())

        # The flood: idle connections, and slow ones trickling their headers a byte at a time.
        t_flood = time.monotonic()
        for i in range(n_idle + n_slow):
            flood[i] = connect(srv)
            if i >= n_idle:
                flood[i].sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-slow: ")
            if i % 50 == 0:
                fds.append(len(os.listdir(f"/proc/{pid}/fd")))
        fds.append(len(os.listdir(f"/proc/{pid}/fd")))
        open_seconds = time.monotonic() - t_flood
        # a new client meanwhile is answered at once, if only to be told to come back
        with httpx.Client(base_url=srv.url, timeout=10) as client:
            r = client.get("/health")
            assert r.status_code == 200 or r.json()["error"]["code"] == "too_many_connections"
        closed = wait_closed(flood, t_flood + timeout + 20, trickle=set(range(n_idle, n_idle + n_slow)),
                             every=0.25)
        fds.append(len(os.listdir(f"/proc/{pid}/fd")))
        flood_seconds = time.monotonic() - t_flood
        flood_over.set()
        for w in workers:
            w.join(60)
            assert not w.is_alive()

        assert set(closed) == set(flood), f"{len(flood) - len(closed)} flood connections still open"
        # none had a request in progress: each made room for newer ones and went quietly (or past
        # the header deadline), or was refused in a burst of them
        assert_shed(closed)
        assert max(fds) <= fds[0] + cap + 4 * BACKLOG, fds  # the cap, and a few accept batches being shed

        assert "error" not in real, real["error"]
        assert real["status"] == 200 and real["events"][-1] == "[DONE]"
        last = orjson.loads(real["events"][-2])
        assert last["choices"][0]["finish_reason"] in ("stop", "length")
        assert real["replies"] and all(status == 200 for status, _ in real["replies"]), real["replies"]
        for length in (200 * MB, None):
            reply, sent = huge[length]
            assert_too_large(reply)
            assert sent < 64 * MB, sent

        with httpx.Client(base_url=srv.url, timeout=30) as client:  # serving again
            assert client.get("/health").json()["status"] == "ok"
            assert client.post("/v1/chat/completions", content=CHAT).status_code == 200
        after = vm(pid)
        print(f"\nflood: RSS {before['VmRSS']:.0f} -> {after['VmRSS']:.0f} MB, peak {before['VmHWM']:.0f} -> "
              f"{after['VmHWM']:.0f} MB; descriptors {min(fds)}-{max(fds)}; {len(closed)} shed, refused or timed "
              f"out; flood opened in {open_seconds:.2f} s, over in {flood_seconds:.1f} s; the real stream took "
              f"{real['seconds']:.2f} s ({len(real['events']) - 1} events), then {len(real['replies'])} requests "
              f"during the flood, {max(t for _, t in real['replies']):.2f} s at most")
        assert after["VmRSS"] - before["VmRSS"] < 100 and after["VmHWM"] - before["VmHWM"] < 100, (before, after)
    finally:
        for s in flood.values():
            s.close()
        assert_clean(srv)
    print(f"stderr: {len(srv.stderr.encode())} bytes: {srv.stderr!r}")
