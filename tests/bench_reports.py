"""A benchmark report with synthetic runs, for the tests of its table and its plot."""
from cllm.bench import report
from cllm.bench.loadgen import RequestResult
from cllm.bench.stats import summarize


def synthetic_report(tag="t") -> dict:
    """Two servers at levels 1 and 8, each level one good request and one refused."""
    data = report.new_report({"requests": 2, "max_tokens": 3}, tag)
    ok = RequestResult(start=0, end=0.5, ttft=0.1, itl=[0.2, 0.2], output_tokens=3, prompt_tokens=5)
    failed = RequestResult(start=0, end=0.1, error="HTTP 429: busy")
    for server in ("cllm", "llama-server"):
        for level in (1, 8):
            data["runs"].append({"server": server, "url": None, "model": "m", "concurrency": level,
                                 "warmup_failed": 0, "metrics": summarize([ok, failed], 1.0)})
    return data
