"""The server's launch: the app for a configuration (its model resolved and checked, the engine
loaded once the server is up) and uvicorn running it, with cllm's shutdown and header deadline.
The command line (serve.py) and Ray's replicas (scaleout/ray_app.py) start servers through it."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from cllm.config import ServerConfig, apply_cpu_wait
from cllm.errors import APIError
from cllm.models import ModelSource, check_names, named_model, resolve_model


def check_model_file(path: Path) -> None:
    """The plain mistakes (no such file, not a GGUF file) as one line, before the server starts;
    the loader still reports a file that only looks like GGUF."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise ValueError(f"cannot read the model file {path}: {exc.strerror}") from None
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (it starts with {magic!r})")


def served_name(argument: str, model_path: Path) -> str:
    """The alias given to --model, else the model file's name."""
    return argument if not Path(argument).suffix else model_path.name


def model_sources(config: ServerConfig) -> list[ModelSource]:
    """Every model of the configuration, resolved and checked: each --model (an alias, a path,
    or NAME=either), then each GGUF file of --models-dir; a single --model may be renamed by
    --served-model-name."""
    arguments = list(config.models or (() if config.models_dir else (config.engine.model,)))
    if config.models_dir:
        folder = Path(config.models_dir).expanduser()
        if not folder.is_dir():
            raise ValueError(f"--models-dir {folder} is not a folder")
        arguments += sorted(str(p) for p in folder.glob("*.gguf"))
        if not arguments:
            raise ValueError(f"--models-dir {folder} holds no .gguf file")
    sources = []
    for argument in arguments:
        name, given = named_model(argument)
        path = resolve_model(given)
        check_model_file(path)
        sources.append(ModelSource(name or served_name(given, path), given, str(path)))
    if config.served_model_name:
        if len(sources) > 1:
            raise ValueError("--served-model-name names the only model; name each of several "
                             "as --model NAME=PATH")
        sources[0] = dataclasses.replace(sources[0], name=config.served_model_name)
    check_names(sources, config.pinned)
    return sources


class _Server(uvicorn.Server):
    """uvicorn, with two changes to how a signal stops it:
    - when the grace period ends, requests still running get a stated 503 (their sequences end
      with reason 'shutdown') instead of being cut off by uvicorn's task cancellation, which
      would reach clients as a bare 500 or a truncated stream;
    - the process then exits 0: uvicorn re-raises the signal once it has shut down, which with
      the default handler would kill the process (status -15) after a clean shutdown."""

    def __init__(self, config: uvicorn.Config, grace: float) -> None:
        super().__init__(config)
        self.grace = grace

    def run(self, sockets=None) -> None:
        # Handlers uvicorn saves and calls again after its shutdown (and that a signal arriving
        # before uvicorn installs its own honours).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._exit_requested)
        super().run(sockets)

    def _exit_requested(self, sig, frame) -> None:
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        loop = asyncio.get_running_loop()
        stopping: list[asyncio.Task] = []
        deadline = loop.call_later(self.grace, lambda: stopping.append(
            loop.create_task(self.config.app.state.cllm.stop())))
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()
            if stopping:
                await stopping[0]


MAX_HEADER_BYTES = 16 * 1024  # a request's line and headers (h11's default, made explicit)
KEEP_ALIVE_TIMEOUT = 5.0  # seconds an idle connection stays open between requests


def header_deadline_protocol(timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline for each request's headers, and a bound on their
    size. uvicorn times out only idle keep-alive connections, and any byte received stops that
    clock: a client that stalls mid-headers (slowloris) would hold its connection, and a file
    descriptor, forever. h11 bounds only headers still incomplete: a request whose line and
    headers, over MAX_HEADER_BYTES, arrive in one read would pass; they get a 431 here."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _head: bytes | None = None  # a request's line and headers so far; None: past them

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._head is not None:
                self._head += data
                end = self._head.find(b"\r\n\r\n")
                if (len(self._head) if end < 0 else end + 4) > MAX_HEADER_BYTES:
                    self._refuse_headers()
                    return
                if end >= 0:
                    self._head = None
            super().data_received(data)

        def on_response_complete(self) -> None:
            self._arm()  # for the next request's headers on this connection
            super().on_response_complete()  # may start a pipelined request: handle_events

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:  # a request runs
                self._deadline.cancel()

        def connection_lost(self, exc) -> None:
            self._deadline.cancel()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline = self.loop.call_later(timeout, self.transport.close)
            self._head = b""

        def _refuse_headers(self) -> None:
            body = json.dumps(APIError(431, f"the request line and headers exceed "
                                       f"{MAX_HEADER_BYTES} bytes", code="headers_too_large"
                                       ).body()).encode()
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                 b"content-type: application/json\r\nconnection: close\r\n"
                                 b"content-length: %d\r\n\r\n%s" % (len(body), body))
            self.transport.close()
            self._head = None

    return HeaderDeadlineProtocol


def app_for(config: ServerConfig, sources: list[ModelSource] | None = None,
            on_load_failure=None):
    """The server's app for `config` (app.server.create_app), its models loading once it
    starts or on demand; they are resolved here unless given. Ray's replicas
    (scaleout/ray_app.py) build theirs so."""
    if sources is None:
        sources = model_sources(config)
    # Loads llama.cpp: only once the arguments are known good and the CPU wait policy is set.
    from cllm.app.server import create_app
    from cllm.engine.engine import Engine
    return create_app(config, sources,
                      lambda path, on_model: Engine(config.engine, path, on_model),
                      on_load_failure=on_load_failure)


def serve(config: ServerConfig, sources: list[ModelSource]) -> int:
    mode = apply_cpu_wait(config.engine.cpu_wait, config.engine.n_threads)
    logging.getLogger("cllm.serve").info("CPU threads wait by: %s", mode)
    load_failures: list[BaseException] = []

    def on_load_failure(exc: BaseException) -> None:
        load_failures.append(exc)
        server.should_exit = True

    app = app_for(config, sources, on_load_failure)
    # uvicorn's own deadline is a backstop: at shutdown_grace the requests get their 503s.
    server = _Server(uvicorn.Config(
        app, host=config.host, port=config.port, access_log=False, log_config=None,
        http=header_deadline_protocol(config.client_timeout),
        limit_concurrency=config.max_connections, timeout_keep_alive=KEEP_ALIVE_TIMEOUT,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=config.shutdown_grace + 10), grace=config.shutdown_grace)
    server.run()
    code = 1 if load_failures else 0
    state = getattr(app.state, "cllm", None)  # none if the server never started
    if state is not None and state.busy:
        _exit_now(code)
    return code


def _exit_now(code: int) -> None:
    """Exit without waiting for threads still tokenizing or rendering a prompt. Their clients
    had their 503s at the grace, but llama.cpp cannot interrupt a tokenization (a long text
    takes seconds), the interpreter waits for a pool's threads at exit, and C++'s static
    destructors must not run under a thread still reading llama.cpp's tables: the process
    leaves them, as a kill would, so the grace bounds the shutdown."""
    logging.getLogger("cllm.serve").info("exiting with tokenizing or rendering still running")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
