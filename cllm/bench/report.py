"""Results out: the JSON file and the table printed at the end (the machine it names:
machine.py; the PNG plot: plot.py).

`python -m cllm.bench.report plot RESULTS.json... [--out PNG]` draws the plot later from JSON,
e.g. on a machine without matplotlib, or to put several runs in one figure."""
from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
from pathlib import Path

from . import plot
from .machine import git_commit, machine_info

SCHEMA = 1


def new_report(settings: dict, tag: str | None) -> dict:
    return {"schema": SCHEMA, "tag": tag,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, "-m", "cllm.bench", *sys.argv[1:]]),
            "git_commit": git_commit(), "machine": machine_info(), "settings": settings,
            "servers": {}, "runs": []}


def write(report: dict, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = report["date"].replace(":", "").replace("-", "")[:15]
    name = f"bench-{report['tag']}-{stamp}" if report["tag"] else f"bench-{stamp}"
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def header(report: dict) -> str:
    """The machine and the workload, above the table."""
    m, s = report["machine"], report["settings"]
    flags = ", ".join(f"{name} {'yes' if on else 'no'}"
                      for name, on in (m.get("cpu_flags") or {}).items())
    machine = (f"CPU: {m.get('cpu')}, {m.get('nproc')} cores ({flags or 'flags unknown'}); "
               f"GPU: {', '.join(m.get('gpu') or []) or 'none'}")
    workload = s.get("workload", "standard")
    if workload == "mixed-users":
        weights = ":".join(f"{w:g}" for w in s.get("weights") or ())
        return (f"{machine}\nworkload: mixed-users ({s.get('users_shape')}, weights {weights}); "
                f"prompts of about {s.get('prompt_tokens')} tokens × {s.get('max_tokens')} "
                f"tokens, {s.get('parallel')} slots")
    documents = s.get("documents") or 1
    detail = {"shared-prefix": (f", {documents} documents" if documents > 1 else ", document")
              + f" of {s.get('prefix_tokens')} tokens",
              "multi-turn": f", {s.get('turns')} turns a conversation"}.get(workload, "")
    output = ("output lengths of their own" if workload == "sharegpt"
              else f"{s.get('max_tokens')} tokens")
    slo = s.get("goodput")
    goodput = ("; goodput SLO " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in slo.items())
               if slo else "")
    return (f"{machine}\n"
            f"workload: {workload}{detail}; {s.get('requests')} requests × {output} a level"
            f"{goodput}")


_COLUMNS = (("server", 20, "{}"), ("level", 12, "{}"), ("ok", 4, "{}"), ("fail", 4, "{}"),
            ("wall s", 7, "{:.1f}"), ("tok/s", 8, "{:.1f}"), ("req/s", 6, "{:.2f}"),
            ("ttft p50", 9, "{:.1f}"), ("ttft p90", 9, "{:.1f}"), ("ttft p99", 9, "{:.1f}"),
            ("tpot p50", 9, "{:.2f}"), ("itl p50", 8, "{:.2f}"), ("itl/t p50", 9, "{:.2f}"),
            ("tok/ev", 6, "{:.1f}"), ("e2el p50", 9, "{:.0f}"),
            ("good/s", 7, "{:.2f}"), ("cached", 7, "{:.1%}"))


# A client process busy this much of a level's wall time is near its own ceiling: one Python
# process, one core (an httpx client capped at ~48 requests a second).
CLIENT_BUSY = 0.9


def level_label(run: dict) -> str:
    """c=N for a closed-loop level, rate=R for an open one (older results have no label)."""
    return run.get("level") or f"c={run['concurrency']}"


def table(runs: list[dict]) -> str:
    """The levels' table, then mixed-users' runs in a table of their own."""
    levels = [run for run in runs if "metrics" in run]
    by_user = [run for run in runs if "users" in run]
    return "\n\n".join(([levels_table(levels)] if levels else [])
                       + ([users_table(by_user)] if by_user else []))


def levels_table(runs: list[dict]) -> str:
    """A compact table: one row per server, level and run, latencies in milliseconds; goodput
    when SLOs were given; the share of prompt tokens served from cache last ("-": the server
    did not say). With several runs, their spread follows."""
    lines = [_heads(_COLUMNS)]
    for run in runs:
        m = run["metrics"]
        values = (run["server"], level_label(run), m["completed"], m["failed"],
                  m["duration_s"], m["output_throughput"], m["request_throughput"],
                  m["ttft_ms"]["p50"], m["ttft_ms"].get("p90"), m["ttft_ms"]["p99"],
                  m["tpot_ms"]["p50"], m["itl_ms"]["p50"],
                  (m.get("itl_token_ms") or {}).get("p50"), m.get("tokens_per_event"),
                  m["e2el_ms"]["p50"],
                  (m.get("goodput") or {}).get("request_goodput"), m.get("cached_share"))
        lines.append(_row(_COLUMNS, values))
        if "turns" in m:
            lines.append("    " + _turns_line(m))
        for reason, count in m["failures"].items():
            lines.append(f"    {count} × {reason}")
        if (run.get("client_cpu_share") or 0) >= CLIENT_BUSY:
            lines.append(f"    the client itself used {run['client_cpu_share']:.0%} of a core: "
                         "these figures may be its limit, not the server's")
    return "\n".join(lines + spread(runs))


