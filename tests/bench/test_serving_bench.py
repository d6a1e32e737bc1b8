"""The serving-benchmark figures and loads: goodput against SLOs, open-loop Poisson levels,
ShareGPT-like lengths, several runs and their spread. No server: fake senders and results."""
import asyncio
import json
import math
import random

import pytest

from cllm.bench import prompts, report
from cllm.bench.cli import parse_args
from cllm.bench.loadgen import (
    HttpTarget,
    Level,
    LoadSettings,
    ReplyLengths,
    RequestResult,
    Sized,
    run_open_loop,
)
from cllm.bench.stats import meets, summarize
from cllm.bench.workloads import plans


def _result(ttft: float, latency: float, tokens: int) -> RequestResult:
    return RequestResult(start=0.0, end=latency, ttft=ttft, output_tokens=tokens)


# ---- goodput ----

def test_a_request_is_good_when_it_meets_every_bound():
    r = _result(ttft=0.2, latency=1.2, tokens=11)  # TPOT (1.2 - 0.2) / 10 = 100 ms
    assert meets(r, {"ttft": 200, "tpot": 100}) and meets(r, {"e2el": 1200})
    assert not meets(r, {"ttft": 199}) and not meets(r, {"ttft": 500, "tpot": 99})
    assert meets(_result(0.1, 0.1, 1), {"tpot": 1})  # one token: TPOT 0, as vLLM counts it


def test_goodput_counts_good_requests_per_second_and_their_share():
    results = [_result(0.1, 1.0, 10), _result(0.9, 2.0, 10),
               RequestResult(start=0, end=1, error="HTTP 500")]
    m = summarize(results, duration=2.0, slo={"ttft": 500})
    assert m["goodput"] == {"slo_ms": {"ttft": 500}, "good_requests": 1,
                            "request_goodput": 0.5, "good_share": pytest.approx(1 / 3)}
    assert "goodput" not in summarize(results, duration=2.0)


# ---- the command line ----

def test_request_rates_make_open_loop_levels():
    args = parse_args(["--url", "u", "--request-rate", "4", "inf", "1", "--max-concurrency",
                       "8", "--goodput", "ttft:500", "tpot:50", "--runs", "3"])
    assert args.levels == [Level(8, 1.0), Level(8, 4.0), Level(8, math.inf)]
    assert [level.label for level in args.levels] == ["rate=1 c<=8", "rate=4 c<=8",
                                                      "rate=inf c<=8"]
    assert args.goodput == {"ttft": 500.0, "tpot": 50.0} and args.runs == 3
    assert args.parallel == 8
    closed = parse_args(["--url", "u", "--concurrency", "2", "1"])
    assert closed.levels == [Level(1), Level(2)] and closed.goodput is None


@pytest.mark.parametrize("argv", [
    ["--max-concurrency", "4"], ["--request-rate", "0"], ["--request-rate", "x"],
    ["--request-rate", "1", "--workload", "multi-turn"], ["--goodput", "ttft"],
    ["--goodput", "latency:5"], ["--goodput", "ttft:-1"], ["--dataset-path", "f.json"],
    ["--runs", "0"],
])
def test_rejected(argv):
    with pytest.raises(SystemExit):
        parse_args(["--url", "u", *argv])


# ---- the open loop ----

def _recording_sender(log: list):
    """A fake server: each request takes a few event-loop turns; the log says how many were
    in flight whenever one started."""
    in_flight = 0

    async def send(prompt):
        nonlocal in_flight
        in_flight += 1
        log.append((prompt, in_flight))
        for _ in range(5):
            await asyncio.sleep(0)
        in_flight -= 1
        return RequestResult(start=0, end=1, ttft=0.5, output_tokens=1, text=str(prompt))
    return send


def test_an_infinite_rate_sends_everything_at_once_and_keeps_the_order():
    log = []
    results, _ = asyncio.run(run_open_loop(_recording_sender(log), list(range(10)), math.inf,
                                           None, seed=0))
    assert [r.text for r in results] == [str(i) for i in range(10)]
    assert max(n for _, n in log) == 10  # nothing waited for an earlier reply


def test_max_concurrency_caps_an_open_loop():
    log = []
    results, _ = asyncio.run(run_open_loop(_recording_sender(log), list(range(10)), math.inf,
                                           3, seed=0))
    assert len(results) == 10 and max(n for _, n in log) == 3


def test_poisson_gaps_are_seeded_exponential_draws(monkeypatch):
    """The loop sleeps the gaps of a seeded exponential sequence at the given rate."""
    slept = []

    async def fake_sleep(seconds):
        slept.append(seconds)

    async def send(prompt):
        return RequestResult(output_tokens=1)

    monkeypatch.setattr(asyncio, "sleep", fake_sleep)
    asyncio.run(run_open_loop(send, list(range(4)), 2.0, None, seed=7))
    rng = random.Random(7)
    assert slept == [rng.expovariate(2.0) for _ in range(4)]


