"""What filling a step's bitmasks costs, alone and beside a thread that keeps running Python.

On a server the event loop holds the GIL much of the time, and every call into llguidance
lets go of it: a row at a time, each row then waits for it (up to Python's 5 ms switch
interval); in one LLExecutor call (structured.MaskFiller's way), the whole fill waits once.
This takes `--rows` ticket-schema matchers (the structured workload's schema) part-way
through their grammar (a few random allowed tokens each) and times the median fill of all
their bitmasks: a call a row, then one LLExecutor call on each of `--threads`; first alone,
then beside a thread running Python. On a GPU host it picks MaskFiller's thread count.

    python bench/probes/mask_fill.py [--model PATH] [--rows 64] [--threads 1 2 4 8] [--fills 40]"""
from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from array import array

from cllm.bench.prompts import TICKET_SCHEMA
from cllm.engine.structured import Grammars, MaskFiller
from cllm.llama import _core
from cllm.models import resolve_model


def matchers_midway(model, rows: int, seed: int = 0) -> list:
    """`rows` matchers of the ticket schema, each advanced by 3 to 40 random allowed tokens."""
    grammar = Grammars(model).json_schema(TICKET_SCHEMA)
    words = (model.n_vocab + 31) // 32
    mask = array("i", bytes(4 * words))
    rng = random.Random(seed)
    matchers = []
    for _ in range(rows):
        matcher = grammar.matcher()
        for _ in range(rng.randrange(3, 40)):
            matcher.unsafe_compute_mask_ptr(mask.buffer_info()[0], 4 * words)
            allowed = [t for t in range(model.n_vocab) if mask[t // 32] >> (t % 32) & 1]
            if not matcher.consume_token(rng.choice(allowed)) or matcher.is_stopped():
                break
        matchers.append(matcher)
    return matchers


class Fills:
    """The ways to fill every matcher's bitmask into one buffer: a call a row, or
    structured.MaskFiller's one call on `threads`."""

    def __init__(self, matchers: list, words: int) -> None:
        self.matchers, self.words = matchers, words
        self.buffer = array("i", bytes(4 * words * len(matchers)))

    def a_row_at_a_time(self) -> None:
        address, nbytes = self.buffer.buffer_info()[0], 4 * self.words
        for i, matcher in enumerate(self.matchers):
            matcher.unsafe_compute_mask_ptr(address + i * nbytes, nbytes)

    def in_one_call(self, threads: int):
        filler = MaskFiller(self.words, threads=threads)
        return lambda: filler.fill(self.matchers)


class BusyPython:
    """A thread that runs Python until stopped: it holds the GIL except at the switch interval."""

    def __enter__(self) -> BusyPython:
        self._stop = False
        self._thread = threading.Thread(target=self._spin, daemon=True)
        self._thread.start()
        return self

    def _spin(self) -> None:
        total = 0
        while not self._stop:
            for i in range(1000):
                total += i

    def __exit__(self, *exc) -> None:
        self._stop = True
        self._thread.join()


def median_ms(fill, fills: int) -> float:
    fill()  # warm-up
    times = []
    for _ in range(fills):
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        time.sleep(0.002)  # as between steps
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--fills", type=int, default=40)
    args = parser.parse_args()
    model = _core.Model(args.model or str(resolve_model("smollm2-135m-instruct")),
                        n_gpu_layers=0)
    fills = Fills(matchers_midway(model, args.rows), (model.n_vocab + 31) // 32)
    ways = [("a row at a time", fills.a_row_at_a_time)]
    ways += [(f"one call, {n} thread{'s' if n > 1 else ''}", fills.in_one_call(n))
             for n in args.threads]
    for beside in ("alone", "beside busy Python"):
        for name, fill in ways:
            if beside == "alone":
                ms = median_ms(fill, args.fills)
            else:
                with BusyPython():
                    ms = median_ms(fill, args.fills)
            print(f"{args.rows} rows, {beside:18s}, {name:20s}: {ms:8.2f} ms (median)", flush=True)


if __name__ == "__main__":
    main()
