"""`python -m cllm.serve`: serve a model over HTTP. With no argument, the default model on
127.0.0.1:8080. Each option comes from a flag, else a CLLM_<NAME> variable, else the TOML file
given by --config (keys as the flags, dashes or underscores), else its default."""
from __future__ import annotations

import argparse
import logging
import os
import sys
import tomllib
from pathlib import Path

import uvicorn

from cllm.config import EngineConfig, ServerConfig
from cllm.models import resolve_model

# option name → (type, default, help); the defaults are the config dataclasses'.
_ENGINE, _SERVER = EngineConfig(), ServerConfig()
OPTIONS = {
    "model": (str, _ENGINE.model, "GGUF path or alias (smollm2-135m-instruct, gemma3-270m)"),
    "host": (str, _SERVER.host, "address to bind; 0.0.0.0 exposes the server to the network"),
    "port": (int, _SERVER.port, "port to listen on"),
    "parallel": (int, _ENGINE.n_parallel, "sequences decoded together (seq ids)"),
    "ctx_size": (int, _ENGINE.n_ctx, "KV cache cells shared by all sequences"),
    "batch_size": (int, _ENGINE.n_batch, "tokens per step (decodes + prefill chunks)"),
    "ubatch_size": (int, _ENGINE.n_ubatch, "tokens per llama.cpp micro-batch"),
    "threads": (int, _ENGINE.n_threads, "CPU threads (0: all cores)"),
    "n_gpu_layers": (int, _ENGINE.n_gpu_layers, "layers offloaded to the GPU (-1: all)"),
    "flash_attn": (str, _ENGINE.flash_attn, "flash attention: on, off or auto"),
    "api_key": (str, _SERVER.api_key, "require 'Authorization: Bearer KEY' (all but /health)"),
    "request_timeout": (float, _ENGINE.request_timeout, "seconds a request may take in all"),
    "max_queue": (int, _ENGINE.max_queue, "waiting requests before 429"),
    "max_body_bytes": (int, _SERVER.max_body_bytes, "largest request body (413 above)"),
    "shutdown_grace": (float, _SERVER.shutdown_grace, "seconds in-flight requests get on SIGTERM"),
    "log_level": (str, "info", "debug, info, warning or error"),
}


def parse_args(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m cllm.serve", description=__doc__)
    parser.add_argument("--config", type=Path, help="TOML file of options")
    for name, (type_, default, help_) in OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type_, default=None,
                            help=f"{help_} [{default}]")
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
        n_threads=options["threads"], n_gpu_layers=options["n_gpu_layers"],
        flash_attn=options["flash_attn"], max_queue=options["max_queue"],
        request_timeout=options["request_timeout"])
    return ServerConfig(host=options["host"], port=options["port"], api_key=options["api_key"],
                        max_body_bytes=options["max_body_bytes"],
                        shutdown_grace=options["shutdown_grace"], engine=engine)


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    logging.basicConfig(level=options["log_level"].upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(options)
        model_path = resolve_model(config.engine.model)
    except (ValueError, RuntimeError) as exc:
        print(f"cllm: error: {exc}", file=sys.stderr)
        return 2
    return serve(config, model_path)


def serve(config: ServerConfig, model_path: Path) -> int:
    from cllm.engine import Engine  # loads llama.cpp: after the arguments are known good
    from cllm.server import create_app

    load_failures: list[BaseException] = []

    def on_load_failure(exc: BaseException) -> None:
        load_failures.append(exc)
        server.should_exit = True

    app = create_app(config, lambda: Engine(config.engine, str(model_path)),
                     model_name=config.engine.model if not Path(config.engine.model).suffix
                     else model_path.name, on_load_failure=on_load_failure)
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, access_log=False, log_config=None,
        timeout_graceful_shutdown=config.shutdown_grace))
    server.run()
    return 1 if load_failures else 0


if __name__ == "__main__":
    sys.exit(main())
