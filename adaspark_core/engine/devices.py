"""Where a model's layers run, named as llama.cpp's tools name it: ``--n-gpu-layers`` (layers
offloaded from the CPU), ``--device`` (which backend devices take them), ``--tensor-split`` (the
share of each device) and ``--rpc`` (llama.cpp's RPC servers on other hosts, each a device).

The layout is part of what the learned state depends on: a verify's cost on a GPU, or split over
hosts with a network round trip per split, is not its cost on the local CPU, so a store learned
on one layout never prices a run on another (store/fingerprint.py). The layout recorded is the
one that takes effect: where there is nothing to offload to (no GPU, no RPC server: this machine),
GPU layers change nothing and the layout stays the local CPU's.

``DeviceLayout`` and ``parse_layout`` are pure. ``effective`` (which registers the RPC servers'
devices with ggml, ``add_rpc_servers``) and ``model_params`` apply a layout to llama.cpp's model
parameters (the engine's model, llama.py, calls them); ``serve_rpc`` is the library's own RPC
server (``adaspark rpc-server``). ggml is reached through libllama, which links it.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
import struct
from dataclasses import dataclass, field
from typing import Callable

from adaspark_core.base.errors import InputError

ALL_LAYERS = -1  # llama.cpp: a negative n_gpu_layers offloads every layer
DEV_CPU, DEV_GPU, DEV_IGPU = 0, 1, 2  # ggml_backend_dev_type
_ENDPOINT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*):(\d{1,5})$")
# How long an RPC server may take over one message (a reply includes the compute it waits for: a
# prefill batch of a large model on a slow host can take a minute) before the run ends with an
# error; ggml's own reads wait for ever, so a server that stops answering would hang the run.
RPC_TIMEOUT_SECONDS = 120.0


@dataclass(frozen=True)
class DeviceLayout:
    """``n_gpu_layers``: layers offloaded (ALL_LAYERS: all); ``devices``: the backend devices to
    offload to, by name (empty: every device llama.cpp finds); ``tensor_split``: each device's
    share of the offloaded layers (empty: by free memory, llama.cpp's default); ``rpc``: the
    HOST:PORT of each RPC server whose device joins them; ``rpc_timeout``: the seconds a server
    may take over one message (not part of the layout's identity: it prices nothing)."""

    n_gpu_layers: int = 0
    devices: tuple[str, ...] = ()
    tensor_split: tuple[float, ...] = ()
    rpc: tuple[str, ...] = ()
    rpc_timeout: float = field(default=RPC_TIMEOUT_SECONDS, compare=False)

    @property
    def local_cpu(self) -> bool:
        return self == DeviceLayout()

    def fingerprint(self) -> dict | None:
        """The layout as the store's fingerprint holds it; None for the local CPU (so a store
        learned before layouts were recorded keeps its key)."""
        if self.local_cpu:
            return None
        return {"n_gpu_layers": self.n_gpu_layers, "devices": list(self.devices),
                "tensor_split": list(self.tensor_split), "rpc": list(self.rpc)}

    def server_args(self) -> list[str]:
        """The same layout as llama-server's options (the peer arms run on it too)."""
        out = []
        if self.n_gpu_layers:
            out += ["--n-gpu-layers", "all" if self.n_gpu_layers == ALL_LAYERS else str(self.n_gpu_layers)]
        if self.devices:
            out += ["--device", ",".join(self.devices)]
        if self.tensor_split:
            out += ["--tensor-split", ",".join(f"{x:g}" for x in self.tensor_split)]
        if self.rpc:
            out += ["--rpc", ",".join(self.rpc)]
        return out


def describe(fp: dict | None) -> str:
    """A layout as ``store show`` says it, from its fingerprint (None: the local CPU)."""
    if not fp:
        return "local CPU"
    layers = "all" if fp["n_gpu_layers"] == ALL_LAYERS else str(fp["n_gpu_layers"])
    parts = [f"{layers} layers offloaded to {', '.join(fp['devices']) or 'every device found'}"]
    if fp["tensor_split"]:
        parts.append(f"split {','.join(f'{x:g}' for x in fp['tensor_split'])}")
    if fp["rpc"]:
        parts.append(f"RPC servers {', '.join(fp['rpc'])}")
    return "; ".join(parts)


def parse_layout(n_gpu_layers: str | None = None, device: str | None = None, tensor_split: str | None = None,
                 rpc: str | None = None, rpc_timeout: float = RPC_TIMEOUT_SECONDS) -> DeviceLayout:
    """The layout the four options name (their text as typed); InputError naming the option for
    anything malformed. ``--n-gpu-layers`` takes a count or ``all``; ``--device`` and ``--rpc``
    comma-separated names and HOST:PORT endpoints; ``--tensor-split`` comma-separated shares."""
    layers = 0
    if n_gpu_layers is not None:
        text = n_gpu_layers.strip().lower()
        if text == "all":
            layers = ALL_LAYERS
        elif text.isdigit():
            layers = int(text)
        else:
            raise InputError(f"--n-gpu-layers wants a number of layers or all, not {n_gpu_layers!r}")
    devices = _items(device, "--device")
    split = ()
    if tensor_split is not None:
        try:
            split = tuple(float(x) for x in _items(tensor_split, "--tensor-split"))
        except ValueError:
            raise InputError(f"--tensor-split wants comma-separated shares (3,1), not {tensor_split!r}") from None
        if any(not (x >= 0 and x < float("inf")) for x in split) or not any(split):
            raise InputError(f"--tensor-split wants shares of at least 0, not all 0: {tensor_split!r}")
    endpoints = _items(rpc, "--rpc")
    for e in endpoints:
        m = _ENDPOINT.match(e)
        if m is None or not 0 < int(m.group(2)) < 65536:
            raise InputError(f"--rpc wants HOST:PORT endpoints (192.168.1.2:50052), not {e!r}")
    if not rpc_timeout > 0:
        raise InputError(f"--rpc-timeout wants a number of seconds above 0, not {rpc_timeout!r}")
    if (split or devices or endpoints) and not layers:
        layers = ALL_LAYERS  # devices named and no layer count: offload them all, as llama.cpp's tools do
    return DeviceLayout(layers, devices, split, endpoints, rpc_timeout)


def _items(text: str | None, option: str) -> tuple[str, ...]:
    if text is None:
        return ()
    items = tuple(x.strip() for x in text.split(","))
    if not all(items):
        raise InputError(f"{option} wants a comma-separated list without empty items, not {text!r}")
    return items


# --- applied to llama.cpp -----------------------------------------------------------------------


def effective(layout: DeviceLayout, lib) -> DeviceLayout:
    """``layout`` as it takes effect with the llama.cpp library ``lib``, its RPC servers' devices
    registered with ggml (as llama.cpp's own ``--rpc`` does): InputError for RPC the build lacks,
    a server that cannot be reached or a device it does not have; the local CPU where it
    offloads to nothing."""
    if layout.rpc:
        add_rpc_servers(layout.rpc, lib)
    names = device_names(lib)
    unknown = [d for d in layout.devices if d not in names]
    if unknown:
        raise InputError(f"--device: no device {unknown[0]!r} here (llama.cpp has {', '.join(names)})")
    if len(layout.tensor_split) > lib.llama_max_devices():
        raise InputError(f"--tensor-split: at most {lib.llama_max_devices()} shares")
    return recorded(layout, lib)


def recorded(layout: DeviceLayout, lib=None) -> DeviceLayout:
    """The layout a run on ``layout`` records (``effective`` once its servers are reached), told
    without reaching them, so the store commands find a layout's store: RPC servers always take
    the layers; GPU layers only where the build has a device to offload to, else every layer stays
    on the CPU whatever was asked. ``lib``: llama.cpp (default: loaded here)."""
    if layout.local_cpu or layout.rpc:
        return layout
    if lib is None:
        import llama_cpp as lib

        from adaspark_core.engine.bindings import init_backend

        init_backend(verbose=False)
    return layout if offload_targets(lib) else DeviceLayout()


RPC_CONNECT_SECONDS = 5.0  # a server that does not answer a connect or a hello within this is reported, not waited on
RPC_HELLO = 14  # ggml-rpc's first command: | 14 | request size (u64) | connection capabilities |
RPC_CAPS_BYTES = 24  # the capabilities of a hello (none asked for here: a plain TCP connection)
_registered: set[str] = set()  # endpoints whose devices ggml has (once per process, as ggml keeps them)
_greeting: tuple[str, str] | None = None  # (endpoint, its protocol) while ggml connects to it


def add_rpc_servers(endpoints: tuple[str, ...], lib) -> None:
    """Register the devices of each RPC server with ggml. Each is first greeted from here
    (``rpc_hello``), with bounded waits, since ggml's own connect and hello wait for ever; a server
    whose protocol ggml then refuses is one line and exit status 2 (``_report_lost_servers``)."""
    global _greeting
    add_server = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(_rpc_function(lib, "ggml_backend_rpc_add_server",
                                                                                  "--rpc: "))
    raw = lib.llama_cpp._lib
    register = raw.ggml_backend_register
    register.restype, register.argtypes = None, [ctypes.c_void_p]
    _report_lost_servers(raw)
    for endpoint in endpoints:
        if endpoint in _registered:
            continue
        _greeting = (endpoint, rpc_hello(endpoint))
        try:
            reg = add_server(endpoint.encode())
        finally:
            _greeting = None
        if not reg:
            raise InputError(f"--rpc: the server at {endpoint} is no llama.cpp RPC server of this version "
                             "(it offered no device)")
        register(reg)
        _registered.add(endpoint)


def rpc_hello(endpoint: str, timeout: float = RPC_CONNECT_SECONDS) -> str:
    """The protocol version (``7.0.0``) the llama.cpp RPC server at ``endpoint`` answers a hello
    with, each wait bounded by ``timeout``; InputError for a server that cannot be reached, does
    not answer, or answers as no RPC server does. (A server serves one client at a time; this
    connection ends before ggml's begins.)"""
    said = f"--rpc: the server at {endpoint}"
    try:
        sock = socket.create_connection(_address(endpoint), timeout=timeout)
    except OSError as e:
        raise InputError(f"--rpc: cannot reach the RPC server at {endpoint} ({e.strerror or e})") from None
    with sock:
        try:
            sock.sendall(bytes([RPC_HELLO]) + struct.pack("<Q", RPC_CAPS_BYTES) + bytes(RPC_CAPS_BYTES))
            size = struct.unpack("<Q", _receive(sock, 8))[0]
            if not 3 <= size <= 1024:  # major, minor, patch (and the capabilities, since protocol 7)
                raise InputError(f"{said} is no llama.cpp RPC server (its answer to a hello is {size} bytes)")
            major, minor, patch = _receive(sock, size)[:3]
        except TimeoutError:
            raise InputError(f"{said} did not answer a hello within {timeout:g} s (is it a llama.cpp RPC "
                             "server?)") from None
        except OSError as e:
            raise InputError(f"{said} dropped the connection at its hello ({e.strerror or e}; is it a llama.cpp "
                             "RPC server?)") from None
    return f"{major}.{minor}.{patch}"


def _address(endpoint: str) -> tuple[str, int]:
    """HOST:PORT (HOST an IPv6 address in brackets too) as the socket module takes it."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def _receive(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        if not (chunk := sock.recv(n - len(data))):
            raise ConnectionResetError(0, "closed")
        data += chunk
    return data


def bound_rpc_reads(layout: DeviceLayout) -> int:
    """Give each connection this process has to one of ``layout``'s RPC servers a send and a
    receive timeout of ``layout.rpc_timeout``; returns how many it found. ggml opens them (one per
    server, for as long as a model's buffers on it live) and waits on them for ever: with the
    timeout, a server that stops answering fails a read, which ggml reports as a lost server
    (``_report_lost_servers``). Called once a model is loaded, when its connections are open."""
    peers = set()
    for endpoint in layout.rpc:
        for *_, address in socket.getaddrinfo(*_address(endpoint), type=socket.SOCK_STREAM):
            peers.add(address[:2])
    seconds = int(layout.rpc_timeout)
    timeval = struct.pack("@ll", seconds, int((layout.rpc_timeout - seconds) * 1e6))
    found = 0
    for name in os.listdir("/dev/fd"):
        try:
            sock = socket.socket(fileno=int(name))  # only to reach the descriptor: detached below
        except (OSError, ValueError):
            continue  # not a socket (or the listing's own descriptor, closed by now)
        try:
            if sock.type == socket.SOCK_STREAM and sock.getpeername()[:2] in peers:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
                found += 1
        except OSError:
            pass  # not connected
        finally:
            sock.detach()
    return found


_on_abort = None  # the ctypes callback ggml holds (kept alive here)
_last_words: list[Callable[[], None]] = []  # run before the process ends on a lost server


def on_server_lost(save: Callable[[], None]) -> Callable[[], None]:
    """Have ``save`` run (the learned state written) if a lost RPC server ends the process;
    returns what takes it back."""
    _last_words.append(save)
    return lambda: _last_words.remove(save) if save in _last_words else None


def _report_lost_servers(raw) -> None:
    """A server that dies or stops answering mid-run (``bound_rpc_reads``) makes ggml abort the
    process: what ``on_server_lost`` asked for runs, then one line (not a backtrace) says so and
    the process exits with status 1. It cannot go on, since the model's layers on that server are
    gone. (ggml aborts in its RPC thread while the decode waits in llama.cpp, between rounds of
    the learners, so what they hold is whole.)"""
    global _on_abort
    if _on_abort is not None:
        return

    def lost(message: bytes) -> None:
        text = message.decode(errors="replace").rsplit(": ", 1)[-1].strip()
        if _greeting is not None:  # ggml refused the server's hello: a bad argument, nothing lost
            endpoint, version = _greeting
            os.write(2, f"adaspark: error: --rpc: the server at {endpoint} speaks RPC protocol {version}, which this "
                        f"build's llama.cpp refuses ({text}): run the rpc-server of the same llama.cpp\n".encode())
            os._exit(2)
        for save in list(_last_words):
            try:
                save()
            except Exception as e:  # noqa: BLE001 (the line below must still be said)
                os.write(2, f"adaspark: warning: the learned state was not saved: {e}\n".encode())
        os.write(2, f"adaspark: error: llama.cpp stopped, an RPC server lost or not answering: {text}\n".encode())
        os._exit(1)

    _on_abort = ctypes.CFUNCTYPE(None, ctypes.c_char_p)(lost)
    raw.ggml_set_abort_callback.restype = ctypes.c_void_p
    raw.ggml_set_abort_callback.argtypes = [ctypes.c_void_p]
    raw.ggml_set_abort_callback(ctypes.cast(_on_abort, ctypes.c_void_p))


def serve_rpc(host: str, port: int, threads: int | None, device: str | None,
              on_ready: Callable[[str], None] = lambda name: None) -> None:
    """Serve this host's device (``device``: one by name; default: its first GPU, else the CPU,
    as llama.cpp's rpc-server picks) to llama.cpp RPC clients on ``host:port`` until the process
    is stopped: the library's own RPC server (``ggml_backend_rpc_start_server``). ``on_ready``
    gets the device's name before it starts listening; it returns only if it cannot listen."""
    import llama_cpp as lib

    from adaspark_core.engine.bindings import default_threads, init_backend

    init_backend(verbose=False)
    start = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t,
                             ctypes.POINTER(ctypes.c_void_p))(_rpc_function(lib, "ggml_backend_rpc_start_server"))
    count, get, name, by_name, kind = _ggml(lib)
    if device is not None:
        dev = by_name(device.encode())
        if not dev:
            raise InputError(f"--device: no device {device!r} here (llama.cpp has {', '.join(device_names(lib))})")
    else:
        found = [get(i) for i in range(count())]
        dev = next((d for d in found if kind(d) in (DEV_GPU, DEV_IGPU)), None) or next(d for d in found if kind(d) == DEV_CPU)
    devs = (ctypes.c_void_p * 1)(dev)
    on_ready(name(dev).decode())
    start(f"{host}:{port}".encode(), None, threads or default_threads(), 1, devs)


def _rpc_function(lib, symbol: str, said: str = "") -> int:
    """The address of one of the RPC backend's functions (its registry hands them out, as
    llama.cpp's tools ask for them); InputError on a build without the backend."""
    raw = lib.llama_cpp._lib
    reg_by_name, proc = raw.ggml_backend_reg_by_name, raw.ggml_backend_reg_get_proc_address
    reg_by_name.restype, reg_by_name.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    proc.restype, proc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_char_p]
    rpc = reg_by_name(b"RPC") if lib.llama_supports_rpc() else None
    address = proc(rpc, symbol.encode()) if rpc else None
    if not address:
        raise InputError(f"{said}this llama.cpp build has no RPC backend (build llama-cpp-python with "
                         "CMAKE_ARGS=-DGGML_RPC=ON: make setup does)")
    return address


def device_names(lib) -> list[str]:
    """The backend devices llama.cpp has, by name (``CPU``, ``CUDA0``, ``RPC0``, ...)."""
    count, get, name = _ggml(lib)[:3]
    return [name(get(i)).decode() for i in range(count())]


def offload_targets(lib) -> list[str]:
    """The devices layers can be offloaded to: GPUs, and the devices of RPC servers added."""
    count, get, name, _, kind = _ggml(lib)
    return [name(get(i)).decode() for i in range(count()) if kind(get(i)) in (DEV_GPU, DEV_IGPU)]


def model_params(mparams, layout: DeviceLayout, lib) -> list:
    """Set ``layout`` on llama.cpp's model parameters; returns the ctypes arrays they point into,
    which must outlive the model's load."""
    keep: list = []
    mparams.n_gpu_layers = layout.n_gpu_layers
    if layout.tensor_split:
        split = (ctypes.c_float * lib.llama_max_devices())(*layout.tensor_split)
        mparams.tensor_split = split
        keep.append(split)
    if layout.devices or layout.local_cpu:
        # A NULL-terminated ggml_backend_dev_t list; empty for the local CPU, so that no device a
        # server registered in this process earlier (an RPC server's, perhaps gone) is touched.
        by_name = _ggml(lib)[3]
        devs = (ctypes.c_void_p * (len(layout.devices) + 1))(*[by_name(d.encode()) for d in layout.devices], None)
        mparams.devices = ctypes.cast(devs, ctypes.c_void_p).value
        keep.append(devs)
    return keep


def _ggml(lib):
    """ggml's device registry, reached through libllama (which links it)."""
    raw = lib.llama_cpp._lib
    count, get, name, by_name, kind = (raw.ggml_backend_dev_count, raw.ggml_backend_dev_get, raw.ggml_backend_dev_name,
                                       raw.ggml_backend_dev_by_name, raw.ggml_backend_dev_type)
    count.restype, count.argtypes = ctypes.c_size_t, []
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    name.restype, name.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    by_name.restype, by_name.argtypes = ctypes.c_void_p, [ctypes.c_char_p]
    kind.restype, kind.argtypes = ctypes.c_int, [ctypes.c_void_p]
    return count, get, name, by_name, kind
