"""KV layout probe: what a prompt's prefill and a decode step cost in one unified pool and with
split streams, into an empty cache and beside other sequences' cells. Through the core alone.

    python bench/probes/kv_layout.py [MODEL] [--threads N] [--seqs 8] [--prompt 1450] [--steps 20]

On a GPU, e.g. `--seqs 64 --prompt 300 --steps 100`: a decode row of one pool is masked over
every sequence's cells, and the host builds that mask each step."""
import argparse
import random
import time
from array import array

from cllm.llama import _core
from cllm.models import resolve_model


def prefill(ctx, seq_id, tokens):
    for start in range(0, len(tokens), ctx.n_batch):
        n = min(ctx.n_batch, len(tokens) - start)
        ctx.step(array("i", [seq_id]), array("i", [start]), array("i", [n]),
                 array("i", [start + n == len(tokens)]), array("i", tokens[start:start + n]))


def timed(fn, *args):
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def probe(model, unified: bool, args) -> str:
    n_seqs, prompt = args.seqs, args.prompt
    ctx = _core.Context(model, n_ctx=n_seqs * (prompt + args.steps + 256), n_seq_max=n_seqs,
                        n_batch=512, n_ubatch=512, n_threads=args.threads, kv_unified=unified)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(prompt)] for _ in range(n_seqs)]
    empty = timed(prefill, ctx, 0, prompts[0])
    for seq_id in range(1, n_seqs - 1):
        prefill(ctx, seq_id, prompts[seq_id])
    beside = timed(prefill, ctx, n_seqs - 1, prompts[-1])
    rows = array("i", range(n_seqs))
    start = time.perf_counter()
    for k in range(args.steps):
        ctx.step(rows, array("i", [prompt + k] * n_seqs), array("i", [1] * n_seqs),
                 array("i", [1] * n_seqs), array("i", [200] * n_seqs))
    decode = (time.perf_counter() - start) / args.steps
    return (f"{'one pool' if unified else 'split':>8}: prefill {prompt} into an empty cache "
            f"{empty:.2f} s, beside {n_seqs - 1} x {prompt} {beside:.2f} s; "
            f"{n_seqs}-row decode step {decode * 1000:.2f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1450, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed")
    args = parser.parse_args()
    model = _core.Model(str(resolve_model(args.model)))
    for unified in (True, False):
        print(probe(model, unified, args), flush=True)


if __name__ == "__main__":
    main()
