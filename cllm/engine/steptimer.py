"""Where an engine step's time goes: the inbox (admitting and aborting requests), scheduling
(the scheduler's plan), preparing (samplers of started sequences, KV operations, the rows'
arrays), decode+sample (C), postprocess, hand-off; and for the calls that are decode runs,
what their forward steps spend in the core as it times them (llama_decode, after_step, the
wait for the step to finish on a GPU, sampling), what their decode laps hold beyond that
("outside": the Python around the core's run, the GIL's hand-back), and the rows they hold
after those stopped; and how many forward steps llama.cpp ran on the graph of the step before
instead of building one.

Cumulative, so a benchmark can read the split over many steps; a few perf_counter calls a step.
A "step" here is one call into the core: a decode run computes several forward steps in it."""
from __future__ import annotations

import time
from collections import defaultdict

# The parts of a run's forward step that the core times: name → Context.run_timing's key.
RUN_PARTS = {"llama_decode": "decode_ms", "after_step": "after_step_ms", "wait": "wait_ms",
             "sample": "sample_ms"}
# The rows beside the sequences' own that a run's forward step carries, as Context.run_timing
# counts them: rows held after they stopped.
RUN_ROWS = ("held_rows",)


class StepTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.rows = 0
        self.forward_steps = 0
        self.graphs_reused = 0
        self.run: dict[str, float] = defaultdict(float)  # seconds inside runs by part
        self.run_steps = 0
        self.run_rows = dict.fromkeys(RUN_ROWS, 0)  # RUN_ROWS' counts over the runs' steps
        self._last = 0.0
        # This step's laps and run, counted at end(): a step that calls nothing (it scheduled
        # no chunk) never ends, and start() drops them, so every figure stays "of calls".
        self._laps: dict[str, float] = defaultdict(float)
        self._run: tuple[dict[str, float], int, dict[str, int]] | None = None

    def start(self) -> None:
        self._laps.clear()
        self._run = None
        self._last = time.perf_counter()

    def lap(self, phase: str) -> float:
        """Close the phase that ran since the last lap; returns its seconds."""
        now = time.perf_counter()
        seconds = now - self._last
        self._laps[phase] += seconds
        self._last = now
        return seconds

    def aside(self, phase: str, seconds: float) -> None:
        """Count the last `seconds` of the phase running now as `phase` instead (work that
        several phases may do, such as copying KV to and from the host tier)."""
        self._laps[phase] += seconds
        self._last += seconds

    def add_run(self, timing: dict, call_seconds: float) -> None:
        """This call's decode run as `Context.run_timing()` times it (means a forward step, made
        totals again so that they add up over calls), and as "outside" what the call's decode
        lap (`call_seconds`) holds beyond those parts."""
        steps = timing["steps"]
        parts = {part: timing[key] * steps / 1000 for part, key in RUN_PARTS.items()}
        parts["outside"] = call_seconds - sum(parts.values())
        self._run = (parts, steps, {key: round(timing[key] * steps) for key in RUN_ROWS})

    def end(self, rows: int, forward_steps: int = 1, graphs_reused: int = 0) -> None:
        for phase, seconds in self._laps.items():
            self.totals[phase] += seconds
        self._laps.clear()
        if self._run is not None:
            parts, steps, rows_carried = self._run
            for part, seconds in parts.items():
                self.run[part] += seconds
            self.run_steps += steps
            for key, count in rows_carried.items():
                self.run_rows[key] += count
            self._run = None
        self.steps += 1
        self.rows += rows
        self.forward_steps += forward_steps
        self.graphs_reused += graphs_reused

    def reset(self) -> None:
        self.totals.clear()
        self.run.clear()
        self.steps = self.rows = self.forward_steps = self.run_steps = self.graphs_reused = 0
        self.run_rows = dict.fromkeys(RUN_ROWS, 0)

    def snapshot(self) -> dict:
        """The counts so far, safe to read from another thread (the metrics' scrape)."""
        return {"totals": dict(self.totals), "steps": self.steps, "rows": self.rows,
                "forward_steps": self.forward_steps, "graphs_reused": self.graphs_reused,
                "run": dict(self.run), "run_steps": self.run_steps, **self.run_rows}

    def summary(self) -> dict:
        return summarize(self.snapshot())


def summarize(counts: dict) -> dict:
    """Mean milliseconds per step for each phase, the share outside decode, rows and forward
    steps per call into the core, the share of forward steps that reused the graph before; if
    decode runs ran, the milliseconds a forward step of theirs by part (the core's, and outside
    it) and the rows they carried beside the sequences' own (RUN_ROWS); from a snapshot, or the
    difference of two."""
    steps = max(counts["steps"], 1)
    totals = counts["totals"]
    result = {f"{phase}_ms": 1000 * total / steps for phase, total in totals.items()}
    total = sum(totals.values())
    result["steps"] = counts["steps"]
    result["rows_per_step"] = counts["rows"] / steps
    result["forward_steps_per_step"] = counts["forward_steps"] / steps
    result["graphs_reused_share"] = counts["graphs_reused"] / max(counts["forward_steps"], 1)
    result["overhead_share"] = 1 - totals.get("decode", 0.0) / total if total else 0.0
    run_steps = counts["run_steps"]
    if run_steps:  # ms a forward step of the runs
        result["run_ms_by_part"] = {part: 1000 * seconds / run_steps
                                    for part, seconds in counts["run"].items()}
        for key in RUN_ROWS:
            result[f"{key}_per_run_step"] = counts[key] / run_steps
    return result


def since(after: dict, before: dict) -> dict:
    """What two snapshots of one timer differ by: the steps between them."""
    return {key: _minus(value, before[key]) for key, value in after.items()}


def _minus(after, before):
    if isinstance(after, dict):  # seconds by phase or part; one the first snapshot lacks is new
        return {name: value - before.get(name, 0.0) for name, value in after.items()}
    return after - before
