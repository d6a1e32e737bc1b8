"""One new-document request at a time: TTFT over HTTP (argv[1] = url) or in-process (argv[1] = 'engine')."""
import asyncio, random, sys, time
words = "the of and to in is was for on that with as by at from his her an which it be are were this".split()
def doc(i):
    rng = random.Random(1000 + i + int(sys.argv[3]))
    return " ".join(rng.choice(words) for _ in range(1400)) + "\nQuestion: what?"
async def http(n):
    import httpx
    async with httpx.AsyncClient(timeout=120) as c:
        for i in range(n):
            t0 = time.perf_counter()
            async with c.stream("POST", sys.argv[1] + "/v1/completions", json={"model": "x", "prompt": doc(i), "max_tokens": 2, "stream": True, "temperature": 0}) as r:
                async for line in r.aiter_lines():
                    if '"text"' in line:
                        print(f"http {time.perf_counter() - t0:.2f}", flush=True); break
async def engine(n):
    from cllm.config import SamplingParams, cpu_wait_while_loading
    from cllm.serve import build_config, parse_args
    cfg = build_config(parse_args(["--threads", "2", "--parallel", "8", "--ctx-size", "16384"]))
    with cpu_wait_while_loading(cfg.engine.cpu_wait, cfg.engine.n_threads):
        from cllm.engine import Engine
    from cllm.models import resolve_model
    eng = Engine(cfg.engine, str(resolve_model("smollm2-135m-instruct")))
    import os
    time.sleep(float(os.environ.get("IDLE", "0")))
    for i in range(n):
        t0 = time.perf_counter()
        s = eng.submit(eng.model.tokenize(doc(i)), SamplingParams(max_tokens=2, temperature=0.0))
        async for d in s:
            if d.token_ids:
                print(f"engine {time.perf_counter() - t0:.2f}", flush=True); break
        async for d in s: pass
asyncio.run(engine(int(sys.argv[2])) if sys.argv[1] == "engine" else http(int(sys.argv[2])))
