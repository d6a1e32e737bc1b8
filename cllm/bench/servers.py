"""Starting the servers under test as child processes and waiting until they answer /health."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cllm.config import EngineConfig

ENGINE_DEFAULTS = EngineConfig()  # the servers started here default to cllm's settings


@dataclass(slots=True)
class ServerSettings:
    """What cllm and llama-server are both started with, so they run the same configuration
    (but the KV layout: each server's own unless asked)."""
    parallel: int
    ctx_size: int = 8192  # KV cells in all: split over the sequences unless kv_unified
    kv_unified: bool = False
    threads: int = 1
    batch_size: int = ENGINE_DEFAULTS.n_batch
    ubatch_size: int = ENGINE_DEFAULTS.n_ubatch
    flash_attn: str = ENGINE_DEFAULTS.flash_attn
    n_gpu_layers: int = ENGINE_DEFAULTS.n_gpu_layers
    peer_args: tuple[str, ...] = ()  # llama-server only: e.g. its backend sampling, -bs
    cllm_args: tuple[str, ...] = ()  # cllm only: e.g. --stream-interval 4
    # llama-server's layout: its own default, split, unless asked; also its faster one on every
    # workload measured (e.g. 2,834 against 1,029-1,302 tok/s at 64 streams on an H200), and
    # the peer runs at its best, whatever cllm's layout.
    peer_kv_unified: bool = False


@dataclass(slots=True)
class StartedServer:
    name: str
    url: str
    process: subprocess.Popen
    log_path: Path

    def stop(self, grace: float = 30.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def free_port() -> int:
    """A port that was free a moment ago; the server binds it right after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_process(name: str, command_for_port: Callable[[int], list[str]], log_dir: Path,
                  timeout: float = 900.0) -> StartedServer:
    """Starts the command on a free port, its output going to a log file, and waits for health."""
    port = free_port()
    command = command_for_port(port)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    say(f"starting {name}: {' '.join(command)} (log: {log_path})")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    server = StartedServer(name, f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(server, timeout)
    except BaseException:
        server.stop(grace=5.0)
        raise
    return server


def wait_healthy(server: StartedServer, timeout: float) -> None:
    """Polls GET /health until 200; a process that exits first is reported with its log's tail."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise SystemExit(f"{server.name} exited with code {server.process.returncode} before "
                             f"it was ready; last lines of {server.log_path}:\n"
                             + _tail(server.log_path))
        if _health_ok(server.url):
            return
        time.sleep(0.25)
    raise SystemExit(f"{server.name} did not answer /health with 200 within {timeout:.0f} s; "
                     f"see {server.log_path}")


def _health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False  # not listening yet, or 503 while the model loads


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def cllm_flags(model: str, s: ServerSettings) -> list[str]:
    """`cllm.serve`'s options for these settings: the started server's, and the engine's that
    --engine-direct measures, so that the two differ only by the HTTP path."""
    return ["--model", model, "--parallel", str(s.parallel), "--ctx-size", str(s.ctx_size),
            "--kv-unified" if s.kv_unified else "--no-kv-unified",
            "--batch-size", str(s.batch_size), "--ubatch-size", str(s.ubatch_size),
            "--threads", str(s.threads),
            "--n-gpu-layers", str(s.n_gpu_layers), "--flash-attn", s.flash_attn, *s.cllm_args]


def cllm_command(model: str, port: int, s: ServerSettings) -> list[str]:
    return [sys.executable, "-m", "cllm.serve", "--host", "127.0.0.1", "--port", str(port),
            *cllm_flags(model, s)]


def start_cllm(model: str, s: ServerSettings, log_dir: Path) -> StartedServer:
    return start_process("cllm", lambda port: cllm_command(model, port, s), log_dir)


def say(message: str) -> None:
    print(f"[cllm.bench] {message}", file=sys.stderr, flush=True)
