import sys, time
from array import array as A
from cllm import _core
M = "/root/w/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf"
m = _core.Model(M)
t = m.tokenize("The capital of France is a city that")
for uni, fa, thr in [(False, "auto", 16), (True, "auto", 16), (False, "auto", 4), (False, "off", 16)]:
    B = 64
    ctx = _core.Context(m, n_ctx=B * 512, n_seq_max=B, n_batch=512, n_threads=thr, flash_attn=fa, kv_unified=uni)
    first = ctx.step(A('i', range(B)), A('i', [0]*B), A('i', [len(t)]*B), A('i', [1]*B), A('i', t*B))
    pos = len(t)
    for n in (1, 2):
        pass
    N = 30; t0 = time.perf_counter()
    last = first
    for i in range(N):
        last = ctx.step(A('i', range(B)), A('i', [pos]*B), A('i', [1]*B), A('i', [1]*B), last)
        pos += 1
    dt = (time.perf_counter() - t0) / N
    t0 = time.perf_counter()
    toks, counts = ctx.decode_run(A('i', range(B)), A('i', [pos]*B), last, A('i', [30]*B), A('i', [0]*B), 30)
    dr = (time.perf_counter() - t0) / 30
    print(f"unified={uni} fa={fa} threads={thr} step {dt*1000:.2f} ms ({B/dt:.0f} tok/s)  run-step {dr*1000:.2f} ms ({B/dr:.0f} tok/s)", flush=True)
