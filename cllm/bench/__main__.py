"""`python -m cllm.bench`: start or reach the servers, run every concurrency level, report."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp

from cllm.engine import steptimer
from cllm.models import DEFAULT_ALIAS, resolve_model

from . import plot, prompts, report, users
from .cli import load_settings, parse_args, server_settings
from .direct import EngineTarget, load_llama_as_the_server
from .loadgen import Connections, HttpTarget, Level, ReplyLengths, Sender, first_model, run_level
from .peer import build, start_peer
from .servers import StartedServer, say, start_cllm
from .stats import request_records, summarize
from .workloads import LevelPlan, level_seed, plans


@dataclass(slots=True)
class Target:
    name: str
    url: str | None = None  # None: measured in-process (engine-direct)
    model: str | None = None
    send: Sender | None = None  # set once the model name is known
    # The engine's step timer so far (cllm's, in-process or over /metrics); None: another server.
    step_counts: Callable[[], Awaitable[dict | None]] | None = None
    # A sender whose requests carry other sampling fields.
    sampled: Callable[[dict], Sender] | None = None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.engine_direct:  # before the default KV layout loads llama.cpp (direct.py says why)
        load_llama_as_the_server(args.threads, tuple(args.cllm_args))
    data = report.new_report(_settings(args), args.tag)
    try:
        with ExitStack() as stack:
            targets = _start_targets(args, stack, data)
            asyncio.run(_measure_all(args, targets, data))
    finally:
        if data["runs"]:  # an interrupted run still leaves the levels it finished
            _write(data, args.out)


def _write(data: dict, out: Path) -> None:
    path = report.write(data, out)
    png = plot.plot([data], path.with_suffix(".png"))
    print(report.header(data))
    print(report.table(data["runs"]))
    print(f"results: {path}" + (f"\nplot: {png}" if png else ""))


def _settings(args: argparse.Namespace) -> dict:
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    settings["levels"] = [asdict(level) for level in args.levels]
    settings["sampling"] = {spec.label: spec.fields for spec in args.sampling}
    # llama-server's layout is each started peer's own (`servers`), not one setting of the run.
    settings["server"] = {k: v for k, v in asdict(server_settings(args)).items()
                          if k != "peer_kv_unified"}
    return settings


def _start_targets(args: argparse.Namespace, stack: ExitStack, data: dict) -> list[Target]:
    """Servers this run starts come first (cllm, engine, peer), then --url ones."""
    targets: list[Target] = []
    s = server_settings(args)
    logs = args.out / "logs"
    if args.cllm:
        cllm = s
        if args.workload == "mixed-users":
            keys = ("--api-key-file", str(_users_key_file(args, logs)))
            cllm = replace(s, cllm_args=(*s.cllm_args, *keys))
        targets.append(_started(start_cllm(args.model or DEFAULT_ALIAS, cllm, logs), stack, data))
    if args.engine_direct:
        path = resolve_model(args.model)
        engine = EngineTarget(str(path), s, load_settings(args))
        stack.callback(engine.shutdown)
        targets.append(Target("cllm-engine", model=path.name, send=engine.send,
                              step_counts=engine.step_counts, sampled=engine.sampled))
    if args.batched_bench:
        build(("llama-server", "llama-batched-bench"))
    if args.peer:
        layouts = args.peer_kv or ["split"]
        for layout in layouts:
            name = "llama-server" + (f"-{layout}" if len(layouts) > 1 else "")
            kv = replace(s, peer_kv_unified=layout == "unified")
            targets.append(_started(start_peer(resolve_model(args.model), kv, logs, name),
                                    stack, data, kv=layout))
    for url in args.url:
        name = urlsplit(url).netloc or url
        targets.append(Target(name, url=url, model=args.model))
    return targets


def _users_key_file(args: argparse.Namespace, logs: Path) -> Path:
    """A named key a user with its weight, so that cllm's fair shares tell the users apart."""
    logs.mkdir(parents=True, exist_ok=True)
    path = logs / "users.keys"
    path.write_text(users.key_file(users.users(args.users_shape, args.weights)))
    return path


