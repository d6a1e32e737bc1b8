"""KV layout probe: what a prompt's prefill and a decode step cost in one unified pool and with
split streams, into an empty cache and beside other sequences' cells. Through the core alone.

    python bench/probe_kv_layout.py [MODEL] [--threads N]"""
import argparse
import random
import time
from array import array

from cllm import _core
from cllm.models import resolve_model

N_SEQS, PROMPT, CTX = 8, 1450, 16384


def prefill(ctx, seq_id, tokens):
    for start in range(0, len(tokens), ctx.n_batch):
        n = min(ctx.n_batch, len(tokens) - start)
        ctx.step(array("i", [seq_id]), array("i", [start]), array("i", [n]),
                 array("i", [start + n == len(tokens)]), array("i", tokens[start:start + n]))


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def probe(model, unified: bool, threads: int) -> str:
    ctx = _core.Context(model, n_ctx=CTX, n_seq_max=N_SEQS, n_batch=512, n_ubatch=512,
                        n_threads=threads, kv_unified=unified)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT)] for _ in range(N_SEQS)]
    empty = timed(prefill, ctx, 0, prompts[0])
    for seq_id in range(1, N_SEQS - 1):
        prefill(ctx, seq_id, prompts[seq_id])
    beside = timed(prefill, ctx, N_SEQS - 1, prompts[-1])
    rows = array("i", range(N_SEQS))
    steps = 20
    start = time.perf_counter()
    for k in range(steps):
        ctx.step(rows, array("i", [PROMPT + k] * N_SEQS), array("i", [1] * N_SEQS),
                 array("i", [1] * N_SEQS), array("i", [200] * N_SEQS))
    decode = (time.perf_counter() - start) / steps
    return (f"{'one pool' if unified else 'split':>8}: prefill {PROMPT} into an empty cache "
            f"{empty:.2f} s, beside {N_SEQS - 1} x {PROMPT} {beside:.2f} s; "
            f"{N_SEQS}-row decode step {decode * 1000:.1f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    model = _core.Model(str(resolve_model(args.model)))
    for unified in (True, False):
        print(probe(model, unified, args.threads), flush=True)


if __name__ == "__main__":
    main()
