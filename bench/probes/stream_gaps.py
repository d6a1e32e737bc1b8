"""Split KV streams: what one decode step costs when its rows sit in consecutive streams, and
when idle streams lie between them (upstream llama.cpp decodes each run of consecutive seq ids
in a forward pass of its own; vendor/patches/llama-kv-split-stream-gaps.patch makes such a
step one pass), with how many of a case's steps reused the graph of the step before (one pass
a step: all but the first); and what copying a stream into another adds to the step after it.
Through the core alone.

    python bench/probes/stream_gaps.py [MODEL] [--streams N] [--threads N]"""
import argparse
import time
from array import array

from cllm.llama import _core
from cllm.models import resolve_model

STEPS = 12
CELLS_PER_STREAM = 2048


def ints(values):
    return array("i", values)


class Streams:
    """A split-KV context whose every stream holds the same short prompt."""

    def __init__(self, model, n: int, threads: int) -> None:
        self.ctx = _core.Context(model, n_ctx=n * CELLS_PER_STREAM, n_seq_max=n, n_batch=512,
                                 n_threads=threads, kv_unified=False)
        prompt = list(model.tokenize("The capital of France is a city that"))
        self.ctx.step(ints(range(n)), ints([0] * n), ints([len(prompt)] * n), ints([1] * n),
                      ints(prompt * n))
        self.pos = [len(prompt)] * n

    def decode(self, seqs: list[int]) -> None:
        """One step: a token for each of `seqs`, sampled."""
        rows = len(seqs)
        self.ctx.step(ints(seqs), ints([self.pos[s] for s in seqs]), ints([1] * rows),
                      ints([1] * rows), ints([7] * rows))
        for s in seqs:
            self.pos[s] += 1

    def ms_per_step(self, seqs: list[int]) -> tuple[float, int]:
        """Milliseconds a step, and how many of the STEPS reused the graph of the one before."""
        self.decode(seqs)  # this shape's graph
        reused = self.ctx.graphs_reused
        start = time.perf_counter()
        for _ in range(STEPS):
            self.decode(seqs)
        return (time.perf_counter() - start) / STEPS * 1e3, self.ctx.graphs_reused - reused


    def ms_after_copy(self, src: int, dst: int) -> float:
        """A one-row step of `dst` right after `src`'s prompt was shared into it (llama.cpp
        copies the whole stream at that decode)."""
        total = 0.0
        for _ in range(STEPS):
            start = time.perf_counter()
            self.ctx.share_prefix(dst, src, self.pos[src] - 1)
            self.pos[dst] = self.pos[src] - 1
            self.decode([dst])
            total += time.perf_counter() - start
        return total / STEPS * 1e3


def cases(n: int) -> list[tuple[str, list[int]]]:
    every = list(range(n))
    out = [("all consecutive", every),
           ("one gap", [s for s in every if s != n // 2]),
           ("two gaps", [s for s in every if s not in (n // 3, 2 * n // 3)]),
           ("half, consecutive", every[: n // 2]),
           ("half, every other", every[::2])]
    if n >= 32:
        out += [("8, consecutive", every[:8]), ("8, every 4th", every[::4][:8]),
                ("8, two runs of 4", every[:4] + every[n // 2: n // 2 + 4]),
                # where the standard workload's 16 streams lay over HTTP (a traced server)
                ("16 in 0-5, 12-21", every[0:6] + every[12:22]),
                ("16 in five runs", every[0:5] + [11, 19] + every[21:25] + every[26:31])]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--streams", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    model = _core.Model(resolve_model(args.model))
    for n in args.streams:
        streams = Streams(model, n, args.threads)
        for name, seqs in cases(n):
            ms, reused = streams.ms_per_step(seqs)
            print(f"{n} streams, {name:18s} {len(seqs):3d} rows: {ms:7.2f} ms a step, "
                  f"{reused}/{STEPS} graphs reused", flush=True)
        print(f"{n} streams, one row {streams.ms_per_step([1])[0]:7.2f} ms a step; after a copy "
              f"of stream {n - 1} into it {streams.ms_after_copy(n - 1, 1):7.2f} ms "
              f"({CELLS_PER_STREAM} cells a stream)", flush=True)


if __name__ == "__main__":
    main()
