"""The reported figures from synthetic results with known timings."""
import math

import pytest

from cllm.bench.loadgen import RequestResult
from cllm.bench.stats import distribution, percentile, summarize


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_distribution_in_milliseconds():
    d = distribution([0.001, 0.002, 0.003])
    assert d == pytest.approx({"mean": 2.0, "p50": 2.0, "p99": 2.98})
    assert distribution([]) == {"mean": None, "p50": None, "p99": None}


def _result(start: float, ttft: float, gaps: list[float], tokens: int, **kw) -> RequestResult:
    end = start + ttft + sum(gaps)
    return RequestResult(start=start, end=end, ttft=ttft, itl=gaps, output_tokens=tokens,
                         prompt_tokens=10, finish_reason="length", **kw)


def test_summarize():
    results = [
        _result(0.0, 0.1, [0.02, 0.02, 0.02], 4),
        _result(0.5, 0.3, [0.04, 0.04, 0.04], 4),
        RequestResult(start=0.1, end=0.2, error="HTTP 500: boom"),
        RequestResult(start=0.1, end=0.2, error="HTTP 500: boom"),
        RequestResult(start=0.1, end=0.3, error="empty response"),
    ]
    m = summarize(results, duration=2.0)
    assert (m["completed"], m["failed"]) == (2, 3)
    assert m["failures"] == {"HTTP 500: boom": 2, "empty response": 1}
    assert m["total_output_tokens"] == 8 and m["output_throughput"] == pytest.approx(4.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["total_input_tokens"] == 20 and m["mean_input_tokens"] == 10
    assert m["ttft_ms"]["mean"] == pytest.approx(200.0)
    # TPOT per request: (latency - ttft) / (tokens - 1) = 20 ms and 40 ms.
    assert m["tpot_ms"]["mean"] == pytest.approx(30.0)
    assert m["tpot_ms"]["p50"] == pytest.approx(30.0)
    # ITL pools all six gaps.
    assert m["itl_ms"]["mean"] == pytest.approx(30.0)
    assert m["itl_ms"]["p99"] == pytest.approx(40.0)
    assert m["e2el_ms"]["mean"] == pytest.approx((160 + 420) / 2)
    assert m["finish_reasons"] == {"length": 2}


def test_summarize_all_failed():
    m = summarize([RequestResult(error="x")], duration=0.0)
    assert m["completed"] == 0 and m["output_throughput"] == 0.0 and m["ttft_ms"]["p50"] is None