_USER_COLUMNS = (("server", 20, "{}"), ("shape", 11, "{}"), ("user", 6, "{}"),
                 ("weight", 6, "{:g}"), ("phase", 10, "{}"), ("ok", 4, "{}"), ("fail", 4, "{}"),
                 ("tok/s", 8, "{:.1f}"), ("ttft p50", 9, "{:.1f}"), ("ttft p99", 9, "{:.1f}"),
                 ("tpot p50", 9, "{:.2f}"), ("share", 7, "{:.1%}"))


def users_table(runs: list[dict]) -> str:
    """mixed-users: a row per server, user and phase (latencies in milliseconds; share: of
    the output tokens while both users had requests waiting), each run's targets below."""
    lines = [_heads(_USER_COLUMNS)]
    for run in runs:
        for user, figures in run["users"].items():
            for phase, m in figures["phases"].items():
                lines.append(_row(_USER_COLUMNS, (
                    run["server"], run["shape"], user, figures["weight"], phase, m["completed"],
                    m["failed"], m["output_throughput"], m["ttft_ms"]["p50"],
                    m["ttft_ms"]["p99"], m["tpot_ms"]["p50"], figures.get("share"))))
                lines += [f"    {count} × {reason}" for reason, count in m["failures"].items()]
        lines.append(users_targets(run))
    return "\n".join(lines)


def users_targets(run: dict) -> str:
    """A mixed-users run's targets and whether it met them."""
    t = run["targets"]
    if run["shape"] == "batch-chat":
        return (f"    the person's TTFT p99 beside the batch {_ms(t['chat_ttft_p99_ms'])}, "
                f"target ≤ {t['chat_ttft_idle_times']:g} × idle "
                f"{_ms(t['chat_ttft_p99_idle_ms'])} + a decode step {_ms(t['decode_step_ms'])}"
                f" = {_ms(t['chat_ttft_p99_bound_ms'])}: {_met(t['chat_ttft_met'])}; the batch "
                f"keeps {_cell('{:.2f}', t['batch_kept'])} of its throughput alone (target ≥ "
                f"{t['batch_kept_min']:.2f}): {_met(t['batch_kept_met'])}")
    shares = ", ".join(f"{user} {_cell('{:.1%}', f['share'])} (target {f['target_share']:.0%})"
                       for user, f in run["users"].items())
    return (f"    shares while both had requests waiting ({_cell('{:.1f}', run['window_s'])} s):"
            f" {shares}, within ±{100 * t['share_points']:g} points: {_met(t['shares_met'])}")


def _ms(value: float | None) -> str:
    return _cell("{:.1f} ms", value)


def _met(met: bool | None) -> str:
    return "unknown" if met is None else "met" if met else "not met"


def _heads(columns: tuple) -> str:
    return " ".join(f"{name:>{width}}" for name, width, _ in columns)


def _row(columns: tuple, values: tuple) -> str:
    return " ".join(f"{_cell(fmt, v):>{width}}" for (_, width, fmt), v in zip(columns, values))


def spread(runs: list[dict]) -> list[str]:
    """For each server and level measured more than once: the range of output throughput
    and of TTFT p50 over its runs, and their coefficient of variation."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["server"], level_label(run)), []).append(run["metrics"])
    lines = []
    for (server, level), metrics in groups.items():
        if len(metrics) < 2:
            continue
        parts = [_range(name, [m[key] if sub is None else m[key][sub] for m in metrics])
                 for name, key, sub in (("tok/s", "output_throughput", None),
                                        ("TTFT p50 ms", "ttft_ms", "p50"))]
        lines.append(f"spread over {len(metrics)} runs, {server} {level}: " + "; ".join(parts))
    return (["", *lines]) if lines else []


def _range(name: str, values: list[float | None]) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return f"{name} -"
    mean = sum(known) / len(known)
    sd = (sum((v - mean) ** 2 for v in known) / len(known)) ** 0.5
    cv = f" (cv {sd / mean:.1%})" if mean else ""
    return f"{name} {min(known):.1f}–{max(known):.1f}{cv}"


def _turns_line(m: dict) -> str:
    """A conversation's TTFT p50 at each turn, and the last turn's over the first's."""
    cells = " · ".join(f"{t['turn']}: {_cell('{:.1f}', t['ttft_ms']['p50'])}"
                       for t in m["turns"])
    ratio = _cell("{:.2f}", m["ttft_p50_last_over_first"])
    return f"TTFT p50 by turn, ms: {cells} (last / first: {ratio})"


def _cell(fmt: str, value: object) -> str:
    return "-" if value is None else fmt.format(value)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m cllm.bench.report")
    commands = parser.add_subparsers(dest="command", required=True)
    draw = commands.add_parser("plot", help="draw the PNG plot from result JSON files")
    draw.add_argument("results", nargs="+", type=Path)
    draw.add_argument("--out", type=Path, help="PNG path (default: beside the first JSON)")
    draw.add_argument("--join", action="store_true",
                      help="one line per server across the files, e.g. a sweep that started "
                           "its servers anew for each level (bench/gpu/model_sizes.sh)")
    args = parser.parse_args(argv)
    reports = [json.loads(p.read_text()) for p in args.results]
    out = args.out or args.results[0].with_suffix(".png")
    if plot.plot(reports, out, args.join):
        print(out)


if __name__ == "__main__":
    main()
