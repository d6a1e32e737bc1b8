"""Where an engine step's time goes: the inbox (admitting and aborting requests), scheduling,
decode+sample (C), postprocess, hand-off.

Cumulative, so a benchmark can read the split over many steps; a few perf_counter calls a step.
A "step" here is one call into the core: a decode run computes several forward steps in it."""
from __future__ import annotations

import time
from collections import defaultdict


class StepTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.rows = 0
        self.forward_steps = 0
        self._last = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def end(self, rows: int, forward_steps: int = 1) -> None:
        self.steps += 1
        self.rows += rows
        self.forward_steps += forward_steps

    def reset(self) -> None:
        self.totals.clear()
        self.steps = self.rows = self.forward_steps = 0

    def snapshot(self) -> dict:
        """The counts so far, safe to read from another thread (the metrics' scrape)."""
        return {"totals": dict(self.totals), "steps": self.steps, "rows": self.rows,
                "forward_steps": self.forward_steps}

    def summary(self) -> dict[str, float]:
        return summarize(self.snapshot())


def summarize(counts: dict) -> dict[str, float]:
    """Mean milliseconds per step for each phase, the share outside decode, rows and forward
    steps per call into the core; from a snapshot, or the difference of two."""
    steps = max(counts["steps"], 1)
    totals = counts["totals"]
    result = {f"{phase}_ms": 1000 * total / steps for phase, total in totals.items()}
    total = sum(totals.values())
    result["steps"] = counts["steps"]
    result["rows_per_step"] = counts["rows"] / steps
    result["forward_steps_per_step"] = counts["forward_steps"] / steps
    result["overhead_share"] = 1 - totals.get("decode", 0.0) / total if total else 0.0
    return result


def since(after: dict, before: dict) -> dict:
    """What two snapshots of one timer differ by: the steps between them."""
    totals = {phase: seconds - before["totals"].get(phase, 0.0)
              for phase, seconds in after["totals"].items()}
    counts = {key: after[key] - before[key] for key in after if key != "totals"}
    return {"totals": totals, **counts}
