"""Where an engine step's time goes: the inbox (admitting and aborting requests), scheduling,
decode+sample (C), postprocess, hand-off; and inside decode runs, as the core times them, what
a forward step spends in llama_decode, in after_step and in sampling (on a GPU: waiting for the
step), and the placeholder rows it carries between split streams.

Cumulative, so a benchmark can read the split over many steps; a few perf_counter calls a step.
A "step" here is one call into the core: a decode run computes several forward steps in it."""
from __future__ import annotations

import time
from collections import defaultdict


# The parts of a run's forward step that the core times: name → Context.run_timing's key.
RUN_PARTS = {"llama_decode": "decode_ms", "after_step": "after_step_ms", "sample": "sample_ms"}


class StepTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.rows = 0
        self.forward_steps = 0
        self.run: dict[str, float] = defaultdict(float)  # seconds inside runs by part
        self.run_steps = 0
        self.gap_rows = 0
        self._last = 0.0
        # This step's laps, counted at end(): a step that calls nothing (it scheduled no
        # chunk) never ends, and start() drops them, so the phases stay "ms a call".
        self._laps: dict[str, float] = defaultdict(float)

    def start(self) -> None:
        self._laps.clear()
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self._laps[phase] += now - self._last
        self._last = now

    def end(self, rows: int, forward_steps: int = 1) -> None:
        for phase, seconds in self._laps.items():
            self.totals[phase] += seconds
        self._laps.clear()
        self.steps += 1
        self.rows += rows
        self.forward_steps += forward_steps

    def add_run(self, timing: dict) -> None:
        """What `Context.run_timing()` says of the runs since it was last read: means per forward
        step, made totals again so that they add up over calls."""
        steps = timing["steps"]
        for part, key in RUN_PARTS.items():
            self.run[part] += timing[key] * steps / 1000
        self.run_steps += steps
        self.gap_rows += round(timing["gap_rows"] * steps)  # a count: the mean times the steps

    def reset(self) -> None:
        self.totals.clear()
        self.run.clear()
        self.steps = self.rows = self.forward_steps = self.run_steps = self.gap_rows = 0

    def snapshot(self) -> dict:
        """The counts so far, safe to read from another thread (the metrics' scrape)."""
        return {"totals": dict(self.totals), "steps": self.steps, "rows": self.rows,
                "forward_steps": self.forward_steps, "run": dict(self.run),
                "run_steps": self.run_steps, "gap_rows": self.gap_rows}

    def summary(self) -> dict:
        return summarize(self.snapshot())


def summarize(counts: dict) -> dict:
    """Mean milliseconds per step for each phase, the share outside decode, rows and forward
    steps per call into the core; if decode runs ran, the core's milliseconds per forward step
    of theirs by part and their placeholder rows; from a snapshot, or the difference of two."""
    steps = max(counts["steps"], 1)
    totals = counts["totals"]
    result = {f"{phase}_ms": 1000 * total / steps for phase, total in totals.items()}
    total = sum(totals.values())
    result["steps"] = counts["steps"]
    result["rows_per_step"] = counts["rows"] / steps
    result["forward_steps_per_step"] = counts["forward_steps"] / steps
    result["overhead_share"] = 1 - totals.get("decode", 0.0) / total if total else 0.0
    run_steps = counts.get("run_steps", 0)
    if run_steps:  # ms a forward step of the runs, as the core timed it
        result["run_ms_by_part"] = {part: 1000 * seconds / run_steps
                                    for part, seconds in counts["run"].items()}
        result["gap_rows_per_run_step"] = counts["gap_rows"] / run_steps
    return result


def since(after: dict, before: dict) -> dict:
    """What two snapshots of one timer differ by: the steps between them."""
    return {key: _minus(value, before.get(key)) for key, value in after.items()}


def _minus(after, before):
    if isinstance(after, dict):  # seconds by phase or part; one the first snapshot lacks is new
        return {name: value - (before or {}).get(name, 0.0) for name, value in after.items()}
    return after - (before or 0)
