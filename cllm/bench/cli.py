"""The command line of `python -m cllm.bench`."""
from __future__ import annotations

import argparse
import math
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from . import users
from .loadgen import Level, LoadSettings
from .servers import ENGINE_DEFAULTS, ServerSettings
from .stats import SLO_METRICS
from .workloads import MIXED_TOKENS, WORKLOADS

PEERS = ("llama-server",)
PEER_KV_LAYOUTS = ("split", "unified")
DEFAULT_CONCURRENCY = (1, 8, 16, 32)
DEFAULT_MAX_TOKENS = 50
# Workloads over the chat endpoint, and what each sends there.
CHAT_WORKLOADS = {"multi-turn": "sends message histories",
                  "structured": "sends response_format",
                  "mixed-users": "sends a person's chat turns"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m cllm.bench",
        description="Load benchmark for OpenAI-compatible servers: cllm against llama-server, "
                    "or any --url. Levels run one after another; at each level every server "
                    "is measured in turn, so drift on the machine hits them alike.")
    targets = p.add_argument_group("servers")
    targets.add_argument("--url", action="append", default=[],
                         help="an already-running server (repeatable)")
    targets.add_argument("--cllm", action="store_true", help="start `python -m cllm.serve`")
    targets.add_argument("--peer", choices=PEERS,
                         help="build (cached) and start llama-server from the pinned llama.cpp")
    targets.add_argument("--engine-direct", action="store_true",
                         help="also measure cllm's Engine in this process, without HTTP "
                              "(series cllm-engine; raw prompts, no chat template)")
    targets.add_argument("--model",
                         help="servers started here: the model to load (alias or GGUF path, "
                              "default: cllm's default alias); --url servers: the model field "
                              "sent (default: the first of GET /v1/models)")
    load = p.add_argument_group("load")
    load.add_argument("--requests", type=_positive, default=72, help="per level (default 72)")
    load.add_argument("--concurrency", type=_positive, nargs="+",
                      help="closed-loop levels: requests kept in flight, each level run "
                           "separately (default 1 8 16 32)")
    load.add_argument("--request-rate", type=_rate, nargs="+",
                      help="open-loop levels instead: Poisson arrivals at these rates, "
                           "requests a second (inf: all at once), sent whether or not earlier "
                           "ones have finished")
    load.add_argument("--max-concurrency", type=_positive,
                      help="with --request-rate: at most this many requests in flight")
    load.add_argument("--goodput", nargs="+", metavar="METRIC:MS", type=_slo,
                      help="report goodput, the requests a second that meet every bound: "
                           f"{', '.join(m + ':MS' for m in SLO_METRICS)} (e.g. ttft:500 "
                           "tpot:50)")
    load.add_argument("--runs", type=_positive, default=1,
                      help="measure each level this many times, to show the spread "
                           "(default 1)")
    load.add_argument("--max-tokens", type=_positive,
                      help=f"default {DEFAULT_MAX_TOKENS}; mixed-users: the batch's, default "
                           f"{users.BATCH_MAX_TOKENS}")
    load.add_argument("--sampling", type=_sampling, nargs="+", metavar="SPEC",
                      help="how requests sample, each SPEC a series of its own at every level: "
                           "greedy, or fields among t=TEMPERATURE, p=TOP_P, k=TOP_K, "
                           "minp=MIN_P (e.g. t=0.7,p=0.95,k=0); a field left out is not sent, "
                           "so each server keeps its default (llama-server: top-k 40, top-p "
                           "0.95, min-p 0.05; cllm: none). Default: greedy t=1,k=0 "
                           "t=0.7,p=0.95,k=0 t=1, the same parameters for every server "
                           "(mixed-users: one SPEC, default greedy)")
    load.add_argument("--seed", type=_non_negative, default=0,
                      help="which series of generated prompts, conversations and arrivals "
                           "(default 0): benchmark processes loading one server together need "
                           "their own, or they send the same prompts at the same time")
    load.add_argument("--workload", choices=WORKLOADS, default="standard",
                      help="standard: the prompts below; shared-prefix: one long document (or "
                           "--documents), a different question after it each request; "
                           "multi-turn: chat conversations, each turn resending the history; "
                           f"mixed: prompts of {MIXED_TOKENS[0]} to {MIXED_TOKENS[1]:,} "
                           "tokens, log-uniform; "
                           "sharegpt: prompt and output lengths shaped like ShareGPT's chats, "
                           "or from --dataset-path; structured: tickets to triage, each server "
                           "measured free, with a JSON schema, and free with the schema's "
                           "reply lengths; mixed-users: two users on one server, each "
                           "sending its own API key (--users-shape) (default standard)")
    load.add_argument("--dataset-path", type=Path,
                      help="sharegpt: a ShareGPT-style JSON file to take prompts and output "
                           "lengths from")
    source = load.add_mutually_exclusive_group()
    source.add_argument("--prompt-tokens", type=_positive,
                        help="standard workload: synthetic prompts of about N tokens, all "
                             "different; mixed-users: its users' prompts (default "
                             f"{users.BATCH_PROMPT_TOKENS})")
    source.add_argument("--prompt-file", type=Path,
                        help="standard workload: one prompt per line")
    load.add_argument("--prefix-tokens", type=_positive, default=1400,
                      help="shared-prefix: the document's length in tokens (default 1400)")
    load.add_argument("--documents", type=_positive, default=1,
                      help="shared-prefix: documents to ask about, each request about one drawn "
                           "at random (default 1); more than one replica's prefix cache holds "
                           "is where prefix-aware routing matters")
    load.add_argument("--turns", type=_positive, default=10,
                      help="multi-turn: turns per conversation (default 10); a level runs "
                           "--requests / --turns conversations, at least as many as the "
                           "concurrency")
    load.add_argument("--cache-prompt", action=argparse.BooleanOptionalAction,
                      help="send cache_prompt true or false in every request (default: not "
                           "sent, each server's own default holds)")
    load.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True)
    load.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                      help="generate exactly --max-tokens (default on)")
    load.add_argument("--endpoint", choices=("completions", "chat"),
                      help="default: chat for multi-turn, else completions")
    load.add_argument("--warmup", type=_non_negative, default=4,
                      help="requests sent and discarded before each level (default 4)")
    load.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    two = p.add_argument_group("two users (--workload mixed-users)")
    two.add_argument("--users-shape", choices=users.SHAPES,
                     help="batch-chat (default): a batch user keeps "
                          f"{users.BATCH_PER_SLOT} requests a slot (--parallel, default "
                          f"{users.SLOTS}) in flight, --requests of them, while a person "
                          f"sends a chat turn every {users.CHAT_EVERY:g} s ({users.CHAT_TOKENS} "
                          "tokens); reports the person's TTFT beside the batch against as "
                          "many turns on the idle server, and the batch's throughput against "
                          "running alone. backlogged: a big user sends --requests requests at "
                          f"once, then a small user {users.VOLUMES} times fewer, all alike; "
                          "reports each user's share of the output tokens while both had "
                          "requests waiting")
    two.add_argument("--weights", type=_weight, nargs=2, metavar=("W1", "W2"),
                     help="the users' weights in cllm's fair shares, in the shape's order "
                          "(batch chat; big small), default 1 1: a cllm started here gets a "
                          "key file (OUT/logs/users.keys) with one named key a user, and "
                          "every request sends its user's key; llama-server has no users")
    started = p.add_argument_group("servers started here (--cllm, --peer, --engine-direct)")
    started.add_argument("--parallel", type=_positive,
                         help="sequences/slots (default: the highest concurrency level)")
    started.add_argument("--ctx-size", type=_positive, default=8192,
                         help="KV cache cells in all, split over the sequences (default 8192)")
    started.add_argument("--kv-unified", action=argparse.BooleanOptionalAction,
                         default=ENGINE_DEFAULTS.kv_unified,
                         help="one KV pool that any sequence may fill, in cllm (default: "
                              "cllm's, one pool on a GPU and split on a CPU); llama-server's "
                              "layout is --peer-kv's")
    started.add_argument("--threads", type=_positive, default=os.cpu_count() or 1)
    started.add_argument("--batch-size", type=_positive, default=ENGINE_DEFAULTS.n_batch)
    started.add_argument("--ubatch-size", type=_positive,
                         help=f"micro-batch (default: the batch size, at most "
                              f"{ENGINE_DEFAULTS.n_ubatch})")
    started.add_argument("--flash-attn", choices=("on", "off", "auto"), default="auto")
    started.add_argument("--n-gpu-layers", type=int, default=ENGINE_DEFAULTS.n_gpu_layers)
    started.add_argument("--peer-kv", choices=PEER_KV_LAYOUTS, nargs="+",
                         help="llama-server's KV layout (default: split, its own default and "
                              "its faster one); both `split unified`: one llama-server of each, "
                              "measured as llama-server-split and llama-server-unified")
    started.add_argument("--cllm-args", type=shlex.split, default=[],
                         help="more cllm.serve flags, one quoted string (e.g. "
                              "'--stream-interval 4'); --engine-direct's engine takes them too")
    started.add_argument("--peer-args", type=shlex.split, default=[],
                         help="more llama-server flags, one quoted string (e.g. '-bs': the peer "
                              "at its best)")
    started.add_argument("--batched-bench", action="store_true",
                         help="also build llama-batched-bench beside llama-server")
    out = p.add_argument_group("output")
    out.add_argument("--out", type=Path, default=Path("bench/results"))
    out.add_argument("--tag", help="a name for this run, put in the file names")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not (args.url or args.cllm or args.peer or args.engine_direct):
        parser.error("nothing to measure: give --url, --cllm, --peer or --engine-direct")
    _check_workload(parser, args)
    _check_users(parser, args)
    args.concurrency = sorted(set(args.concurrency or DEFAULT_CONCURRENCY))
    args.max_tokens = args.max_tokens or DEFAULT_MAX_TOKENS
    args.sampling = args.sampling or [_sampling(spec) for spec in DEFAULT_SAMPLING]
    if args.peer_kv:
        args.peer_kv = list(dict.fromkeys(args.peer_kv))  # each layout once, in order
    args.levels = _levels(parser, args)
    args.goodput = dict(args.goodput) if args.goodput else None
    if args.parallel is None:
        args.parallel = args.max_concurrency or max(args.concurrency)
    return args


