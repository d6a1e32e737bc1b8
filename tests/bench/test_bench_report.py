"""The JSON file, the table and the plot, from a report with synthetic runs."""
import json

import pytest

from cllm.bench import report
from cllm.bench.loadgen import RequestResult
from cllm.bench.stats import summarize


def _report(tag="t") -> dict:
    data = report.new_report({"requests": 2, "max_tokens": 3}, tag)
    ok = RequestResult(start=0, end=0.5, ttft=0.1, itl=[0.2, 0.2], output_tokens=3, prompt_tokens=5)
    failed = RequestResult(start=0, end=0.1, error="HTTP 429: busy")
    for server in ("cllm", "llama-server"):
        for level in (1, 8):
            data["runs"].append({"server": server, "url": None, "model": "m", "concurrency": level,
                                 "warmup_failed": 0, "metrics": summarize([ok, failed], 1.0)})
    return data


def test_json_shape(tmp_path):
    path = report.write(_report(), tmp_path)
    assert path.name.startswith("bench-t-") and path.suffix == ".json"
    data = json.loads(path.read_text())
    assert data["schema"] == report.SCHEMA
    assert {"date", "command", "git_commit", "machine", "settings", "servers", "runs"} <= set(data)
    assert {"cpu", "nproc", "gpu"} <= set(data["machine"]) and data["machine"]["nproc"] >= 1
    assert "-m cllm.bench" in data["command"]
    m = data["runs"][0]["metrics"]
    for key in ("completed", "failed", "failures", "duration_s", "output_throughput",
                "request_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert key in m
    assert set(m["ttft_ms"]) == {"mean", "p50", "p99"}
    assert m["failures"] == {"HTTP 429: busy": 1}


def test_table_lists_runs_and_failures():
    text = report.table(_report()["runs"])
    assert text.count("llama-server") == 2 and "1 × HTTP 429: busy" in text
    assert "tok/s" in text.splitlines()[0]


def test_plot_from_json(tmp_path):
    pytest.importorskip("matplotlib")
    first = report.write(_report("a"), tmp_path)
    second = report.write(_report("b"), tmp_path)
    out = tmp_path / "both.png"
    report.main(["plot", str(first), str(second), "--out", str(out)])
    assert out.read_bytes().startswith(b"\x89PNG")
