"""The JSON file and the table, from a report with synthetic runs."""
import json

from bench_reports import synthetic_report as _report

from cllm.bench import report
from cllm.bench.loadgen import RequestResult
from cllm.bench.stats import by_turn, summarize


def test_json_shape(tmp_path):
    path = report.write(_report(), tmp_path)
    assert path.name.startswith("bench-t-") and path.suffix == ".json"
    data = json.loads(path.read_text())
    assert data["schema"] == report.SCHEMA
    assert {"date", "command", "git_commit", "machine", "settings", "servers", "runs"} <= set(data)
    assert {"cpu", "cpu_flags", "nproc", "gpu"} <= set(data["machine"])
    assert data["machine"]["nproc"] >= 1
    assert "-m cllm.bench" in data["command"]
    m = data["runs"][0]["metrics"]
    for key in ("completed", "failed", "failures", "duration_s", "output_throughput",
                "request_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "cached_share"):
        assert key in m
    assert set(m["ttft_ms"]) == {"mean", "p50", "p90", "p99"}
    assert m["failures"] == {"HTTP 429: busy": 1}


def test_table_lists_runs_and_failures():
    text = report.table(_report()["runs"])
    assert text.count("llama-server") == 2 and "1 × HTTP 429: busy" in text
    assert all(name in text.splitlines()[0] for name in ("wall s", "tok/s", "ttft p99", "cached"))


def test_table_shows_cache_share_and_turns():
    data = _report()
    conversations = [[RequestResult(start=0, end=1, ttft=t, output_tokens=2, prompt_tokens=100,
                                    cached_tokens=c) for t, c in ((0.01, 0), (0.03, 75))]]
    data["runs"][0]["metrics"] = summarize(conversations[0], 1.0) | by_turn(conversations)
    lines = report.table(data["runs"]).splitlines()
    assert lines[1].endswith(" 37.5%") and lines[3].endswith("      -")
    assert lines[2] == "    TTFT p50 by turn, ms: 1: 10.0 · 2: 30.0 (last / first: 3.00)"


def test_header_names_machine_and_workload():
    data = _report()
    data["machine"].update(cpu="Xeon", nproc=2, gpu=["NVIDIA H100 80GB HBM3"],
                           cpu_flags={"avx2": True, "avx512f": False, "amx_tile": False})
    data["settings"].update(workload="shared-prefix", prefix_tokens=1400)
    assert report.header(data) == (
        "CPU: Xeon, 2 cores (avx2 yes, avx512f no, amx_tile no); GPU: NVIDIA H100 80GB HBM3\n"
        "workload: shared-prefix, document of 1400 tokens; 2 requests × 3 tokens a level")
    data["settings"].update(documents=64)
    assert "workload: shared-prefix, 64 documents of 1400 tokens;" in report.header(data)


def test_table_says_when_the_client_itself_was_near_a_core():
    runs = _report()["runs"]
    runs[0]["client_cpu_share"], runs[1]["client_cpu_share"] = 0.97, 0.3
    lines = report.table(runs).splitlines()
    busy = [i for i, line in enumerate(lines) if "the client itself used" in line]
    assert len(busy) == 1 and "97% of a core" in lines[busy[0]]
    assert lines[busy[0] - 2].split()[:2] == ["cllm", "c=1"]  # under its run (and its failure)

