"""Stream interval probe: what an SSE event costs the server, to choose --stream-interval.

Starts `python -m cllm.serve` once per interval, streams the same greedy completions (ignore_eos)
at a fixed concurrency, and reads the CPU time of the server's main thread, which runs the event
loop (routes, the SSE writer, uvicorn), from /proc before and after. The tokens are the same at
every interval, so the difference between intervals is the events' cost: the probe fits
CPU = a · tokens + b · events and prints b, the event loop's time per event, beside tokens/s
(as this client sees them: it parses every event too, so at small intervals its own CPU may
limit them; the event loop's CPU is the server's alone).
On a GPU the engine makes `--decode-steps` tokens a call, so pass the same here to split the
same runs into events, e.g.:

    python bench/probes/stream_interval.py MODEL --intervals 1 2 4 8 16 --concurrency 64 \\
        --requests 128 --max-tokens 256 --decode-steps 8 --serve-args "--ctx-size 65536"
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

import httpx

from cllm.bench.servers import start_process


def thread_cpu(pid: int, tid: int) -> float:
    """CPU seconds one thread of a process has run, to the nanosecond (schedstat; /proc's stat
    counts in 10 ms ticks, too coarse for an event's microseconds)."""
    return int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0]) / 1e9


async def one(client: httpx.AsyncClient, body: dict) -> tuple[int, int]:
    """(events with text, completion tokens) of one streamed completion."""
    events, tokens = 0, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            events += any(c.get("text") for c in chunk["choices"])
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    return events, tokens


async def load(url: str, requests: int, concurrency: int, max_tokens: int) -> tuple[int, int]:
    body = {"prompt": "Write a story about a lighthouse keeper:", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def gated():
            async with gate:
                return await one(client, body)
        results = await asyncio.gather(*(gated() for _ in range(requests)))
    return sum(e for e, _ in results), sum(t for _, t in results)


def measure(args: argparse.Namespace, interval: int) -> dict:
    command = lambda port: [sys.executable, "-m", "cllm.serve", "--model", args.model,  # noqa
                            "--port", str(port), "--parallel", str(args.concurrency),
                            "--stream-interval", str(interval),
                            "--decode-steps", str(args.decode_steps), *args.serve_args]
    server = start_process(f"cllm-interval-{interval}", command, Path(args.logs))
    try:
        pid = server.process.pid
        asyncio.run(load(server.url, args.concurrency, args.concurrency, 8))  # warm-up
        cpu = thread_cpu(pid, pid)
        start = time.perf_counter()
        events, tokens = asyncio.run(load(server.url, args.requests, args.concurrency,
                                          args.max_tokens))
        wall = time.perf_counter() - start
        cpu = thread_cpu(pid, pid) - cpu
    finally:
        server.stop()
    return {"interval": interval, "events": events, "tokens": tokens, "wall_s": wall,
            "tok_s": tokens / wall, "loop_cpu_s": cpu, "loop_us_per_token": cpu / tokens * 1e6}


def fit(rows: list[dict]) -> tuple[float, float]:
    """Least squares of CPU = a · tokens + b · events: (a, b) in microseconds."""
    stt = sum(r["tokens"] ** 2 for r in rows)
    see = sum(r["events"] ** 2 for r in rows)
    ste = sum(r["tokens"] * r["events"] for r in rows)
    stc = sum(r["tokens"] * r["loop_cpu_s"] for r in rows)
    sec = sum(r["events"] * r["loop_cpu_s"] for r in rows)
    det = stt * see - ste * ste
    return (stc * see - sec * ste) / det * 1e6, (sec * stt - stc * ste) / det * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--intervals", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--logs", default="/tmp/cllm-probe-logs")
    p.add_argument("--out", type=Path, help="write the rows and the fit as JSON here")
    p.add_argument("--serve-args", type=shlex.split, default=[],
                   help="more cllm.serve flags, one quoted string")
    args = p.parse_args()
    rows = []
    for interval in args.intervals:
        rows.append(measure(args, interval))
        r = rows[-1]
        print(f"interval {interval:3d}: {r['events']:6d} events, {r['tokens']:6d} tokens, "
              f"{r['tok_s']:8.1f} tok/s, event loop {r['loop_cpu_s']:6.2f} s CPU "
              f"({r['loop_us_per_token']:6.1f} µs a token)", flush=True)
    per_token, per_event = fit(rows) if len(rows) > 1 else (float("nan"), float("nan"))
    print(f"event loop CPU ≈ {per_token:.1f} µs a token + {per_event:.1f} µs an event")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "us_per_token": per_token,
                                        "us_per_event": per_event, "argv": sys.argv}, indent=2))


if __name__ == "__main__":
    main()
