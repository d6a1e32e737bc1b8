"""The PNG plot of a report's levels: output throughput and TTFT p50 against concurrency or
request rate, one line per server (and report)."""
from __future__ import annotations

import math
import sys
from pathlib import Path


def plot(reports: list[dict], path: Path, join: bool = False) -> Path | None:
    """Output throughput and TTFT p50 against the level (concurrency, or request rate for
    open-loop levels; all-at-once rates are left out), one line per server and report, or
    with `join` one line per server across the reports (a sweep run one level a report).
    None when no report has levels (mixed-users' runs are not plotted)."""
    if not any("metrics" in run for report in reports for run in report["runs"]):
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (draw it later with "
              "`python -m cllm.bench.report plot RESULTS.json`)", file=sys.stderr)
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = _series(reports, join)
    levels_seen = sorted({_x(r) for runs in series.values() for r in runs})
    for label, runs in series.items():
        levels = [_x(r) for r in runs]
        left.plot(levels, [r["metrics"]["output_throughput"] for r in runs], "o-", label=label)
        right.plot(levels, [_nan(r["metrics"]["ttft_ms"]["p50"]) for r in runs], "o-",
                   label=label)
    for axis, title in ((left, "output throughput (tok/s)"), (right, "TTFT p50 (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels_seen, [str(level) for level in levels_seen])
        axis.set_ylim(bottom=0)
        axis.set_xlabel("request rate (req/s)" if _open_loop(series) else "concurrency")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend()
    fig.suptitle(_title(reports), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _series(reports: list[dict], join: bool) -> dict[str, list[dict]]:
    series: dict[str, list[dict]] = {}
    for report in reports:
        named = len(reports) > 1 and not join
        suffix = f" ({report.get('tag') or report['date']})" if named else ""
        for run in report["runs"]:
            if "metrics" in run and math.isfinite(_x(run)):
                series.setdefault(run["server"] + suffix, []).append(run)
    return {label: sorted(runs, key=_x) for label, runs in series.items()}


def _x(run: dict) -> float:
    return run.get("request_rate") or run["concurrency"]


def _open_loop(series: dict[str, list[dict]]) -> bool:
    return any(r.get("request_rate") for runs in series.values() for r in runs)


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _title(reports: list[dict]) -> str:
    first = reports[0]
    s = first["settings"]
    parts = [first["machine"].get("cpu"), ", ".join(first["machine"].get("gpu") or []),
             f"{s.get('workload', 'standard')} workload",
             f"{_span([r['settings'].get('requests') for r in reports])} requests × "
             f"{_span([r['settings'].get('max_tokens') for r in reports])} tokens", first["date"]]
    return " · ".join(p for p in parts if p)


def _span(values: list) -> str:
    """One value, or the range of several (reports of a sweep may differ)."""
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}–{high}"
