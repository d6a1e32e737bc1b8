import asyncio, sys, time
from cllm.config import EngineConfig, SamplingParams
from cllm.engine import Engine
M = "/root/w/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"

async def load(eng, n, conc, max_tokens=50):
    gate = asyncio.Semaphore(conc)
    async def one(i):
        async with gate:
            st = eng.submit(eng.model.tokenize(f"Question {i}: tell me about the number {i}."), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
            async for d in st: pass
            return d.completion_tokens
    t0 = time.perf_counter()
    toks = sum(await asyncio.gather(*(one(i) for i in range(n))))
    return toks / (time.perf_counter() - t0)

for steps, uni in [(1, True), (8, True), (8, False)]:
    eng = Engine(EngineConfig(n_ctx=64 * 512, n_parallel=64, decode_steps=steps, kv_unified=uni), M)
    asyncio.run(load(eng, 64, 64, 10))
    eng.timer.reset()
    rate = asyncio.run(load(eng, 128, 64))
    s = eng.timer.summary()
    print(f"steps={steps} unified={uni}: {rate:.0f} tok/s  " + " ".join(f"{k}={v:.2f}" for k, v in s.items()), flush=True)
    eng.shutdown()
