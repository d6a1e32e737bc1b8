"""What the parts of a CPU step cost beside a long shared prefix: decode rows, a short question,
both in one step, and what prefilling the document cost. Through the core alone, split streams
as on a CPU build.

8 streams hold the same document (computed once, shared into the others); each case starts
from there, so every row attends over the document's cells.

    python bench/probes/step_parts.py [MODEL] [--threads N] [--document 1434] [--reps 5]"""
import argparse
import random
import time
from array import array

from cllm.llama import _core
from cllm.models import resolve_model

N_SEQS = 8


def cases(question: int) -> dict[str, list[tuple[int, int]]]:
    """(seq id, tokens) rows of each step measured."""
    return {
        f"{N_SEQS} decode rows": [(s, 1) for s in range(N_SEQS)],
        f"a {question}-token question alone": [(3, question)],
        f"{N_SEQS - 1} decode rows and the question": [(s, question if s == 3 else 1)
                                                      for s in range(N_SEQS)],
        f"{N_SEQS - 2} decode rows (a slot idle) and the question":
            [(s, question if s == 2 else 1) for s in range(N_SEQS) if s != 4],
        "1 decode row": [(3, 1)],
        f"{N_SEQS // 2} decode rows": [(s, 1) for s in range(N_SEQS // 2)],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--document", type=int, default=1434)
    parser.add_argument("--question", type=int, default=12)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    model = _core.Model(str(resolve_model(args.model)))
    ctx = _core.Context(model, n_ctx=16384, n_seq_max=N_SEQS, n_batch=512, n_ubatch=512,
                        n_threads=args.threads, kv_unified=False, aligned_prefill=True)
    rng = random.Random(0)
    doc = [rng.randrange(100, 40000) for _ in range(args.document)]
    start_time = time.perf_counter()
    for start in range(0, len(doc), ctx.n_batch):
        n = min(ctx.n_batch, len(doc) - start)
        ctx.step(array("i", [0]), array("i", [start]), array("i", [n]), array("i", [0]),
                 array("i", doc[start:start + n]))
    print(f"{'the document, prefilled':45s} {time.perf_counter() - start_time:6.2f} s", flush=True)
    for seq_id in range(1, N_SEQS):
        ctx.share_prefix(seq_id, 0, len(doc))

    def step(rows) -> float:
        """Decode `rows` after the document, then trim every stream back to it."""
        n_tokens = sum(n for _, n in rows)
        start = time.perf_counter()
        ctx.step(array("i", [s for s, _ in rows]), array("i", [len(doc)] * len(rows)),
                 array("i", [n for _, n in rows]), array("i", [1] * len(rows)),
                 array("i", [200] * n_tokens))
        elapsed = time.perf_counter() - start
        for seq_id in range(N_SEQS):
            ctx.share_prefix(seq_id, seq_id, len(doc))
        return elapsed

    step([(s, 1) for s in range(N_SEQS)])  # the shares' stream copies happen here
    for name, rows in cases(args.question).items():
        times = sorted(step(rows) for _ in range(args.reps))
        print(f"{name:45s} min {1000 * times[0]:6.1f} ms, median "
              f"{1000 * times[len(times) // 2]:6.1f} ms", flush=True)


if __name__ == "__main__":
    main()
