"""The reported figures from synthetic results with known timings."""
import math

import pytest

from cllm.bench.loadgen import RequestResult
from cllm.bench.stats import by_turn, distribution, percentile, request_records, summarize


def test_percentile_interpolates_like_numpy():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_distribution_in_milliseconds():
    d = distribution([0.001, 0.002, 0.003])
    assert d == pytest.approx({"mean": 2.0, "p50": 2.0, "p90": 2.8, "p99": 2.98})
    assert distribution([]) == {"mean": None, "p50": None, "p90": None, "p99": None}


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


def test_itl_per_event_and_per_token():
    """Events of 4 tokens after a first one alone: the gap between events is 40 ms, 10 ms a
    token; usage says 13 tokens."""
    chunked = _result(0.0, 0.1, [0.04, 0.04, 0.04], 13)
    single = _result(0.0, 0.1, [0.01] * 12, 13)
    m = summarize([chunked], duration=1.0)
    assert m["itl_ms"]["p50"] == pytest.approx(40.0)
    assert m["itl_token_ms"]["p50"] == pytest.approx(10.0)
    assert m["tokens_per_event"] == pytest.approx(13 / 4)
    assert m["itl_token_ms"]["mean"] == pytest.approx(m["tpot_ms"]["mean"])
    m = summarize([single], duration=1.0)
    assert m["itl_ms"]["p50"] == m["itl_token_ms"]["p50"] == pytest.approx(10.0)
    assert m["tokens_per_event"] == 1.0
    whole = RequestResult(start=0, end=1, ttft=1, streamed=False, output_tokens=5)
    assert summarize([whole], 1.0)["tokens_per_event"] is None


def test_summarize_all_failed():
    m = summarize([RequestResult(error="x")], duration=0.0)
    assert m["completed"] == 0 and m["output_throughput"] == 0.0 and m["ttft_ms"]["p50"] is None


def _cached(prompt: int | None, cached: int | None, ttft: float = 0.1, **kw) -> RequestResult:
    return RequestResult(start=0, end=1, ttft=ttft, output_tokens=2, prompt_tokens=prompt,
                         cached_tokens=cached, **kw)


def test_cached_share_counts_only_requests_that_say():
    results = [_cached(100, 90), _cached(300, 0), _cached(50, None),
               _cached(100, 100, error="HTTP 500: boom")]
    m = summarize(results, duration=1.0)
    assert m["cached_share"] == pytest.approx(90 / 400) and m["total_cached_tokens"] == 90
    assert summarize([_cached(100, None)], 1.0)["cached_share"] is None


def test_by_turn():
    conversations = [[_cached(100, 0, ttft=0.1), _cached(300, 200, ttft=0.3)],
                     [_cached(100, 0, ttft=0.2), _cached(200, 100, ttft=0.5, error="x")]]
    figures = by_turn(conversations)
    first, last = figures["turns"]
    assert (first["turn"], first["completed"], last["turn"], last["completed"]) == (1, 2, 2, 1)
    assert first["ttft_ms"]["p50"] == pytest.approx(150.0)
    assert last["mean_input_tokens"] == 300 and last["cached_share"] == pytest.approx(2 / 3)
    assert first["cached_share"] == 0.0
    assert figures["ttft_p50_last_over_first"] == pytest.approx(300 / 150)
    assert by_turn([]) == {"turns": [], "ttft_p50_last_over_first": None}


def test_request_records_keep_each_request_in_send_order():
    results = [_result(2.5, 0.2, [0.1], 2, cached_tokens=7), _result(2.0, 0.05, [], 1),
               RequestResult(start=2.25, end=2.5, error="HTTP 500: boom")]
    records = request_records(results)
    assert [r["sent_s"] for r in records] == [0.0, 0.25, 0.5]
    assert records[0] == {"sent_s": 0.0, "ttft_ms": 50.0, "e2el_ms": 50.0, "output_tokens": 1,
                          "cached_tokens": None}
    assert records[1]["error"] == "HTTP 500: boom" and records[1]["ttft_ms"] is None
    assert records[2]["ttft_ms"] == 200.0 and records[2]["e2el_ms"] == pytest.approx(300.0)
    assert records[2]["cached_tokens"] == 7 and "error" not in records[2]
    assert request_records([]) == []
