"""The table of bench/gpu/model_sizes.sh's results: per model and streams, cllm's output tok/s,
llama-server's in its faster KV layout (named), their ratio, llama-batched-bench's TG at the same
batch and cllm's share of it, and TTFT p50 of both.

    python bench/gpu/model_sizes_table.py RESULTS_DIR   (RESULTS_DIR/MODEL/*.json, *.jsonl)

Prints Markdown and writes RESULTS_DIR/summary.md and summary.json."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def runs(model_dir: Path) -> list[dict]:
    """Every run of the model's bench JSON files, each with its report's GPU."""
    out = []
    for path in sorted(model_dir.glob("bench-*.json")):
        report = json.loads(path.read_text())
        gpu = ", ".join(report["machine"].get("gpu") or []) or "no GPU"
        out += [{**run, "gpu": gpu, "file": path.name} for run in report["runs"]]
    return out


def batched_tg(model_dir: Path) -> dict[int, float]:
    path = model_dir / "batched-bench.jsonl"
    if not path.is_file():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    return {r["pl"]: r["speed_tg"] for r in rows}


def rows_of(model_dir: Path) -> list[dict]:
    tg = batched_tg(model_dir)
    by_level: dict[int, dict[str, dict]] = {}
    for run in runs(model_dir):
        by_level.setdefault(run["concurrency"], {})[run["server"]] = run
    rows = []
    for c, servers in sorted(by_level.items()):
        cllm = servers.get("cllm")
        peers = [r for name, r in servers.items() if name.startswith("llama-server")]
        peer = max(peers, key=lambda r: r["metrics"]["output_throughput"], default=None)
        rows.append({
            "model": model_dir.name, "streams": c, "gpu": (cllm or peer or {}).get("gpu"),
            "cllm_tok_s": _tok_s(cllm), "peer": peer and peer["server"],
            "peer_tok_s": _tok_s(peer), "peer_all": {r["server"]: _tok_s(r) for r in peers},
            "batched_tg": tg.get(c), "cllm_ttft_p50_ms": _ttft(cllm),
            "peer_ttft_p50_ms": _ttft(peer),
            "failed": {name: r["metrics"]["failed"] for name, r in servers.items()}})
    return rows


def _tok_s(run: dict | None) -> float | None:
    return run["metrics"]["output_throughput"] if run else None


def _ttft(run: dict | None) -> float | None:
    return run["metrics"]["ttft_ms"]["p50"] if run else None


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}" if a and b else "-"


def _num(v: float | None) -> str:
    return f"{v:,.0f}" if v is not None else "-"


def markdown(rows: list[dict]) -> str:
    lines = ["| model | streams | GPU | cllm tok/s | llama-server tok/s (layout) | cllm / peer | "
             "batched-bench TG | cllm / TG | TTFT p50 ms, cllm / peer | failed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        layout = (r["peer"] or "").removeprefix("llama-server").lstrip("-") or "split"
        failed = ", ".join(f"{k} {v}" for k, v in r["failed"].items() if v) or "0"
        lines.append(
            f"| {r['model']} | {r['streams']} | {r['gpu']} | {_num(r['cllm_tok_s'])} | "
            f"{_num(r['peer_tok_s'])} ({layout}) | {_ratio(r['cllm_tok_s'], r['peer_tok_s'])} | "
            f"{_num(r['batched_tg'])} | {_ratio(r['cllm_tok_s'], r['batched_tg'])} | "
            f"{_num(r['cllm_ttft_p50_ms'])} / {_num(r['peer_ttft_p50_ms'])} | {failed} |")
    return "\n".join(lines)


def main() -> None:
    results = Path(sys.argv[1])
    rows = [row for d in sorted(p for p in results.iterdir() if p.is_dir())
            for row in rows_of(d)]
    table = markdown(rows)
    (results / "summary.md").write_text(table + "\n")
    (results / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(table)


if __name__ == "__main__":
    main()
