"""Time per decode step of cllm.llama._core at 1, 8 and 64 rows, split into the decode alone (no row
asks for logits), decode + logits to the host + greedy argmax, and the same inside decode_run.
Threads only change the argmax here (the model is on the GPU): 1 thread is a serial scan.

Usage: python probe_core_step.py MODEL.gguf [n_ctx]"""
import sys
import time
from array import array

from cllm.llama import _core


def ints(values):
    return array("i", values)


def per_step(fn, n):
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def probe(model, rows, threads, n_ctx, steps=40):
    ctx = _core.Context(model, n_ctx=n_ctx, n_seq_max=max(rows, 1), n_batch=512,
                        n_threads=threads, kv_unified=True)
    prompt = model.tokenize("The capital of France is a city that")
    seqs = ints(range(rows))
    last = ctx.step(seqs, ints([0] * rows), ints([len(prompt)] * rows), ints([1] * rows),
                    ints(prompt * rows))
    pos = [len(prompt)]

    def decode(sample):
        def one():
            ctx.step(seqs, ints([pos[0]] * rows), ints([1] * rows), ints([sample] * rows), last)
            pos[0] += 1
        return one

    decode(1)()  # warm the graph of this shape
    t_decode = per_step(decode(0), steps)
    t_sampled = per_step(decode(1), steps)
    start = time.perf_counter()
    ctx.decode_run(seqs, ints([pos[0]] * rows), last, ints([steps] * rows), steps)
    t_run = (time.perf_counter() - start) / steps
    print(f"rows={rows:3d} threads={threads:2d}  decode {t_decode * 1e3:6.2f} ms  "
          f"+logits+argmax {t_sampled * 1e3:6.2f} ms  decode_run step {t_run * 1e3:6.2f} ms "
          f"({rows / t_run:7.0f} tok/s)", flush=True)


def main():
    model = _core.Model(sys.argv[1])
    n_ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 65536
    for rows in (1, 8, 64):
        for threads in (1, 16):
            probe(model, rows, threads, n_ctx)


if __name__ == "__main__":
    main()
