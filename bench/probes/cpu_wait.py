"""CPU wait probe: a prefill of ROWS x 64 tokens (default 8), then decode steps of ROWS rows and
of one row in split streams, through the core alone. Run it under each wait policy (and beside a
competing load) to compare, e.g.:

    for v in X=1 OMP_WAIT_POLICY=PASSIVE; do env $v python bench/probes/cpu_wait.py MODEL 2 32; done

OpenMP reads the policy when llama.cpp loads, hence one process per policy."""
import sys
import time
from array import array

from cllm.llama import _core


def ints(values):
    return array("i", values)


def main(model_path: str, n_threads: int, rows: int) -> None:
    model = _core.Model(model_path)
    ctx = _core.Context(model, n_ctx=rows * 1024, n_seq_max=rows, n_batch=512, n_ubatch=512,
                        n_threads=n_threads, kv_unified=False)
    start = time.perf_counter()
    for seq in range(rows):
        ctx.step(ints([seq]), ints([0]), ints([64]), ints([0]), ints([7] * 64))
    prefill = time.perf_counter() - start
    pos = 64
    start = time.perf_counter()
    for _ in range(60):
        ctx.step(ints(range(rows)), ints([pos] * rows), ints([1] * rows), ints([1] * rows),
                 ints([11] * rows))
        pos += 1
    many = (time.perf_counter() - start) / 60
    start = time.perf_counter()
    for _ in range(30):
        ctx.step(ints([0]), ints([pos]), ints([1]), ints([1]), ints([11]))
        pos += 1
    one = (time.perf_counter() - start) / 30
    print(f"prefill {rows}x64 {prefill * 1000:7.0f} ms  decode {rows} rows {many * 1000:6.1f} ms/step  "
          f"1 row {one * 1000:6.1f} ms/step")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 8)
