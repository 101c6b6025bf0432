"""Where a model's layers run (engine/devices.py): the options as llama.cpp's tools take them, the
layout that takes effect on this build, and the fingerprint a store is keyed by."""

import llama_cpp as L
import pytest
from conftest import PROMPTS, SIM
from helpers import adaspark, assert_one_error_line

from adaspark_core.base.errors import InputError
from adaspark_core.engine import devices
from adaspark_core.engine.devices import ALL_LAYERS, DeviceLayout, parse_layout
from adaspark_core.store.fingerprint import fingerprint, fingerprint_key


def test_the_options_as_llama_cpp_takes_them():
    assert parse_layout() == DeviceLayout() and DeviceLayout().local_cpu
    assert parse_layout("24") == DeviceLayout(24)
    assert parse_layout("all").n_gpu_layers == ALL_LAYERS
    lay = parse_layout(None, "CUDA0, CUDA1", "3,1", "10.0.0.2:50052,[::1]:50053")
    assert lay == DeviceLayout(ALL_LAYERS, ("CUDA0", "CUDA1"), (3.0, 1.0), ("10.0.0.2:50052", "[::1]:50053"))
    assert lay.server_args() == ["--n-gpu-layers", "all", "--device", "CUDA0,CUDA1", "--tensor-split", "3,1",
                                 "--rpc", "10.0.0.2:50052,[::1]:50053"]  # llama-server's own words
    assert parse_layout("8", rpc="host-a:1").n_gpu_layers == 8  # a count given is kept


@pytest.mark.parametrize("args, option", [
    (("x",), "--n-gpu-layers"), (("-3",), "--n-gpu-layers"), ((None, "CUDA0,"), "--device"),
    ((None, None, "3,a"), "--tensor-split"), ((None, None, "0,0"), "--tensor-split"),
    ((None, None, "1,-1"), "--tensor-split"), ((None, None, "nan"), "--tensor-split"),
    ((None, None, None, "10.0.0.2"), "--rpc"), ((None, None, None, "h:0"), "--rpc"),
    ((None, None, None, "h:65536"), "--rpc"), ((None, None, None, "h:1,,h:2"), "--rpc"),
    ((None, None, None, "-h:1"), "--rpc")])
def test_a_malformed_option_is_one_input_error_naming_it(args, option):
    with pytest.raises(InputError, match=option):
        parse_layout(*args)


def test_the_layout_that_takes_effect_on_this_cpu_build():
    if devices.offload_targets(L):  # ggml keeps an RPC server's devices for the process's life
        pytest.skip("an earlier test in this process registered RPC servers' devices")
    assert "CPU" in devices.device_names(L)  # (this machine: no GPU)
    assert devices.effective(DeviceLayout(99), L) == DeviceLayout()  # nothing to offload to: the CPU's
    assert devices.effective(parse_layout(device="CPU"), L) == DeviceLayout()
    with pytest.raises(InputError, match="no device 'CUDA0' here .*CPU"):
        devices.effective(parse_layout(device="CUDA0"), L)
    with pytest.raises(InputError, match="cannot reach the RPC server at 127.0.0.1:1 " if L.llama_supports_rpc()
                       else "no RPC backend"):
        devices.effective(parse_layout(rpc="127.0.0.1:1"), L)  # (refused at once: nothing listens there)


def test_a_store_knows_its_layout():
    local = fingerprint(SIM)
    rpc = parse_layout(rpc="10.0.0.2:50052,10.0.0.3:50052")
    split = fingerprint(SIM, layout=rpc.fingerprint())
    assert DeviceLayout().fingerprint() is None and "layout" not in local  # a local store keeps its key
    assert fingerprint_key(split) != fingerprint_key(local)  # a cost table learned here never prices RPC
    assert devices.describe(None) == "local CPU"
    assert devices.describe(split["layout"]) == "all layers offloaded to every device found; " \
                                               "RPC servers 10.0.0.2:50052, 10.0.0.3:50052"
    assert devices.describe(DeviceLayout(12, ("CUDA0",), (1.0,)).fingerprint()) == \
        "12 layers offloaded to CUDA0; split 1"


