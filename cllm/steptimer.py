"""Where an engine step's time goes: scheduling, decode+sample (C), postprocess, hand-off.

Cumulative, so a benchmark can read the split over many steps; a few perf_counter calls a step."""
from __future__ import annotations

import time
from collections import defaultdict


class StepTimer:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0
        self.rows = 0
        self._last = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.totals[phase] += now - self._last
        self._last = now

    def end(self, rows: int) -> None:
        self.steps += 1
        self.rows += rows

    def reset(self) -> None:
        self.totals.clear()
        self.steps = self.rows = 0

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per step for each phase, and the share outside decode."""
        steps = max(self.steps, 1)
        result = {f"{phase}_ms": 1000 * total / steps for phase, total in self.totals.items()}
        total = sum(self.totals.values())
        result["steps"] = self.steps
        result["rows_per_step"] = self.rows / steps
        result["overhead_share"] = 1 - self.totals.get("decode", 0.0) / total if total else 0.0
        return result