def _started(server: StartedServer, stack: ExitStack, data: dict, **facts) -> Target:
    """`facts`: what the results should say of this server beyond its command (a peer's KV
    layout)."""
    stack.callback(server.stop)
    data["servers"][server.name] = {"url": server.url, "command": server.process.args,
                                    "log": str(server.log_path), **facts}
    return Target(server.name, url=server.url)


async def _measure_all(args: argparse.Namespace, targets: list[Target], data: dict) -> None:
    load = load_settings(args)
    # Keep every connection alive: reconnecting between requests would count in their TTFT.
    # An open loop without a cap may have every request of a level in flight.
    pool = max(max(level.concurrency or args.requests for level in args.levels),
               args.warmup) + 4
    people = (users.users(args.users_shape, args.weights) if args.workload == "mixed-users"
              else ())
    # A server with the users' keys lists its models only to one of them.
    async with Connections(pool, load.timeout,
                           api_key=people[0].key if people else None) as connections:
        for t in targets:
            if t.url:
                t.model = t.model or await first_model(connections, t.url)
                t.send = HttpTarget(t.url, t.model, load, connections).send
                t.step_counts = partial(_engine_step_counts, connections, t.url)
                t.sampled = partial(_http_sampled, t, load, connections)
        if people:
            await _measure_users(args, targets, data, load, connections)
            return
        groups = [[v for t in _sampling_series(target, args.sampling)
                   for v in (_with_schema(t, load, connections)
                             if args.workload == "structured" else [t])]
                  for target in targets]
        levels = [(level, repeat) for level in args.levels for repeat in range(args.runs)]
        for i, ((level, repeat), plan) in enumerate(zip(levels, plans(args))):
            # The order of servers flips from run to run so neither always runs first.
            for group in groups if i % 2 == 0 else groups[::-1]:
                for t in group:
                    run = await _measure(t, level, plan, seed=level_seed(args, i),
                                         slo=args.goodput)
                    run["repeat"] = repeat
                    data["runs"].append(run)
                    _print_run(run)


async def _measure_users(args: argparse.Namespace, targets: list[Target], data: dict, load,
                         connections: Connections) -> None:
    """mixed-users: each run's plan against every server in turn (the order flipping from
    run to run), each user's requests with its own key."""
    for repeat in range(args.runs):
        plan = users.plan(args, seed=level_seed(args, repeat))
        for t in targets if repeat % 2 == 0 else targets[::-1]:
            send = {u.name: HttpTarget(t.url, t.model, load, connections, api_key=u.key).send
                    for u in plan.users}
            run = {"server": t.name, "url": t.url, "model": t.model, "shape": args.users_shape,
                   "level": args.users_shape, "concurrency": args.levels[0].concurrency,
                   "request_rate": None, "loadavg_1m": os.getloadavg()[0]}
            run |= await plan.measure(send)
            run["repeat"] = repeat
            data["runs"].append(run)
            say(f"{t.name} {args.users_shape}: " + report.users_targets(run).strip())


def _http_sampled(t: Target, load, connections: Connections, fields: dict) -> Sender:
    return HttpTarget(t.url, t.model, replace(load, sampling=fields), connections).send


def _sampling_series(t: Target, specs: list) -> list[Target]:
    """One series a --sampling SPEC ("<name>@<SPEC>"), measured one after another at each
    level; the target itself where there is one SPEC."""
    if len(specs) == 1:
        return [t]
    return [Target(f"{t.name}@{spec.label}", url=t.url, model=t.model,
                   send=t.sampled(spec.fields), step_counts=t.step_counts) for spec in specs]


