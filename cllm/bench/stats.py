"""The figures `vllm bench serve` reports, computed from one level's RequestResults.

TTFT, TPOT and end-to-end latency are per request; ITL pools every gap between text chunks
(SSE events) of every request, as vLLM does; ITL per token divides each gap by the tokens its
event carried (RequestResult.token_gaps), and tokens per event says how many that is.
Milliseconds throughout, except throughput and duration.
Beyond vLLM's: the share of prompt tokens the servers took from their cache, and for
conversations the figures of each turn."""
from __future__ import annotations

import itertools
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


PERCENTILES = (50, 90, 99)
# What --goodput can bound, in milliseconds: a request is good if it meets every bound given.
SLO_METRICS = ("ttft", "tpot", "e2el")


def distribution(seconds: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90 and p99 in milliseconds; None where there is nothing to measure (JSON
    null)."""
    if not seconds:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = [s * 1000 for s in seconds]
    return {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in PERCENTILES}}


def meets(r: RequestResult, slo: dict[str, float]) -> bool:
    """Whether a completed request meets every bound of `slo` (metric → ms). As vLLM counts
    it, a reply of one token has a TPOT of 0."""
    values = {"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.latency}
    return all(values[name] is not None and values[name] * 1000 <= bound
               for name, bound in slo.items())


def goodput(ok: Sequence[RequestResult], total: int, duration: float,
            slo: dict[str, float]) -> dict:
    """Requests that met the SLO: how many, per second of the level, and their share of all
    requests sent (failed ones included)."""
    good = sum(meets(r, slo) for r in ok)
    return {"slo_ms": dict(slo), "good_requests": good,
            "request_goodput": good / duration if duration > 0 else 0.0,
            "good_share": good / total if total else 0.0}


def summarize(results: Sequence[RequestResult], duration: float,
              slo: dict[str, float] | None = None) -> dict:
    """The level's figures; with `slo`, its goodput too."""
    ok = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    rate = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(r.error for r in results if not r.ok).most_common()),
        "resent": sum(r.resent for r in results),  # sent again on a new connection
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
        "itl_token_ms": distribution([gap for r in ok for gap in r.token_gaps]),
        "tokens_per_event": tokens_per_event(ok),
        "e2el_ms": distribution([r.latency for r in ok]),
        "finish_reasons": dict(Counter(str(r.finish_reason) for r in ok)),
        "total_cached_tokens": sum(r.cached_tokens or 0 for r in ok),
        "cached_share": cached_share(ok),
        **({"goodput": goodput(ok, len(results), duration, slo)} if slo else {}),
    }


def tokens_by(r: RequestResult, moment: float) -> float:
    """A completed request's output tokens that had reached the client by `moment`: a
    stream's first event one, each later event an even part of the rest (as token_gaps spreads
    them); a reply not streamed, all of them at its end."""
    if not r.ok or r.ttft is None:
        return 0.0
    if not r.streamed:
        return float(r.output_tokens) if r.end <= moment else 0.0
    events = sum(t <= moment for t in itertools.accumulate(r.itl, initial=r.start + r.ttft))
    if events == 0 or not r.itl:
        return float(r.output_tokens) if events else 0.0
    return 1 + (events - 1) * (r.output_tokens - 1) / len(r.itl)


def tokens_per_event(results: Sequence[RequestResult]) -> float | None:
    """Output tokens over the streamed events that carried them; None when nothing was
    streamed."""
    streamed = [r for r in results if r.events]
    events = sum(r.events for r in streamed)
    return sum(r.output_tokens for r in streamed) / events if events else None


def cached_share(results: Sequence[RequestResult]) -> float | None:
    """Cached prompt tokens over prompt tokens, among the requests whose server said both;
    None when none did (a server that does not report it is not a server with no hits)."""
    known = [r for r in results if r.cached_tokens is not None and r.prompt_tokens]
    prompt = sum(r.prompt_tokens for r in known)
    return sum(r.cached_tokens for r in known) / prompt if prompt else None


def request_records(results: Sequence[RequestResult]) -> list[dict]:
    """Each request of a level in the order it was sent: when (seconds after the level's first
    send), its TTFT and end-to-end time (ms), tokens out, prompt tokens from the cache, and its
    error if it failed. Medians hide shapes, e.g. two waves of one workload."""
    first = min((r.start for r in results), default=0.0)
    return [{"sent_s": round(r.start - first, 4),
             "ttft_ms": None if r.ttft is None else round(1000 * r.ttft, 2),
             "e2el_ms": round(1000 * r.latency, 2), "output_tokens": r.output_tokens,
             "cached_tokens": r.cached_tokens, **({"error": r.error} if not r.ok else {})}
            for r in sorted(results, key=lambda r: r.start)]


def by_turn(conversations: Sequence[Sequence[RequestResult]]) -> dict:
    """TTFT, prompt size and cache share of each turn index over the conversations, and how
    much slower the last turn's first token is than the first's (TTFT p50, last / first)."""
    turns = []
    for k in range(max((len(c) for c in conversations), default=0)):
        ok = [c[k] for c in conversations if len(c) > k and c[k].ok]
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        turns.append({"turn": k + 1, "completed": len(ok),
                      "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
                      "mean_input_tokens": sum(prompts) / len(prompts) if prompts else None,
                      "cached_share": cached_share(ok)})
    first, last = (turns[0]["ttft_ms"]["p50"], turns[-1]["ttft_ms"]["p50"]) if turns else (0, 0)
    return {"turns": turns, "ttft_p50_last_over_first": last / first if first and last else None}