# ---- ShareGPT-like lengths ----

def test_sharegpt_lengths_are_seeded_heavy_tailed_and_filtered():
    rng = random.Random(1)
    pairs = [prompts.sharegpt_lengths(rng) for _ in range(2000)]
    assert pairs == [prompts.sharegpt_lengths(r) for r in [random.Random(1)] for _ in range(2000)]
    assert all(4 <= i <= 1024 and o >= 4 and i + o <= 2048 for i, o in pairs)
    ins, outs = sorted(i for i, _ in pairs), sorted(o for _, o in pairs)
    assert 80 < ins[1000] < 125 and 105 < outs[1000] < 160  # medians near 100 and 130
    assert sum(ins) / len(ins) > 1.5 * ins[1000]  # a long tail: the mean far above the median


def test_sharegpt_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    reply = "word " * 40  # 200 characters: about 50 tokens
    path.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "Tell me about the sea, please."},
                           {"from": "gpt", "value": reply}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": reply}]},
        {"conversations": [{"from": "human", "value": "alone"}]}, {"other": 1}]))
    assert prompts.sharegpt_file(path) == [("Tell me about the sea, please.", 50)]
    path.write_text("[]")
    with pytest.raises(SystemExit):
        prompts.sharegpt_file(path)


def test_each_run_of_a_level_gets_its_own_prompts():
    """So a repeat does not find the previous run's prompts in the prefix cache."""
    args = parse_args(["--url", "u", "--workload", "mixed", "--requests", "4", "--warmup", "0",
                       "--concurrency", "1", "2", "--runs", "2"])
    texts = [tuple(plan.prompts) for plan in plans(args)]
    assert len(texts) == 4 and len(set(texts)) == 4


def test_sharegpt_workload_sends_each_request_its_own_max_tokens():
    args = parse_args(["--url", "u", "--workload", "sharegpt", "--requests", "5",
                       "--warmup", "1", "--concurrency", "1", "2"])
    first, second = plans(args)
    assert len(first.prompts) == 5 and all(isinstance(p, Sized) for p in first.prompts)
    assert first.prompts != second.prompts
    body = HttpTarget("http://x", "m", LoadSettings(max_tokens=50), None).body(first.prompts[0])
    assert body["max_tokens"] == first.prompts[0].max_tokens
    assert body["prompt"] == first.prompts[0].prompt


def test_a_free_run_can_ask_for_the_reply_lengths_a_constrained_run_produced():
    lengths = ReplyLengths(default=160)
    conversation = [{"role": "user", "content": "a ticket"}]
    replies = {"short": RequestResult(output_tokens=12), json.dumps(conversation): RequestResult(
        output_tokens=94), "failed": RequestResult(output_tokens=3, error="HTTP 500")}

    async def constrained(prompt):
        return replies[prompt if isinstance(prompt, str) else json.dumps(prompt)]

    asked = []

    async def free(prompt):
        asked.append(prompt)
        return RequestResult(output_tokens=prompt.max_tokens)

    async def run():
        record, sized = lengths.recording(constrained), lengths.sized(free)
        for prompt in ("short", conversation, "failed"):
            await record(prompt)
        return [await sized(p) for p in ("short", conversation, "failed", "never sent")]

    results = asyncio.run(run())
    assert [r.output_tokens for r in results] == [12, 94, 160, 160]  # no length: the default
    assert asked[1] == Sized(conversation, 94)
    body = HttpTarget("http://x", "m", LoadSettings(endpoint="chat"), None).body(asked[1])
    assert body["messages"] == conversation and body["max_tokens"] == 94 and body["ignore_eos"]


# ---- several runs ----

def test_the_table_shows_levels_goodput_and_the_spread_of_runs():
    runs = []
    for repeat, (tokens, ttft) in enumerate([(10, 0.1), (12, 0.3)]):
        m = summarize([_result(ttft, 1.0, tokens)], 1.0, slo={"ttft": 200})
        runs.append({"server": "cllm", "concurrency": None, "request_rate": 2.0,
                     "level": "rate=2", "repeat": repeat, "metrics": m})
    text = report.table(runs)
    rows = text.splitlines()
    assert "rate=2" in rows[1] and "good/s" in rows[0] and "ttft p90" in rows[0]
    assert rows[1].split()[-2] == "1.00" and rows[2].split()[-2] == "0.00"
    assert rows[-1] == ("spread over 2 runs, cllm rate=2: tok/s 10.0–12.0 (cv 9.1%); "
                        "TTFT p50 ms 100.0–300.0 (cv 50.0%)")
