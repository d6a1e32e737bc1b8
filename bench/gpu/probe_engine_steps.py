"""The engine's step time split (schedule, decode, postprocess, hand-off) at 64 concurrent
50-token requests: one decode step per call, 8-step decode runs, and 8-step runs on split KV.

Usage: python probe_engine_steps.py MODEL.gguf"""
import asyncio
import sys
import time

from cllm.config import EngineConfig, SamplingParams
from cllm.engine.engine import Engine


async def load(eng, n, conc, max_tokens=50):
    gate = asyncio.Semaphore(conc)

    async def one(i):
        async with gate:
            prompt = eng.model.tokenize(f"Question {i}: tell me about the number {i}.")
            stream = eng.submit(prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True))
            async for delta in stream:
                pass
            return delta.completion_tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return tokens / (time.perf_counter() - start)


def main():
    for steps, unified in [(1, True), (8, True), (8, False)]:
        eng = Engine(EngineConfig(n_ctx=64 * 512, n_parallel=64, decode_steps=steps,
                                  kv_unified=unified), sys.argv[1])
        asyncio.run(load(eng, 64, 64, 10))  # warm-up
        eng.timer.reset()
        rate = asyncio.run(load(eng, 128, 64))
        split = " ".join(f"{k}={v:.2f}" for k, v in eng.timer.summary().items())
        print(f"steps={steps} unified={unified}: {rate:.0f} tok/s  {split}", flush=True)
        eng.shutdown()


if __name__ == "__main__":
    main()
