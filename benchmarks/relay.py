"""A network you can dial: a TCP relay on loopback that holds every chunk of data it carries, each
way, for a fixed delay before passing it on (``make bench-rpc`` puts one in front of each llama.cpp
RPC server, which ``start_rpc_server`` starts; the RPC tests start theirs with it too).

A chunk is due ``delay`` after it arrived and chunks leave in order, so the relay adds latency to
every message without limiting throughput (a model's weights still upload at loopback speed). The
delay can be changed between runs (``Relay.delay``). It listens on 127.0.0.1 only, and ``close``
stops it and every connection it carries.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

CHUNK = 1 << 16


def start_rpc_server(timeout: float = 30.0) -> tuple[subprocess.Popen, int]:
    """``adaspark rpc-server`` (one thread) on a free loopback port, once it listens; RuntimeError
    if it ends or does not listen within ``timeout`` seconds. ``stop_rpc_server`` kills it."""
    from adaspark_core.engine.llama_server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "adaspark_cli.main", "rpc-server", "--port", str(port),
                             "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(f"rpc-server ended: {proc.stderr.read().decode()}") from None
            time.sleep(0.1)
    stop_rpc_server(proc)
    raise RuntimeError(f"rpc-server did not listen within {timeout:g} s")


def stop_rpc_server(proc: subprocess.Popen) -> None:
    """Kill an rpc-server ``start_rpc_server`` started (its process group), and reap it."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


class Relay:
    """Relays 127.0.0.1:``port`` (a free one) to ``target`` (host, port), ``delay`` seconds each way."""

    def __init__(self, target: tuple[str, int], delay: float = 0.0):
        self.target, self.delay = target, delay
        self._writers: set[asyncio.StreamWriter] = set()  # both ends of every connection carried
        self._loop = asyncio.new_event_loop()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._server = self._loop.run_until_complete(asyncio.start_server(self._carry, sock=sock))
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"relay-{self.port}", daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _carry(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._writers.add(client_w)
        try:
            server_r, server_w = await asyncio.open_connection(*self.target)
        except OSError:
            client_w.close()
            return
        self._writers.add(server_w)
        await asyncio.gather(self._pump(client_r, server_w), self._pump(server_r, client_w))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Pass ``reader``'s chunks to ``writer``, each when its delay is over, in order."""
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if data is None:
                    break
                if (wait := due - loop.time()) > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while data := await reader.read(CHUNK):
                queue.put_nowait((loop.time() + self.delay, data))
        except OSError:
            pass
        queue.put_nowait((0.0, None))
        try:
            await sender
        except OSError:
            pass
        writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for writer in self._writers:
                writer.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
