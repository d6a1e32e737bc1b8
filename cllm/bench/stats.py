"""The figures `vllm bench serve` reports, computed from one level's RequestResults.

TTFT, TPOT and end-to-end latency are per request; ITL pools every gap between text chunks
of every request, as vLLM does. Milliseconds throughout, except throughput and duration."""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

from .loadgen import RequestResult


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(seconds: Sequence[float]) -> dict[str, float | None]:
    """mean, p50 and p99 in milliseconds; None where there is nothing to measure (JSON null)."""
    if not seconds:
        return {"mean": None, "p50": None, "p99": None}
    ms = [s * 1000 for s in seconds]
    return {"mean": sum(ms) / len(ms), "p50": percentile(ms, 50), "p99": percentile(ms, 99)}


def summarize(results: Sequence[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(r.error for r in results if not r.ok).most_common()),
        "duration_s": duration,
        "total_output_tokens": output,
        "total_input_tokens": sum(prompt_counts),
        "mean_input_tokens": sum(prompt_counts) / len(prompt_counts) if prompt_counts else None,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(output),
        "total_token_throughput": rate(output + sum(prompt_counts)),
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution([gap for r in ok for gap in r.itl]),
        "e2el_ms": distribution([r.latency for r in ok]),
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in ok)),
    }
