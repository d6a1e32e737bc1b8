"""Two users on one server: a batch user saturating it while a person sends a chat turn every
two seconds. Measures the person's time to first token idle and beside the batch, and the
batch's throughput alone and beside the person, for cllm with a key a user (fair shares),
cllm without keys (one user: first come, first served), and llama-server. Runs from the
repository root:

    python bench/probes/mixed_users.py [--parallel 4] [--batch 32] [--turns 8] [--out FILE]"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx

from cllm.bench.peer import start_peer
from cllm.bench.servers import ServerSettings, start_cllm
from cllm.models import DEFAULT_ALIAS, resolve_model

KEYS = "k-batch name=batch\nk-chat name=chat\n"
WORDS = ("river stone lamp orchard signal harbor copper meadow lantern violet quarry ember "
         "thistle canyon marble falcon saddle prism tundra beacon").split()


def document(i: int, n_words: int) -> str:
    """About `n_words` words, different for each i (no prefix to share across requests)."""
    return f"Note {i}: " + " ".join(WORDS[(i * 7 + k * k) % len(WORDS)] for k in range(n_words))


async def completion(client: httpx.AsyncClient, key: str | None, body: dict) -> dict:
    """One streamed request: its time to first token, end and tokens. Sent again once if the
    server closed the kept-alive connection before answering (llama-server does)."""
    try:
        return await _completion(client, key, body)
    except httpx.RemoteProtocolError:
        return await _completion(client, key, body)


async def _completion(client: httpx.AsyncClient, key: str | None, body: dict) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    start = time.perf_counter()
    first, tokens = None, 0
    async with client.stream("POST", "/v1/completions", headers=headers,
                             json={**body, "stream": True,
                                   "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("choices") and first is None:
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    return {"ttft": first, "total": time.perf_counter() - start, "tokens": tokens}


async def batch(client, key, n, concurrency, prompt_words, max_tokens, first):
    """Tokens a second of n requests (documents first, first + 1, ...: no two runs share one,
    so no server answers a run from what it cached in another)."""
    gate = asyncio.Semaphore(concurrency)

    async def one(i):
        async with gate:
            return await completion(client, key, {"prompt": document(first + i, prompt_words),
                                                  "max_tokens": max_tokens, "ignore_eos": True,
                                                  "temperature": 0})
    start = time.perf_counter()
    results = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(r["tokens"] for r in results) / (time.perf_counter() - start)


async def chat(client, key, turns, every):
    ttfts = []
    for turn in range(turns):
        started = time.perf_counter()
        r = await completion(client, key, {"prompt": f"Question {turn}: name a colour.",
                                           "max_tokens": 16, "temperature": 0})
        ttfts.append(r["ttft"])
        await asyncio.sleep(max(0.0, every - (time.perf_counter() - started)))
    return ttfts


async def measure(url, batch_key, chat_key, args) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await completion(client, chat_key, {"prompt": "warm up", "max_tokens": 4})
        idle = await chat(client, chat_key, args.turns, args.every)
        run = (client, batch_key, args.batch, 4 * args.parallel, args.prompt_words,
               args.max_tokens)
        alone = await batch(*run, first=0)
        beside, loaded = await asyncio.gather(batch(*run, first=args.batch),
                                              chat(client, chat_key, args.turns, args.every))
    return {"chat_ttft_idle_p50": statistics.median(idle), "chat_ttft_idle_max": max(idle),
            "chat_ttft_loaded_p50": statistics.median(loaded),
            "chat_ttft_loaded_max": max(loaded), "chat_ttft_loaded": loaded,
            "batch_tok_s_alone": alone, "batch_tok_s_beside_chat": beside}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_ALIAS)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--batch", type=int, default=32, help="batch requests (4x the slots at once)")
    p.add_argument("--prompt-words", type=int, default=350)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--every", type=float, default=2.0)
    p.add_argument("--servers", nargs="+", default=["cllm-keys", "cllm", "llama-server"])
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    model = resolve_model(args.model)
    settings = ServerSettings(parallel=args.parallel, ctx_size=args.parallel * 2048,
                              threads=args.threads)
    report = {"args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        keyfile = Path(tmp) / "keys"
        keyfile.write_text(KEYS)
        for name in args.servers:
            if name == "llama-server":
                server = start_peer(model, settings, Path(tmp))
            else:
                flags = ("--api-key-file", str(keyfile)) if name == "cllm-keys" else ()
                server = start_cllm(str(model), replace(settings, cllm_args=flags), Path(tmp))
            keys = ("k-batch", "k-chat") if name == "cllm-keys" else (None, None)
            try:
                report[name] = asyncio.run(measure(server.url, *keys, args))
            finally:
                server.stop()
            print(name, json.dumps({k: v for k, v in report[name].items()
                                    if not isinstance(v, list)}), file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
