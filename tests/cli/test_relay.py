"""The delay relay of ``make bench-rpc`` (benchmarks/relay.py): it carries bytes both ways in
order, each chunk held for the delay (and no longer), and closes cleanly."""

import socket
import socketserver
import threading
import time

from benchmarks.relay import Relay


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(1 << 16):
            self.request.sendall(data)


def _round_trip(sock, data: bytes) -> float:
    t0 = time.perf_counter()
    sock.sendall(data)
    got = b""
    while len(got) < len(data):
        got += sock.recv(1 << 16)
    assert got == data
    return time.perf_counter() - t0


def test_the_relay_carries_bytes_in_order_and_holds_each_way_for_its_delay():
    echo = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=echo.serve_forever, daemon=True).start()
    relay = Relay(echo.server_address, delay=0.05)
    try:
        with socket.create_connection(("127.0.0.1", relay.port), timeout=10) as sock:
            assert _round_trip(sock, b"x") >= 0.1  # held 50 ms each way
            big = bytes(range(256)) * 4096  # 1 MiB in many chunks: in order, not 50 ms a chunk
            assert _round_trip(sock, big) < 5
            relay.delay = 0.0
            assert _round_trip(sock, b"y") < 0.05
    finally:
        relay.close()
        echo.shutdown()
        echo.server_close()
    assert not relay._thread.is_alive()