def _with_schema(t: Target, load, connections: Connections) -> list[Target]:
    """An HTTP server three times, in this order: free; constrained by the ticket schema
    ("<name>+schema"); free again with each reply as long as its constrained one
    ("<name>+lengths"), which isolates what the constraint itself costs. (The CLI refuses
    the structured workload with --engine-direct: every target here has a URL.)"""
    lengths = ReplyLengths(load.max_tokens)
    constrained = HttpTarget(t.url, t.model, replace(load, json_schema=prompts.TICKET_SCHEMA),
                             connections)
    return [t,
            Target(f"{t.name}+schema", url=t.url, model=t.model,
                   send=lengths.recording(constrained.send), step_counts=t.step_counts),
            Target(f"{t.name}+lengths", url=t.url, model=t.model, send=lengths.sized(t.send),
                   step_counts=t.step_counts)]


async def _measure(t: Target, level: Level, plan: LevelPlan, seed: int,
                   slo: dict[str, float] | None) -> dict:
    load_before = os.getloadavg()[0]  # on a shared machine, says how busy it was
    warm_results, _ = await run_level(t.send, plan.warmup, level.concurrency or 4)
    steps_before = await t.step_counts() if t.step_counts else None
    cpu_before = time.process_time()
    results, duration, per_turn = await plan.run(t.send, level, seed,
                                                 desc=f"{t.name} {level.label}")
    # The client's own CPU over the level: near one core, the figures may be the client's
    # limit (report.table says so). An engine measured in this process would count in it too.
    cpu_share = (time.process_time() - cpu_before) / duration if t.url else None
    run = {"server": t.name, "url": t.url, "model": t.model, "concurrency": level.concurrency,
           "request_rate": level.rate, "level": level.label,
           "warmup_failed": sum(not r.ok for r in warm_results), "loadavg_1m": load_before,
           "client_cpu_share": cpu_share,
           "metrics": summarize(results, duration, slo) | per_turn,
           "requests": request_records(results)}
    steps_after = await t.step_counts() if steps_before is not None else None
    if steps_after is not None:  # where the engine thread's time went over the level
        run["engine_steps"] = steptimer.summarize(steptimer.since(steps_after, steps_before))
    return run


async def _engine_step_counts(connections: Connections, url: str) -> dict | None:
    """A cllm server's step timer so far, from its /metrics; None from any other server."""
    try:
        async with connections.session.get(url.rstrip("/") + "/metrics") as resp:
            status, text = resp.status, await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return None
    # Imported here: cllm.http.metrics imports the engine, which loads llama.cpp, and main() loads
    # it first for the engine-direct target (load_llama_as_the_server says why).
    from cllm.http.metrics import step_timer_counts
    return step_timer_counts(text) if status == 200 else None


def _print_run(run: dict) -> None:
    m = run["metrics"]
    cached = "" if m["cached_share"] is None else f", {m['cached_share']:.0%} of prompt cached"
    good = f", {m['goodput']['request_goodput']:.2f} good req/s" if "goodput" in m else ""
    resent = f" ({m['resent']} sent again on a new connection)" if m["resent"] else ""
    say(f"{run['server']} {run['level']}: {m['completed']} ok{resent}, {m['failed']} failed, "
        f"{m['output_throughput']:.1f} tok/s, TTFT p50 {m['ttft_ms']['p50'] or 0:.1f} ms"
        f"{cached}{good}")
    if run.get("engine_steps"):
        steps = run["engine_steps"]
        phases = ", ".join(f"{k[:-3]} {v:.2f}" for k, v in steps.items() if k.endswith("_ms"))
        say(f"  engine thread: {steps['steps']} calls, {steps['rows_per_step']:.1f} rows and "
            f"{steps['forward_steps_per_step']:.1f} forward steps a call; ms a call: {phases}")
        if "run_ms_by_part" in steps:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in steps["run_ms_by_part"].items())
            say(f"  engine thread, decode runs, ms a forward step: {parts}; "
                f"{steps['held_rows_per_run_step']:.1f} held rows each")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        sys.exit(130)
