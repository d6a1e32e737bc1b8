"""`python -m cllm.serve`: serve a model over HTTP. With no argument, the default model on
127.0.0.1:8080. Each option comes from a flag, else a CLLM_<NAME> variable, else the TOML file
given by --config (keys as the flags, dashes or underscores), else its default."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, from PyPI
    import tomli as tomllib


from cllm.app.launch import model_sources, serve
from cllm.config import ApiKey, EngineConfig, ServerConfig, parse_api_keys, parse_duration
from cllm.models import named_model


def _flag(value) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def _several(value) -> tuple[str, ...]:
    """An option that may be given several times: flags repeated, a TOML list, or a variable's
    values separated by commas."""
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(str(v) for v in value)
    return tuple(v.strip() for v in str(value).split(",") if v.strip())


# option name → (type, default, help); the defaults are the config dataclasses'.
_ENGINE, _SERVER = EngineConfig(), ServerConfig()
OPTIONS = {
    "model": (_several, None,
              f"GGUF path or alias ({_ENGINE.model}, gemma3-270m), optionally NAME=either; "
              "repeat it to serve several models, each loaded on its first request"),
    "models_dir": (str, None, "serve every .gguf file of this folder too, each by its file name"),
    "served_model_name": (str, None, "the model's name in the API (default: the --model alias "
                          "or file name); with one model only"),
    "keep_alive": (parse_duration, None,
                   "how long an idle model stays loaded: seconds, or 30s, 5m, 1h; 0 unloads it "
                   "after its last request, a negative value never (default: never with one "
                   "model, 5m with several)"),
    "models_max": (int, _SERVER.models_max,
                   "models loaded at once (0: no cap); the least recently used idle one unloads "
                   "to make room"),
    "pin": (_several, None, "a model's name that stays loaded (repeat it for several); pinned "
            "models load as the server starts"),
    "host": (str, _SERVER.host, "address to bind; 0.0.0.0 exposes the server to the network"),
    "port": (int, _SERVER.port, "port to listen on"),
    "parallel": (int, _ENGINE.n_parallel, "sequences decoded together (seq ids)"),
    "ctx_size": (int, _ENGINE.n_ctx, "KV cache cells in all (n / parallel per sequence)"),
    "kv_unified": (_flag, _ENGINE.kv_unified,
                   "one KV pool for all sequences (--no-kv-unified: ctx-size / parallel each; "
                   "default: split on a CPU, one pool on a GPU)"),
    "backend_sampling": (_flag, _ENGINE.backend_sampling,
                         "sample on the device: greedy and temperature-only requests inside "
                         "llama.cpp's graph, those with top-k, top-p or min-p just after it, so "
                         "their logits never reach the host (default: on a GPU, off on a CPU)"),
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
    "cache_ram": (int, _ENGINE.cache_ram,
                  "MiB of host RAM for prefixes evicted from the KV cache, loaded back when a "
                  "prompt starts with one (0: off; default: an eighth of the memory available at "
                  "start, at most 8192)"),
    "cache_dir": (str, _ENGINE.cache_dir,
                  "folder for prefixes evicted from RAM, and for every cached prefix at a clean "
                  "shutdown: a restarted server starts from them (default: none)"),
    "cache_disk": (int, _ENGINE.cache_disk, "MiB of files in --cache-dir, oldest removed first"),
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
    "api_key_file": (str, None, "API keys, one a line, each optionally with name=NAME "
                     "weight=W priority=P: the user its requests count for in the fair shares, "
                     "its weight there, the lowest priority value it may ask for"),
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
    "tokenize_timeout": (float, _SERVER.tokenize_timeout,
                         "seconds a request's text may take to tokenize, its wait for the "
                         "tokenizer included (503 past it)"),
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
                       "replicas (docs/design/scale-out.md) [one per replica, or per "
                       "--max-replicas]"),
    "routing": (str, "prefix", "prefix: a conversation's or a prompt prefix's requests go to "
                "one replica, within a load bound; random: Ray's power of two choices"),
    "gpus_per_replica": (float, None, "GPUs each replica takes [1 if the cluster has GPUs, "
                         "else 0]"),
}


# --help's sections, in order: what most users set first, the rules the server sets itself
# (defaults chosen by the device, docs/design/ says why) in "tuning".
GROUPS = {
    "model": ("model", "models_dir", "served_model_name", "keep_alive", "models_max", "pin",
              "n_gpu_layers"),
    "server and security": ("host", "port", "api_key", "api_key_file", "request_timeout",
                            "max_queue", "max_body_bytes", "client_timeout", "max_connections",
                            "shutdown_grace", "template_timeout", "tokenize_timeout",
                            "log_level"),
    "KV cache and scheduling": ("parallel", "ctx_size", "kv_unified", "prefix_cache",
                                "cache_replies", "cache_prompts", "cache_ram", "cache_dir",
                                "cache_disk", "batch_size"),
    "tuning": ("threads", "cpu_wait", "flash_attn", "backend_sampling", "ubatch_size",
               "prefill_stagger", "decode_steps", "successor_wait", "stream_interval"),
    "scale-out (Ray Serve)": ("replicas", "ray_address", "min_replicas", "max_replicas",
                              "target_ongoing_requests", "max_ongoing_requests",
                              "front_replicas", "routing", "gpus_per_replica"),
}


def parse_args(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m cllm.serve", description=__doc__)
    parser.add_argument("--config", type=Path, help="TOML file of options "
                        "(docs/cllm.example.toml: each one, commented)")
    for title, names in GROUPS.items():
        group = parser.add_argument_group(title)
        for name in names:
            type_, default, help_ = OPTIONS[name]
            flag, help_ = "--" + name.replace("_", "-"), f"{help_} [{default}]"
            if type_ is _flag:
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                                   help=help_)
            elif type_ is _several:
                group.add_argument(flag, action="append", default=None, help=help_)
            else:
                group.add_argument(flag, type=type_, default=None, help=help_)
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
    models = _several(options["model"])
    first = named_model(models[0])[1] if models else _ENGINE.model
    engine = EngineConfig(
        model=first, n_ctx=options["ctx_size"], n_parallel=options["parallel"],
        n_batch=options["batch_size"], n_ubatch=options["ubatch_size"],
        prefill_stagger=options["prefill_stagger"],
        n_threads=options["threads"],
        cpu_wait=options["cpu_wait"],
        kv_unified=options["kv_unified"], backend_sampling=options["backend_sampling"],
        prefix_cache=options["prefix_cache"], cache_replies=options["cache_replies"],
        cache_prompts=options["cache_prompts"], cache_ram=options["cache_ram"],
        cache_dir=options["cache_dir"], cache_disk=options["cache_disk"],
        n_gpu_layers=options["n_gpu_layers"],
        flash_attn=options["flash_attn"], max_queue=options["max_queue"],
        decode_steps=options["decode_steps"], successor_wait=options["successor_wait"],
        request_timeout=options["request_timeout"])
    api_key, api_keys = _api_keys(options)
    return ServerConfig(host=options["host"], port=options["port"], api_key=api_key,
                        api_keys=api_keys,
                        served_model_name=options["served_model_name"],
                        models=models, models_dir=options["models_dir"],
                        keep_alive=options["keep_alive"], models_max=options["models_max"],
                        pinned=_several(options["pin"]),
                        max_body_bytes=options["max_body_bytes"],
                        shutdown_grace=options["shutdown_grace"],
                        template_timeout=options["template_timeout"],
                        tokenize_timeout=options["tokenize_timeout"],
                        client_timeout=options["client_timeout"],
                        max_connections=options["max_connections"],
                        stream_interval=options["stream_interval"], engine=engine)


def _api_keys(options: dict) -> tuple[str | None, tuple[ApiKey, ...]]:
    """--api-key, or the keys of --api-key-file: a key in the command line can be read by
    every local user (/proc/*/cmdline), one in a file or in CLLM_API_KEY cannot."""
    path = options["api_key_file"]
    if path is None:
        return options["api_key"], ()
    if options["api_key"] is not None:
        raise ValueError("give --api-key or --api-key-file, not both")
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read the API key file {path}: {exc.strerror}") from None
    try:
        keys = parse_api_keys(text)
    except ValueError as exc:
        raise ValueError(f"the API key file {path}, {exc}") from None
    if not keys:
        raise ValueError(f"the API key file {path} is empty")
    return None, keys


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    logging.basicConfig(level=options["log_level"].upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = build_config(options)
        sources = model_sources(config)
    except (ValueError, RuntimeError) as exc:
        print(f"cllm: error: {exc}", file=sys.stderr)
        return 2
    if options["replicas"] or options["ray_address"] or options["max_replicas"]:
        if len(sources) > 1:
            print("cllm: error: a scale-out serves one model", file=sys.stderr)
            return 2
        if options["ray_address"] is None:  # a joined cluster has the environment it started with
            from cllm.scaleout.environment import prepare_local_ray
            prepare_local_ray()  # before Ray is imported, which reads it
        try:
            from cllm.scaleout.cluster import (
                serve_on_ray,  # Ray is an extra: imported when asked for
            )
        except ModuleNotFoundError as exc:
            print(f"cllm: error: --replicas and --ray-address need Ray ({exc}): "
                  "pip install 'cllm[ray]'", file=sys.stderr)
            return 2
        return serve_on_ray(config, options)
    return serve(config, sources)


if __name__ == "__main__":
    sys.exit(main())