def _levels(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[Level]:
    if args.workload == "mixed-users":  # one level: the users' own loads
        return [Level(concurrency=users.in_flight(args))]
    if not args.request_rate:
        if args.max_concurrency:
            parser.error("--max-concurrency caps an open loop: it needs --request-rate")
        return [Level(concurrency=c) for c in args.concurrency]
    if args.workload == "multi-turn":
        parser.error("multi-turn conversations wait for each reply: use --concurrency")
    return [Level(concurrency=args.max_concurrency, rate=r)
            for r in sorted(set(args.request_rate))]


def _check_workload(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Rejects options the workload would ignore; resolves the endpoint it needs."""
    if args.dataset_path and args.workload != "sharegpt":
        parser.error("--dataset-path is for --workload sharegpt")
    sized = ("standard", "structured", "mixed-users")
    if (args.workload not in sized and args.prompt_tokens) or (
            args.workload not in sized[:2] and args.prompt_file):
        parser.error(f"--prompt-tokens and --prompt-file are for the standard workload; "
                     f"{args.workload} makes its own prompts")
    if args.workload in CHAT_WORKLOADS:
        if args.endpoint == "completions":
            parser.error(f"{args.workload} {CHAT_WORKLOADS[args.workload]}: it needs "
                         "--endpoint chat")
        if args.engine_direct:
            parser.error(f"{args.workload} needs a chat template: --engine-direct has none")
        args.endpoint = "chat"
    args.endpoint = args.endpoint or "completions"


def _check_users(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """mixed-users' own defaults; options it would not use are refused by name."""
    if args.workload != "mixed-users":
        for flag, value in (("--users-shape", args.users_shape), ("--weights", args.weights)):
            if value is not None:
                parser.error(f"{flag} is for --workload mixed-users")
        return
    for flag, value in (("--concurrency", args.concurrency),
                        ("--request-rate", args.request_rate),
                        ("--max-concurrency", args.max_concurrency),
                        ("--goodput", args.goodput)):
        if value:
            parser.error(f"{flag} is not for mixed-users: its users keep their own loads in "
                         "flight (--users-shape says which)")
    if args.sampling and len(args.sampling) > 1:
        parser.error("mixed-users takes one --sampling SPEC")
    args.users_shape = args.users_shape or users.SHAPES[0]
    args.weights = args.weights or [1.0, 1.0]
    args.parallel = args.parallel or users.SLOTS
    args.prompt_tokens = args.prompt_tokens or users.BATCH_PROMPT_TOKENS
    args.max_tokens = args.max_tokens or users.BATCH_MAX_TOKENS
    args.sampling = args.sampling or [_sampling("greedy")]


def load_settings(args: argparse.Namespace) -> LoadSettings:
    return LoadSettings(endpoint=args.endpoint, max_tokens=args.max_tokens, stream=args.stream,
                        ignore_eos=args.ignore_eos, timeout=args.timeout,
                        cache_prompt=args.cache_prompt, sampling=args.sampling[0].fields)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(parallel=args.parallel, ctx_size=args.ctx_size,
                          kv_unified=_kv_unified(args.kv_unified), threads=args.threads,
                          batch_size=args.batch_size,
                          # llama.cpp caps the micro-batch at the batch anyway
                          ubatch_size=args.ubatch_size or min(args.batch_size,
                                                              ENGINE_DEFAULTS.n_ubatch),
                          flash_attn=args.flash_attn, n_gpu_layers=args.n_gpu_layers,
                          peer_args=tuple(args.peer_args), cllm_args=tuple(args.cllm_args))


def _kv_unified(asked: bool | None) -> bool:
    if asked is not None:
        return asked
    from cllm.engine.engine import default_kv_unified  # loads llama.cpp: only when needed
    return default_kv_unified()


@dataclass(frozen=True)
class Sampling:
    """A --sampling SPEC: its label (the SPEC) and the fields requests send."""
    label: str
    fields: dict


_SAMPLING_FIELDS = {"t": ("temperature", float), "p": ("top_p", float), "k": ("top_k", int),
                    "minp": ("min_p", float)}
# Greedy; what clients send, with the same parameters for every server (k=0: llama-server's
# top-k 40 off) and with each server's defaults (t=1 alone: llama-server as users meet it).
DEFAULT_SAMPLING = ("greedy", "t=1,k=0", "t=0.7,p=0.95,k=0", "t=1")


def _sampling(text: str) -> Sampling:
    """"greedy" → temperature 0; "t=0.7,p=0.95,k=0" → those fields."""
    if text == "greedy":
        return Sampling(text, {"temperature": 0.0})
    fields = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in _SAMPLING_FIELDS:
            known = ", ".join(k + "=" for k in _SAMPLING_FIELDS)
            raise argparse.ArgumentTypeError(f"{text!r}: give greedy or fields among {known}")
        name, kind = _SAMPLING_FIELDS[key]
        try:
            fields[name] = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: {key}= takes a number") from None
    return Sampling(text, fields)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _weight(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"a weight must be a number above 0, got {text}")
    return value


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a rate must be above 0, got {text}")
    return value


def _slo(text: str) -> tuple[str, float]:
    """"ttft:500" → ("ttft", 500.0)."""
    name, _, ms = text.partition(":")
    try:
        bound = float(ms)
    except ValueError:
        bound = -1.0
    if name not in SLO_METRICS or not bound > 0:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give METRIC:MS with METRIC one of {', '.join(SLO_METRICS)} and MS > 0")
    return name, bound


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value
