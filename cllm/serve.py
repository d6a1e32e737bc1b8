"""`python -m cllm.serve`: serve a model over HTTP. With no argument, the default model on
127.0.0.1:8080. Each option comes from a flag, else a CLLM_<NAME> variable, else the TOML file
given by --config (keys as the flags, dashes or underscores), else its default."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from cllm.config import EngineConfig, ServerConfig, apply_cpu_wait
from cllm.models import resolve_model


def _flag(value) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


# option name → (type, default, help); the defaults are the config dataclasses'.
_ENGINE, _SERVER = EngineConfig(), ServerConfig()
OPTIONS = {
    "model": (str, _ENGINE.model, "GGUF path or alias (smollm2-135m-instruct, gemma3-270m)"),
    "served_model_name": (str, None, "the model's name in the API (default: the --model alias "
                          "or file name)"),
    "host": (str, _SERVER.host, "address to bind; 0.0.0.0 exposes the server to the network"),
    "port": (int, _SERVER.port, "port to listen on"),
    "parallel": (int, _ENGINE.n_parallel, "sequences decoded together (seq ids)"),
    "ctx_size": (int, _ENGINE.n_ctx, "KV cache cells in all (n / parallel per sequence)"),
    "kv_unified": (_flag, _ENGINE.kv_unified,
                   "one KV pool for all sequences (--no-kv-unified: ctx-size / parallel each; "
                   "default: split on a CPU, one pool on a GPU)"),
    "backend_sampling": (_flag, _ENGINE.backend_sampling,
                         "sample greedy requests inside llama.cpp's graph on the device, so their "
                         "logits never reach the host (default: on a GPU, off on a CPU)"),
    "prefix_cache": (_flag, _ENGINE.prefix_cache,
                     "start requests from cached KV of the prompt prefixes they share"),
    "cache_replies": (str, _ENGINE.cache_replies,
                      "whether finished requests' replies stay cached in one KV pool, where every "
                      "step attends over them: auto (while recent requests continue earlier "
                      "replies, as chats do), keep or drop"),
    "cache_prompts": (str, _ENGINE.cache_prompts,
                      "whether finished requests' prompts stay cached in one KV pool: auto (while "
                      "recent requests start from prompts no running request holds, as repeated "
                      "documents and chats do), keep or drop"),
    "batch_size": (int, _ENGINE.n_batch, "tokens per step (decodes + prefill chunks)"),
    "ubatch_size": (int, _ENGINE.n_ubatch, "tokens per llama.cpp micro-batch"),
    "prefill_stagger": (int, _ENGINE.prefill_stagger,
                        "prompt tokens a step may spend ending prompts besides the first it ends, "
                        "so that requests arriving together get first tokens a step apart "
                        "(0: 16 on a CPU, the batch size on a GPU)"),
    "threads": (int, _ENGINE.n_threads, "CPU threads (0: every usable core)"),
    "cpu_wait": (str, _ENGINE.cpu_wait,
                 "how CPU threads wait for each other: spin (fastest on an idle machine), sleep "
                 "(graceful beside other busy processes), auto (sleep when --threads takes "
                 "every core)"),
    "n_gpu_layers": (int, _ENGINE.n_gpu_layers, "layers offloaded to the GPU (-1: all)"),
    "flash_attn": (str, _ENGINE.flash_attn, "flash attention: on, off or auto"),
    "api_key": (str, _SERVER.api_key, "require 'Authorization: Bearer KEY' (all but /health); "
                "a flag is visible to local users, so prefer CLLM_API_KEY or --api-key-file"),
    "api_key_file": (str, None, "read the API key from this file"),
    "request_timeout": (float, _ENGINE.request_timeout, "seconds a request may take in all"),
    "max_queue": (int, _ENGINE.max_queue, "waiting requests before 429"),
    "decode_steps": (int, _ENGINE.decode_steps,
                     "decode steps per call into C while only decodes run (0: 8 on GPU, 1 on CPU)"),
    "successor_wait": (float, _ENGINE.successor_wait,
                       "after a step that ended requests, wait up to this share of a step's time "
                       "for new ones (a client's next request), while recent ends were followed by "
                       "one that soon (0 to 1; default: 0.5 on a CPU, 0 on a GPU)"),
    "stream_interval": (int, _SERVER.stream_interval,
                        "tokens a streamed event carries at most: the first token at once, then "
                        "this many at a time"),
    "max_body_bytes": (int, _SERVER.max_body_bytes, "largest request body (413 above)"),
    "shutdown_grace": (float, _SERVER.shutdown_grace, "seconds in-flight requests get on SIGTERM"),
    "template_timeout": (float, _SERVER.template_timeout,
                         "seconds the chat template may take to render a prompt (400 past it)"),
    "client_timeout": (float, _SERVER.client_timeout,
                       "seconds a client may take to send a request's headers, and its body"),
    "max_connections": (int, _SERVER.max_connections,
                        "open connections before new requests get 503 (keep under `ulimit -n`)"),
    "log_level": (str, "info", "debug, info, warning or error"),
    # Scale-out on Ray Serve (pip install "cllm[ray]"; README.md, "Scale-out")
    "replicas": (int, 0, "engines behind this endpoint, on Ray Serve (0: this process alone)"),
    "ray_address": (str, None, "join this Ray cluster (e.g. auto, or HEAD_IP:6379) instead of "
                    "starting a local one"),
    "min_replicas": (int, None, "autoscale from this many replicas (with --max-replicas)"),
    "max_replicas": (int, None, "autoscale up to this many replicas"),
    "target_ongoing_requests": (float, None, "requests per replica the autoscaler aims at "
                                "[--parallel]"),
    "max_ongoing_requests": (int, None, "requests a replica takes at once; more wait in Ray's "
                             "router [2 x --parallel]"),
    "front_replicas": (int, None, "processes that read, route and relay requests to the "
                       "replicas (ARCHITECTURE.md, Scale-out) [one per replica, or per "
                       "--max-replicas]"),
    "routing": (str, "prefix", "prefix: a conversation's or a prompt prefix's requests go to "
                "one replica, within a load bound; random: Ray's power of two choices"),
    "gpus_per_replica": (float, None, "GPUs each replica takes [1 if the cluster has GPUs, "
                         "else 0]"),
}


def parse_args(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m cllm.serve", description=__doc__)
    parser.add_argument("--config", type=Path, help="TOML file of options")
    for name, (type_, default, help_) in OPTIONS.items():
        flag, help_ = "--" + name.replace("_", "-"), f"{help_} [{default}]"
        if type_ is _flag:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                help=help_)
        else:
            parser.add_argument(flag, type=type_, default=None, help=help_)
    args = vars(parser.parse_args(argv))
    file_values = _read_config(args.pop("config"))
    unknown = set(file_values) - set(OPTIONS)
    if unknown:
        parser.error(f"unknown option(s) in the config file: {', '.join(sorted(unknown))}")
    return {name: _pick(name, args[name], file_values) for name in OPTIONS}


def _read_config(path: Path | None) -> dict:
    if path is None:
        return {}
    with open(path, "rb") as f:
        return {key.replace("-", "_"): value for key, value in tomllib.load(f).items()}


def _pick(name: str, flag, file_values: dict):
    type_, default, _ = OPTIONS[name]
    if flag is not None:
        return flag
    env = os.environ.get(f"CLLM_{name.upper()}")
    if env is not None:
        return type_(env)
    return type_(file_values[name]) if name in file_values else default


def build_config(options: dict) -> ServerConfig:
    engine = EngineConfig(
        model=options["model"], n_ctx=options["ctx_size"], n_parallel=options["parallel"],
        n_batch=options["batch_size"], n_ubatch=options["ubatch_size"],
        prefill_stagger=options["prefill_stagger"],
        n_threads=options["threads"],
        cpu_wait=options["cpu_wait"],
        kv_unified=options["kv_unified"], backend_sampling=options["backend_sampling"],
        prefix_cache=options["prefix_cache"], cache_replies=options["cache_replies"],
        cache_prompts=options["cache_prompts"],
        n_gpu_layers=options["n_gpu_layers"],
        flash_attn=options["flash_attn"], max_queue=options["max_queue"],
        decode_steps=options["decode_steps"], successor_wait=options["successor_wait"],
        request_timeout=options["request_timeout"])
    return ServerConfig(host=options["host"], port=options["port"], api_key=_api_key(options),
                        served_model_name=options["served_model_name"],
                        max_body_bytes=options["max_body_bytes"],
                        shutdown_grace=options["shutdown_grace"],
                        template_timeout=options["template_timeout"],
                        client_timeout=options["client_timeout"],
                        max_connections=options["max_connections"],
                        stream_interval=options["stream_interval"], engine=engine)


def _api_key(options: dict) -> str | None:
    """--api-key, or the contents of --api-key-file: a key in the command line can be read by
    every local user (/proc/*/cmdline), one in a file or in CLLM_API_KEY cannot."""
    path = options["api_key_file"]
    if path is None:
        return options["api_key"]
    if options["api_key"] is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    try:
        key = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
    if not key:
        raise ValueError(f"the API key file {path} is empty")
    return key


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    logging.basicConfig(level=options["log_level"].upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(options)
        model_path = resolve_model(config.engine.model)
        check_model_file(model_path)
    except (ValueError, RuntimeError) as exc:
        print(f"cllm: error: {exc}", file=sys.stderr)
        return 2
    if options["replicas"] or options["ray_address"] or options["max_replicas"]:
        if options["ray_address"] is None:  # a joined cluster has the environment it started with
            from cllm.ray_environment import prepare_local_ray
            prepare_local_ray()  # before Ray is imported, which reads it
        try:
            from cllm.cluster import serve_on_ray  # Ray is an extra: imported when asked for
        except ModuleNotFoundError as exc:
            print(f"cllm: error: --replicas and --ray-address need Ray ({exc}): "
                  "pip install 'cllm[ray]'", file=sys.stderr)
            return 2
        return serve_on_ray(config, options)
    return serve(config, model_path)


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


def served_name(config: ServerConfig, model_path: Path) -> str:
    """--served-model-name, else the alias given to --model, else the model file's name."""
    if config.served_model_name:
        return config.served_model_name
    return config.engine.model if not Path(config.engine.model).suffix else model_path.name


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
    """uvicorn's h11 protocol with a deadline for each request's headers. uvicorn times out only
    idle keep-alive connections, and any byte received stops that clock: a client that stalls
    mid-headers (slowloris) would hold its connection, and a file descriptor, forever."""

    class HeaderDeadlineProtocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

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

    return HeaderDeadlineProtocol


def app_for(config: ServerConfig, model_path: Path | None = None, on_load_failure=None):
    """The server's app for `config` (server.create_app), its model loading once it starts;
    the model is resolved here unless given. Ray's replicas (scaleout.py) build theirs so."""
    if model_path is None:
        model_path = resolve_model(config.engine.model)
        check_model_file(model_path)
    from cllm.engine import Engine  # loads llama.cpp: after the arguments are known good
    from cllm.server import create_app
    return create_app(config, lambda: Engine(config.engine, str(model_path)),
                      model_name=served_name(config, model_path), on_load_failure=on_load_failure)


def serve(config: ServerConfig, model_path: Path) -> int:
    mode = apply_cpu_wait(config.engine.cpu_wait, config.engine.n_threads)
    logging.getLogger("cllm.serve").info("CPU threads wait by: %s", mode)
    load_failures: list[BaseException] = []

    def on_load_failure(exc: BaseException) -> None:
        load_failures.append(exc)
        server.should_exit = True

    app = app_for(config, model_path, on_load_failure)
    # uvicorn's own deadline is a backstop: at shutdown_grace the requests get their 503s.
    server = _Server(uvicorn.Config(
        app, host=config.host, port=config.port, access_log=False, log_config=None,
        http=header_deadline_protocol(config.client_timeout),
        limit_concurrency=config.max_connections, timeout_keep_alive=KEEP_ALIVE_TIMEOUT,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_graceful_shutdown=config.shutdown_grace + 10), grace=config.shutdown_grace)
    server.run()
    return 1 if load_failures else 0


if __name__ == "__main__":
    sys.exit(main())
