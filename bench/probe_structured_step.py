"""What constrained decoding costs inside the engine's steps, free of HTTP and of other load.

Runs the structured workload's tickets (cllm.bench.prompts) through an Engine at 1, 8 and 32
concurrent sequences, greedy, free (ignore_eos) and then constrained by TICKET_SCHEMA, and
reports output tokens/s, the time of the steps (decode + sampling in the core, masks applied)
and, for the constrained runs, the time spent filling masks (with the GPU engine's overlap:
handing them to their thread) and advancing matchers. The shares are measured within the same
steps, so a busy machine slows both sides alike. `--in-turn` also runs the masks filled in turn
before each step (the CPU engine's way) for comparison.

    python bench/probe_structured_step.py [--model PATH] [--threads 2] [--levels 1 8 64]
        [--in-turn]"""
from __future__ import annotations

import argparse
import asyncio
import time

from cllm.bench.prompts import DEFAULT_PROMPTS, TICKET_SCHEMA, ticket
from cllm.config import EngineConfig, SamplingParams
from cllm.engine import Engine
from cllm.models import resolve_model
from cllm.structured import MaskFiller

LEVELS = (1, 8, 32)
MAX_TOKENS = 160


class Timed:
    """Wraps a callable, summing the seconds spent in it."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds, self.calls = fn, 0.0, 0

    def __call__(self, *args):
        start = time.perf_counter()
        try:
            return self.fn(*args)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


async def _one(engine: Engine, text: str, grammar) -> int:
    prompt = engine.model.tokenize(f"<|im_start|>user\n{ticket(text)}<|im_end|>\n"
                                   "<|im_start|>assistant\n")
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, grammar=grammar,
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


def measure(engine: Engine, level: int, grammar) -> dict:
    engine.ctx = TimedContext(engine.ctx)
    step, fill = engine.ctx.step, Timed(engine._masks.fill)
    advance = Timed(engine._advance_matchers)
    engine._masks.fill, engine._advance_matchers = fill, advance
    texts = [DEFAULT_PROMPTS[i % len(DEFAULT_PROMPTS)] for i in range(level)]
    start = time.perf_counter()

    async def run() -> list[int]:
        return await asyncio.gather(*(_one(engine, t, grammar) for t in texts))

    tokens = sum(asyncio.run(run()))
    wall = time.perf_counter() - start
    engine.ctx, engine._masks.fill, engine._advance_matchers = engine.ctx.ctx, fill.fn, advance.fn
    return {"tokens": tokens, "wall_s": wall, "steps": step.calls,
            "step_ms": 1000 * step.seconds / max(1, step.calls),
            "masks_ms": 1000 * fill.seconds / max(1, step.calls),
            "matchers_ms": 1000 * advance.seconds / max(1, step.calls)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="GGUF path (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    parser.add_argument("--kv-unified", action=argparse.BooleanOptionalAction, default=False,
                        help="the KV layout (default: split streams, as on a CPU)")
    parser.add_argument("--in-turn", action="store_true",
                        help="also run with the masks filled in turn on the engine thread")
    args = parser.parse_args()
    path = args.model or str(resolve_model("smollm2-135m-instruct"))
    print("level  mode                tokens  tok/s  steps  step ms  masks ms  matchers ms  share")
    for level in args.levels:
        engine = Engine(EngineConfig(n_ctx=level * 512, n_parallel=level, n_threads=args.threads,
                                     kv_unified=args.kv_unified), path)
        try:
            grammar = engine.grammars.json_schema(TICKET_SCHEMA)
            measure(engine, level, grammar)  # warm-up: the lexer's first states are built lazily
            modes = [("free", None), ("constrained", grammar)]
            if args.in_turn:
                modes.append(("constrained in turn", grammar))
            for mode, g in modes:
                if mode.endswith("in turn"):
                    engine._masks = MaskFiller(engine.ctx.mask_words)
                r = measure(engine, level, g)
                share = (r["masks_ms"] + r["matchers_ms"]) / r["step_ms"] if r["step_ms"] else 0
                print(f"{level:5d}  {mode:19s}  {r['tokens']:6d}  {r['tokens'] / r['wall_s']:5.0f}  "
                      f"{r['steps']:5d}  {r['step_ms']:7.1f}  {r['masks_ms']:8.2f}  "
                      f"{r['matchers_ms']:11.2f}  {share:5.1%}", flush=True)
        finally:
            engine.shutdown()


if __name__ == "__main__":
    main()
