"""Where a request's time to first token goes, step by step, engine-direct.

Runs `python -m cllm.bench --engine-direct` with the arguments given, while recording every
engine step (start, end, its chunks) and every request (arrival, first token). Then, for each
request that found part of its prompt cached: the rest of the step in flight when it arrived,
the steps that ran after that before the step that ended its prompt, and that step. E.g. the
shared-document workload:

    python bench/probes/first_token_steps.py --threads 2 --workload shared-prefix --parallel 8 \\
        --ctx-size 16384 --concurrency 8 --requests 48 --max-tokens 50 --warmup 0 --out /tmp/p

Over HTTP: `probe_first_token_steps.py serve ARGS` runs `python -m cllm.serve ARGS` in this
process instead, loaded by any client (e.g. `python -m cllm.bench --url ...`); the report comes
when the server stops (SIGTERM or SIGINT). There a request arrives once its prompt is tokenized;
the client's TTFT less the server's is the HTTP path's share.

With PROBE_TIMELINE=FILE in the environment, every step (start, end and time in the core, ms
from the first request's arrival; each chunk as [request, first position, tokens, samples])
and every request (arrival, first token) also go to FILE as JSON: medians hide how a wave's
requests and steps interleave."""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

from cllm.bench.__main__ import main as bench_main
from cllm.engine import engine as engine_module
from cllm.engine import scheduler as scheduler_module

STEPS: list[dict] = []
BURST_S = 0.05  # arrivals this close to the first one are the opening burst
SEQUENCES: list = []


def _record() -> None:
    """Wrap Scheduler.schedule (a step starts; the one before has ended), Scheduler.add, and
    the engine's calls into llama.cpp (a step's time in the core, the rest is Python's)."""
    schedule, add = scheduler_module.Scheduler.schedule, scheduler_module.Scheduler.add

    def recorded_schedule(self, now):
        out = schedule(self, now)
        if STEPS:
            STEPS[-1]["end"] = time.monotonic()
        STEPS.append({"start": now, "scheduled": time.monotonic(), "core": 0.0,
                      "chunks": [(c.seq, c.start, c.length, c.samples) for c in out.chunks]})
        return out

    for name in ("_step_with_masks", "_decode_run"):
        setattr(engine_module.Engine, name, _timed_core(getattr(engine_module.Engine, name)))

    def recorded_add(self, seq):
        SEQUENCES.append(seq)
        return add(self, seq)

    scheduler_module.Scheduler.schedule = recorded_schedule
    scheduler_module.Scheduler.add = recorded_add


def _timed_core(method):
    def timed(self, *args):
        start = time.monotonic()
        try:
            return method(self, *args)
        finally:
            STEPS[-1]["core"] += time.monotonic() - start
    return timed


def _prompt_tokens(step: dict) -> int:
    return sum(length for seq, start, length, _ in step["chunks"]
               if start < len(seq.prompt_token_ids))


def _parts(seq, steps: list[dict]) -> dict | None:
    """Milliseconds from arrival to the end of the step in flight, in the steps between, and in
    the step that ended the prompt (None if it never got a first token)."""
    own = next((s for s in steps if any(c[0] is seq and c[3] for c in s["chunks"])), None)
    if own is None or seq.first_token_time is None:
        return None
    arrival = seq.arrival_time
    in_flight = next((s for s in steps if s["start"] < arrival < s["end"]), None)
    between = [s for s in steps if arrival <= s["start"] < own["start"]]
    return {"arrival": arrival, "ttft": seq.first_token_time - arrival,
            "in flight, rest": in_flight["end"] - arrival if in_flight else 0.0,
            "steps between": sum(s["end"] - s["start"] for s in between),
            "own step": own["end"] - own["start"],
            "count between": len(between), "own prompt tokens": _prompt_tokens(own)}


def _print_medians(title: str, rows: list[dict]) -> None:
    print(f"{title}, medians:")
    for key in rows[0]:
        if key == "arrival":
            continue
        value = statistics.median(r[key] for r in rows)
        unit = " ms" if key in ("ttft", "in flight, rest", "steps between", "own step") else ""
        print(f"  {key:18s} {value * 1000 if unit else value:8.1f}{unit}")


def _report() -> None:
    steps = [s for s in STEPS if "end" in s]
    rows = [p for p in (_parts(seq, steps) for seq in SEQUENCES if seq.num_cached_tokens)
            if p is not None]
    if not rows:
        print("no request found part of its prompt cached")
        return
    # Requests of the opening burst wait for each other's prompts; later ones for the steps of
    # a running batch: two different waits, so each group gets its own medians.
    first = min(seq.arrival_time for seq in SEQUENCES)
    burst = [p for p in rows if p["arrival"] - first < BURST_S]
    for name, group in (("all", rows), (f"arrived within {BURST_S * 1000:.0f} ms of the first", burst),
                        ("arrived later", [p for p in rows if p not in burst])):
        if group:
            _print_medians(f"{len(group)} requests that found part of their prompt cached, {name}",
                           group)
    for kind in ("prompt", "decode"):
        chosen = [s for s in steps if (_prompt_tokens(s) > 0) == (kind == "prompt")]
        if chosen:
            print(f"  {kind} steps: {len(chosen)}, medians: "
                  f"{_median_ms(s['end'] - s['start'] for s in chosen):.1f} ms, of which "
                  f"scheduling {_median_ms(s['scheduled'] - s['start'] for s in chosen):.1f}, "
                  f"in the core {_median_ms(s['core'] for s in chosen):.1f}; "
                  f"{statistics.median(len(s['chunks']) for s in chosen)} rows")


def _median_ms(seconds) -> float:
    return 1000 * statistics.median(seconds)


def _write_timeline(path: str) -> None:
    first = min(seq.arrival_time for seq in SEQUENCES)

    def ms(t):
        return None if t is None else round(1000 * (t - first), 3)

    steps = [{"start": ms(s["start"]), "end": ms(s["end"]), "core": round(1000 * s["core"], 3),
              "chunks": [[seq.request_id, start, length, samples]
                         for seq, start, length, samples in s["chunks"]]}
             for s in STEPS if "end" in s]
    requests = [{"id": seq.request_id, "arrival": ms(seq.arrival_time),
                 "first_token": ms(seq.first_token_time),
                 "prompt_tokens": len(seq.prompt_token_ids), "cached": seq.num_cached_tokens}
                for seq in SEQUENCES]
    with open(path, "w") as f:
        json.dump({"steps": steps, "requests": requests}, f)


if __name__ == "__main__":
    _record()
    try:
        if sys.argv[1:2] == ["serve"]:
            from cllm.serve import main as serve_main
            serve_main(sys.argv[2:])
        else:
            bench_main(["--engine-direct"] + sys.argv[1:])
    finally:
        _report()
        if os.environ.get("PROBE_TIMELINE") and SEQUENCES:
            _write_timeline(os.environ["PROBE_TIMELINE"])