def test_the_rpc_timeout_bounds_reads_but_is_no_part_of_the_layout():
    assert parse_layout(rpc="h:1", rpc_timeout=5).rpc_timeout == 5
    assert parse_layout(rpc="h:1", rpc_timeout=5) == parse_layout(rpc="h:1")  # it prices nothing
    assert parse_layout(rpc="h:1", rpc_timeout=5).fingerprint() == parse_layout(rpc="h:1").fingerprint()
    for bad in (0, -1, float("nan")):
        with pytest.raises(InputError, match="--rpc-timeout"):
            parse_layout(rpc="h:1", rpc_timeout=bad)


def test_the_connections_to_the_servers_get_the_timeout_and_no_other_socket_does():
    """bound_rpc_reads finds ggml's connections by their peer: here, connections this test opens
    to a listening socket stand for them, and one to another listener must stay unbounded."""
    import socket
    import struct

    servers = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    ours = socket.create_connection(servers[0].getsockname())
    other = socket.create_connection(servers[1].getsockname())
    try:
        layout = parse_layout(rpc=f"127.0.0.1:{servers[0].getsockname()[1]}", rpc_timeout=2.5)
        assert devices.bound_rpc_reads(layout) == 1
        timeout = struct.unpack("@ll", ours.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16))
        assert timeout == (2, 500000)
        assert struct.unpack("@ll", ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16)) == (2, 500000)
        assert struct.unpack("@ll", other.getsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, 16)) == (0, 0)
        ours.sendall(b"still open")  # the descriptor was only borrowed
    finally:
        for sock in (ours, other, *servers):
            sock.close()


def test_the_store_commands_locate_a_layouts_store_without_reaching_its_servers():
    from adaspark_cli.store_cmd import locate

    rpc = parse_layout(rpc="10.0.0.2:50052")  # nothing there: it is not asked
    path, fp = locate(None, SIM, None, layout=rpc)
    assert fp["layout"] == rpc.fingerprint() and path != locate(None, SIM, None)[0]
    if not devices.offload_targets(L):  # this CPU build: GPU layers record the local CPU's store
        assert devices.recorded(parse_layout("all")) == DeviceLayout()
        assert locate(None, SIM, None, layout=parse_layout("all")) == locate(None, SIM, None)


def test_the_commands_refuse_a_bad_layout_in_one_line(tmp_path):
    prompt = next(PROMPTS.glob("*.txt"))
    assert_one_error_line(adaspark("decode", prompt, "--rpc", "10.0.0.2"), "--rpc", "HOST:PORT")
    assert_one_error_line(adaspark("decode", prompt, "--n-gpu-layers", "many"), "--n-gpu-layers")
    assert_one_error_line(adaspark("decode", prompt, "--model", SIM, "--n-gpu-layers", "4"), "simulated", "no device")
    assert_one_error_line(adaspark("profile", "--tensor-split", "0"), "--tensor-split")
    assert_one_error_line(adaspark("compare", "--model", SIM, "--device", "CUDA0"), "simulated")
    assert_one_error_line(adaspark("decode", prompt, "--rpc", "h:1", "--rpc-timeout", "0"), "--rpc-timeout")


@pytest.mark.model
def test_gpu_layers_on_a_cpu_build_decode_as_before_into_the_same_store(tmp_path):
    """This build offloads to nothing: --n-gpu-layers all decodes the same reply as without, and
    learns into a store of the local CPU's layout, which store show names."""
    prompt, store = next(PROMPTS.glob("*.txt")), tmp_path / "s.json"
    plain = adaspark("decode", prompt, "-n", "24", "--store", store)
    offloaded = adaspark("decode", prompt, "-n", "24", "--store", store, "--n-gpu-layers", "all")
    assert plain.returncode == offloaded.returncode == 0, offloaded.stderr
    assert offloaded.stdout == plain.stdout
    shown = adaspark("store", "show", "--store", store)
    assert shown.returncode == 0 and "layout" in shown.stdout and "local CPU" in shown.stdout
