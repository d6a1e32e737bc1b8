"""What constrained decoding costs inside the engine's steps, free of HTTP and of other load.

Runs the structured workload's tickets (cllm.bench.prompts) through an Engine at 1, 8 and 32
concurrent sequences, greedy, constrained by TICKET_SCHEMA and then free (ignore_eos) with each
request's reply as long as its constrained one, and reports output tokens/s, the time of the
steps (decode + sampling in the core, masks applied) and, for the constrained runs, the time
spent filling masks (with the GPU engine's overlap: handing them to their thread) and advancing
matchers. The shares are measured within the same steps, so a busy machine slows both sides
alike. Decode runs (a GPU engine's; `--decode-steps` elsewhere) are timed by the core
(`Context.run_timing`, as the engine's step timer sums it): llama_decode, after_step, the wait
for the step, sampling, per step. `--in-turn` also runs the masks filled on the engine thread
before each step (the CPU engine's way) rather than on their own thread while it decodes.

    python bench/probes/structured_step.py [--model PATH] [--threads 2] [--levels 1 8 64]
        [--in-turn] [--kv-unified] [--decode-steps 8] [--n-gpu-layers N]"""
from __future__ import annotations

import argparse
import asyncio
import time

from cllm.bench.prompts import DEFAULT_PROMPTS, TICKET_SCHEMA, ticket
from cllm.config import EngineConfig, SamplingParams
from cllm.engine.engine import Engine
from cllm.engine.steptimer import RUN_PARTS, since, summarize
from cllm.engine.structured import MaskFiller
from cllm.models import resolve_model

LEVELS = (1, 8, 32)
MAX_TOKENS = 160


class Timed:
    """Wraps a callable, summing the seconds spent in it."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


async def _one(engine: Engine, text: str, grammar, max_tokens: int) -> int:
    prompt = engine.model.tokenize(f"<|im_start|>user\n{ticket(text)}<|im_end|>\n"
                                   "<|im_start|>assistant\n")
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0, grammar=grammar,
                              ignore_eos=grammar is None)
    count = 0
    async for delta in engine.submit(prompt, sampling):
        count += len(delta.token_ids)
    return count


class TimedContext:
    """The engine's Context with its step timed (a Cython object takes no new attributes)."""

    def __init__(self, ctx) -> None:
        self.ctx, self.step = ctx, Timed(ctx.step)

    def __getattr__(self, name):
        return getattr(self.ctx, name)


def measure(engine: Engine, level: int, grammar, lengths: list[int]) -> dict:
    before = engine.timer.snapshot()  # the decode runs' timing from here on
    engine.ctx = TimedContext(engine.ctx)
    step, fill = engine.ctx.step, Timed(engine._masks.fill)
    advance = Timed(engine._advance_matchers)
    engine._masks.fill, engine._advance_matchers = fill, advance
    texts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(level)]
    start = time.perf_counter()

    async def run() -> list[int]:
        return await asyncio.gather(*(_one(engine, t, grammar, n)
                                      for t, n in zip(texts, lengths)))

    counts = asyncio.run(run())
    wall = time.perf_counter() - start
    engine.ctx, engine._masks.fill, engine._advance_matchers = engine.ctx.ctx, fill.fn, advance.fn
    runs = since(engine.timer.snapshot(), before)
    timing = {"steps": runs["run_steps"],
              **summarize(runs).get("run_ms_by_part", dict.fromkeys(RUN_PARTS, 0.0))}
    # a step is a Context.step call or one step of a decode run (whose masks fill in after_step)
    steps = max(1, step.calls + timing["steps"])
    run_seconds = sum(runs["run"].get(part, 0.0) for part in RUN_PARTS)  # the core's parts
    return {"counts": counts, "tokens": sum(counts), "wall_s": wall, "steps": steps, "run": timing,
            "step_ms": 1000 * (step.seconds + run_seconds) / steps,
            "masks_ms": 1000 * fill.seconds / steps,
            "matchers_ms": 1000 * advance.seconds / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    parser.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=False,
                        help="the KV layout (default: split streams, as on a CPU)")
    parser.add_argument("--in-turn", action="store_true",
                        help="also run with the masks filled on the engine thread before each step")
    parser.add_argument("--decode-steps", type=int, default=0)
    parser.add_argument("--n-gpu-layers", type=int, default=-1)
    args = parser.parse_args()
    path = args.model or str(resolve_model("smollm2-135m-instruct"))
    print("level  mode                tokens  tok/s  steps  step ms  masks ms  matchers ms  share"
          "  | runs: steps  decode ms  after_step ms  wait ms  sample ms")
    for level in args.levels:
        engine = Engine(EngineConfig(n_ctx=level * 512, n_parallel=level, n_threads=args.threads,
                                     kv_unified=args.kv_unified, decode_steps=args.decode_steps,
                                     n_gpu_layers=args.n_gpu_layers), path)
        try:
            grammar = engine.grammars.json_schema(TICKET_SCHEMA)
            # warm-up (the lexer's first states are built lazily), and the replies' lengths
            lengths = measure(engine, level, grammar, [MAX_TOKENS] * level)["counts"]
            modes = [("constrained", grammar), ("free, same lengths", None)]
            if args.in_turn:
                modes.append(("constrained in turn", grammar))
            for mode, g in modes:
                if mode.endswith("in turn"):
                    engine._masks = MaskFiller(engine.ctx.mask_words)
                report(level, mode, measure(engine, level, g, lengths))
        finally:
            engine.shutdown()


def report(level: int, mode: str, r: dict) -> None:
    share = (r["masks_ms"] + r["matchers_ms"]) / r["step_ms"] if r["step_ms"] else 0
    run = r["run"]
    print(f"{level:5d}  {mode:19s}  {r['tokens']:6d}  {r['tokens'] / r['wall_s']:5.0f}  "
          f"{r['steps']:5d}  {r['step_ms']:7.1f}  {r['masks_ms']:8.2f}  "
          f"{r['matchers_ms']:11.2f}  {share:5.1%}  | {run['steps']:10d}  "
          f"{run['llama_decode']:9.2f}  {run['after_step']:13.2f}  {run['wait']:7.2f}  "
          f"{run['sample']:9.2f}",
          flush=True)


if __name__ == "__main__":
    main()
