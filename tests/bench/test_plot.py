"""The plot, from reports with synthetic runs."""
from bench_reports import synthetic_report as _report

from cllm.bench import plot, report


def test_plot_from_json(tmp_path):
    first = report.write(_report("a"), tmp_path)
    second = report.write(_report("b"), tmp_path)
    out = tmp_path / "both.png"
    report.main(["plot", str(first), str(second), "--out", str(out)])
    assert out.read_bytes().startswith(b"\x89PNG")


def test_a_joined_plot_draws_one_line_per_server_across_the_files():
    low, high = _report("low"), _report("high")
    for run in high["runs"]:
        run["concurrency"] *= 64  # the sweep's next levels, from servers started anew
    high["settings"]["requests"] = 128
    apart = plot._series([low, high], join=False)
    assert sorted(apart) == ["cllm (high)", "cllm (low)", "llama-server (high)",
                             "llama-server (low)"]
    joined = plot._series([low, high], join=True)
    assert sorted(joined) == ["cllm", "llama-server"]
    assert [run["concurrency"] for run in joined["cllm"]] == [1, 8, 64, 512]
    assert "2–128 requests × 3 tokens" in plot._title([low, high])


def test_runs_without_levels_are_not_plotted(tmp_path):
    users_only = {"server": "cllm", "shape": "backlogged", "users": {}, "targets": {}}
    data = {"runs": [users_only], "settings": {}, "machine": {}, "date": "d"}
    assert plot.plot([data], tmp_path / "p.png") is None
