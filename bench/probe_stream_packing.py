"""Where split streams land after a busy level: a few streams' speed, and the placeholder rows
of their decode runs, when every idle slot holds a repeated prompt and a reply of its own.

64 streams of 24-token replies (8 prompts drawn at random, sampled at temperature 0.8 with a
seed per request, so that no two replies are alike, as on a GPU even greedy ones are not),
then 8 streams for 48 requests, engine-direct. `--keep-replies` counts every reply as worth
keeping, as placement did before `Retention.reused` (a slot then holds its reply alone, so
no copy brings the 8 streams together). `--as-gpu` makes the engine's GPU choices on this
CPU (no aligned prompt blocks, decode runs of 8, gaps of up to 64 streams filled) so that
the engine's step timer reports the gap rows a GPU step would carry (`Context.run_timing`).

    python bench/probe_stream_packing.py [--keep-replies] [--as-gpu] [--threads 2]"""
from __future__ import annotations

import argparse
import asyncio
import random
import time

from cllm import _core, prefix_cache
from cllm.bench.prompts import DEFAULT_PROMPTS
from cllm.config import EngineConfig, SamplingParams
from cllm.engine import Engine
from cllm.models import resolve_model


async def _level(engine: Engine, prompts: list[list[int]], streams: int, requests: int,
                 pick: random.Random) -> float:
    queue = list(range(requests))

    async def stream() -> None:
        while queue:
            i = queue.pop(0)
            sampling = SamplingParams(max_tokens=24, temperature=0.8, seed=i, ignore_eos=True)
            async for _ in engine.submit(prompts[pick.randrange(len(prompts))], sampling):
                pass

    start = time.perf_counter()
    await asyncio.gather(*(stream() for _ in range(streams)))
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keep-replies", action="store_true")
    p.add_argument("--as-gpu", action="store_true")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.keep_replies:
        prefix_cache.Retention.reused = property(lambda self: True)
    if args.as_gpu:
        _core.supports_gpu_offload = lambda: True
    config = EngineConfig(n_ctx=64 * 256, n_parallel=64, n_threads=args.threads,
                          kv_unified=False, stream_gap_fill=64 if args.as_gpu else 0,
                          decode_steps=8 if args.as_gpu else 1)
    engine = Engine(config, resolve_model("smollm2-135m-instruct"))
    prompts = [engine.model.tokenize(text) for text in DEFAULT_PROMPTS[:8]]
    pick = random.Random(7)

    async def busy_then_few() -> float:
        await _level(engine, prompts, 64, 128, pick)
        engine.timer.reset()
        return await _level(engine, prompts, 8, 48, pick)

    try:
        seconds = asyncio.run(busy_then_few())
    finally:
        engine.shutdown()
    timing = engine.timer.summary()
    run_ms = timing.get("run_ms_by_part", {}).get("llama_decode", 0.0)
    print(f"keep_replies={args.keep_replies} as_gpu={args.as_gpu}: 8 streams, 48 requests "
          f"{seconds:.2f} s, {engine.timer.steps} steps; decode runs: {engine.timer.run_steps} "
          f"steps, {run_ms:.1f} ms in llama_decode, "
          f"{timing.get('gap_rows_per_run_step', 0.0):.1f} gap rows a step")


if __name__ == "__main__":
    main()
