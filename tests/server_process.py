"""Start and stop a real `python -m cllm.serve` process for the HTTP tests.

The server runs the working tree's Python code (the tree comes first on its path); its native
extension comes from the installed copy where the tree has none, as `cllm/__init__.py` finds
it for any process that imports the tree."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai

from cllm.bench.servers import free_port

REPO = Path(__file__).resolve().parent.parent

def serve_command() -> list[str]:
    """The argv prefix that runs the working tree's `cllm.serve` (options follow)."""
    return [sys.executable, "-m", "cllm.serve"]


def server_env() -> dict[str, str]:
    """The environment without CLLM_* options (they would override the defaults tests rely
    on), the model cache location excepted, and with the working tree first on the path."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("CLLM_") or k == "CLLM_CACHE_DIR"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def listening(port: int) -> dict[str, str]:
    """What listens on this machine's TCP `port`: each local address, in /proc/net/tcp's hex
    (127.0.0.1 is 0100007F), and its socket's inode."""
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            fields = row.split()
            address, port_hex = fields[1].rsplit(":", 1)
            if int(port_hex, 16) == port and fields[3] == "0A":  # LISTEN
                found[address] = fields[9]
    return found


def listening_process(port: int) -> str:
    """The name of the process listening on this machine's TCP `port`, or ""."""
    sockets = {f"socket:[{inode}]" for inode in listening(port).values()}
    for proc in Path("/proc").iterdir():
        try:
            if any(os.readlink(fd) in sockets for fd in (proc / "fd").iterdir()):
                return (proc / "comm").read_text().strip()
        except (OSError, ValueError):
            continue
    return ""


class ServerProcess:
    """A `python -m cllm.serve` child on a free 127.0.0.1 port; its stdout and stderr go to
    files read by `.stdout`, `.stderr` and `.log`. Use as a context manager, or call start()
    and stop(). `args` are extra command-line options. Unless they say otherwise the server
    decodes with one thread: on a small machine shared with other work, llama.cpp's threads
    spinning against each other make every step many times slower."""

    def __init__(self, *args: str, startup_timeout: float = 120.0) -> None:
        self.args = list(args)
        if "--threads" not in self.args:
            self.args += ["--threads", os.environ.get("CLLM_TEST_THREADS", "1")]
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="cllm-server-")
        self._out = Path(self._dir.name) / "stdout.log"
        self._err = Path(self._dir.name) / "stderr.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def http_client(self, timeout: float = 120, api_key: str | None = None) -> httpx.Client:
        """A plain HTTP client on this server, sending `api_key` as a bearer token if given."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        return httpx.Client(base_url=self.url, timeout=timeout, headers=headers)

    def openai_client(self, timeout: float = 120, api_key: str = "unused") -> openai.OpenAI:
        """The official SDK on this server, retrying nothing (a test sees every answer)."""
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=timeout)

    @property
    def stdout(self) -> str:
        return self._out.read_text(errors="replace") if self._out.exists() else ""

    @property
    def stderr(self) -> str:
        return self._err.read_text(errors="replace") if self._err.exists() else ""

    @property
    def log(self) -> str:
        return self.stdout + self.stderr

    def spawn(self) -> ServerProcess:
        """Start the process without waiting for it to be ready."""
        self.port = free_port()
        with open(self._out, "wb") as out, open(self._err, "wb") as err:
            self.proc = subprocess.Popen(
                serve_command() + ["--port", str(self.port), *self.args],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=server_env(),
                cwd=self._dir.name)
        return self

    def start(self) -> ServerProcess:
        """Start the process and wait until GET /health answers 200 (the model is loaded)."""
        for _ in range(3):  # another process may take the free port before the child binds it
            self.spawn()
            try:
                self.wait_ready()
                return self
            except RuntimeError:
                if "address already in use" not in self.log.lower():
                    raise
                self.proc.wait()
        raise RuntimeError(f"no free port for the server:\n{self.log}")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode} before it "
                                       f"was ready:\n{self.log}")
                try:
                    if client.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"the server was not ready within {self.startup_timeout}s:\n{self.log}")

    def terminate(self) -> None:
        """Send SIGTERM without waiting."""
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """The exit code; kills the process and raises TimeoutError if it runs past `timeout`."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"the server did not exit within {timeout}s:\n{self.log}") from None

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then the exit code once the process has exited."""
        if self.proc is None:
            raise RuntimeError("the server was never started")
        if self.proc.poll() is None:
            self.terminate()
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        try:
            if self.proc is not None and self.proc.poll() is None:
                self.stop()
        finally:
            self.kill()
            self._dir.cleanup()
