"""Micro-benchmarks (pytest-benchmark): `pytest bench/ --benchmark-only`.

Each measures one piece of the per-token path with the real default model, so a regression
shows where it happened. No assertions on time: the figures are the product."""
import asyncio
import random
from array import array

import httpx
import pytest
from server_process import ServerProcess  # tests/, put on the path by bench/conftest.py

from cllm.config import EngineConfig, SamplingParams
from cllm.engine.engine import Engine
from cllm.engine.pending import PendingTokens
from cllm.engine.prefix_cache import PrefixCache
from cllm.engine.scheduler import Scheduler
from cllm.engine.sequence import Sequence
from cllm.http import responses
from cllm.llama import _core
from cllm.models import resolve_model


@pytest.fixture(scope="module")
def model():
    return _core.Model(str(resolve_model()))


@pytest.fixture(scope="module")
def ctx(model):
    return _core.Context(model, n_ctx=64 * 256, n_seq_max=64, n_batch=512)


def ints(values):
    return array("i", values)


def test_tokenize_1000_tokens(benchmark, model):
    text = "The quick brown fox jumps over the lazy dog. " * 100
    assert len(benchmark(model.tokenize, text)) >= 1000


def _running(ctx, model, n_seqs, **sampling):
    """n_seqs sequences past a short prompt; returns their (positions, last tokens)."""
    prompt = model.tokenize("Once upon a time, in a land far away,")
    for s in range(n_seqs):
        ctx.remove_sequence(s)
        ctx.set_sampler(s, **sampling)
    last = ctx.step(ints(range(n_seqs)), ints([0] * n_seqs), ints([len(prompt)] * n_seqs),
                    ints([1] * n_seqs), ints(prompt * n_seqs))
    return [len(prompt)] * n_seqs, last


def _bench_decode_steps(benchmark, ctx, model, n_seqs, rounds, **sampling):
    _bench_steps_from(benchmark, ctx, *_running(ctx, model, n_seqs, **sampling), rounds)


def _bench_steps_from(benchmark, ctx, positions, last, rounds):
    """Decode steps of sequences 0..n-1, each at `positions[i]` after token `last[i]`."""
    n_seqs = len(positions)
    state = {"pos": positions, "last": last}

    def step():
        state["last"] = ctx.step(ints(range(n_seqs)), ints(state["pos"]), ints([1] * n_seqs),
                                 ints([1] * n_seqs), state["last"])
        state["pos"] = [p + 1 for p in state["pos"]]

    benchmark.pedantic(step, rounds=rounds, warmup_rounds=2)


@pytest.mark.parametrize("n_seqs", [1, 8, 32])
def test_core_decode_step(benchmark, ctx, model, n_seqs):
    """One llama_decode + greedy sampling for n_seqs decoding sequences."""
    _bench_decode_steps(benchmark, ctx, model, n_seqs, rounds=30)


def test_decode_step_over_a_shared_document(benchmark, model):
    """One step of 8 sequences over one 1,400-token document, each in a split stream of its
    own (the CPU default layout): attention over long contexts, where ggml's CPU flash
    attention (vendor/patches/) takes most of the step."""
    ctx = _core.Context(model, n_ctx=8 * 2048, n_seq_max=8, n_batch=512, kv_unified=False)
    document = model.tokenize("The harbour master kept careful records of every ship. " * 140)[:1400]
    for start in range(0, len(document), 512):
        chunk = document[start:start + 512]
        last = ctx.step(ints([0]), ints([start]), ints([len(chunk)]), ints([1]), ints(chunk))
    for s in range(1, 8):
        ctx.share_prefix(s, 0, len(document))
    _bench_steps_from(benchmark, ctx, [len(document)] * 8, ints([last[0]] * 8), rounds=20)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1},
                                      {"temperature": 0.7, "top_p": 0.95, "seed": 1},
                                      {"temperature": 0.8, "top_k": 40, "seed": 1}],
                         ids=["greedy", "t1", "t0.7-p0.95", "t0.8-k40"])
@pytest.mark.parametrize("n_seqs", [8, 32])
def test_sampling(benchmark, ctx, model, n_seqs, sampling):
    """A decode step at n_seqs sequences with the given sampler: the difference is sampling."""
    _bench_decode_steps(benchmark, ctx, model, n_seqs, rounds=20, **sampling)


def test_schedule_256_running(benchmark):
    """Planning one step (and accounting for it) with 256 decoding sequences."""
    sched = Scheduler(max_seqs=256, token_budget=512, kv_capacity=1 << 20, max_queue=256)
    for i in range(256):
        sched.add(Sequence(f"r{i}", [1] * 16, SamplingParams(max_tokens=1 << 20), 0.0))
    out = sched.schedule(0.0)
    sched.postprocess(out, [7] * len(out.chunks), 0.0)

    def step():
        plan = sched.schedule(1.0)
        sched.postprocess(plan, [7] * len(plan.chunks), 1.0)

    benchmark(step)


def test_schedule_and_account_a_decode_run_at_64(benchmark):
    """Planning a call of 64 decoding sequences and accounting for its decode run of 8 steps
    (Scheduler.postprocess_run), as a GPU engine does between runs."""
    sched = Scheduler(max_seqs=64, token_budget=512, kv_capacity=1 << 24, max_queue=64)
    for i in range(64):
        sched.add(Sequence(f"r{i}", [1] * 16, SamplingParams(max_tokens=1 << 24), 0.0))
    out = sched.schedule(0.0)
    sched.postprocess(out, [7] * len(out.chunks), 0.0)
    tokens = array("i", [7] * 64 * 8)

    def call():
        plan = sched.schedule(1.0)
        sched.postprocess_run(plan, tokens, [8] * len(plan.chunks), 8, 1.0)

    benchmark(call)


def test_prefix_match_over_128_slots_of_a_shared_document(benchmark):
    """Finding the longest cached prefix of a new request among 128 idle slots that each hold
    the same 1,400-token document, a question and a reply (one pool of 64 streams' seq ids)."""
    rng = random.Random(0)
    document = [rng.randrange(1000, 49000) for _ in range(1400)]

    def request(extra):  # its own int objects, as a tokenizer gives them
        return [int(str(t)) for t in document] + [rng.randrange(1000, 49000)
                                                   for _ in range(extra)]

    cache = PrefixCache(128, shared_cells=True)
    held = []
    for _ in range(128):
        tokens = request(96)
        placement = cache.place(tokens, 0, lambda slot: ([], 0))
        cache.start(placement)
        cache.extend(placement.dst, 0, len(tokens))
        held.append((placement.dst, tokens))
    for slot, tokens in held:
        cache.finish(slot, tokens, prompt_length=len(tokens) - 50)
    new = request(46)
    benchmark(cache.best_match, new, len(new) - 1, lambda slot: ([], 0))


@pytest.mark.parametrize("text", [" world", "世界"], ids=["ascii", "cjk"])
def test_sse_encoding_of_one_delta(benchmark, text):
    chunk = {"id": "cmpl-0123456789", "object": "text_completion", "created": 1, "model": "m",
             "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}]}
    assert benchmark(responses.sse_event, chunk).startswith(b"data: ")


@pytest.mark.parametrize("interval", [1, 4])
def test_pending_tokens_of_a_one_token_step(benchmark, interval):
    """What a stream's event loop does with each step's token at 32 streams (one token a step,
    as on a CPU): push it and take the deltas due."""
    streams = [PendingTokens(interval, logprobs=False) for _ in range(32)]

    def step():
        for pending in streams:
            pending.push([7], [" word"])

    benchmark(step)


def _bench_engine_timer(benchmark, model, config: EngineConfig, max_tokens: int, rounds: int,
                        stream_interval: int | None = None) -> None:
    """n_parallel streams of `max_tokens` greedy tokens a round; the engine's step timer over
    each round goes to extra_info."""
    engine = Engine(config, str(resolve_model()))

    async def load():
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        streams = [engine.submit(model.tokenize(f"Story {i}:"), sampling,
                                 stream_interval=stream_interval)
                   for i in range(config.n_parallel)]
        for stream in streams:
            async for _ in stream:
                pass

    def run():
        engine.timer.reset()
        asyncio.run(load())
        return engine.timer.summary()

    summary = benchmark.pedantic(run, rounds=rounds)
    benchmark.extra_info.update(summary)
    engine.shutdown()


def test_engine_step_overhead_at_32(benchmark, model):
    """The engine's Python share of a step at 32 sequences: the summary's overhead_share."""
    _bench_engine_timer(benchmark, model, EngineConfig(n_ctx=32 * 256, n_parallel=32,
                                                       decode_steps=1), max_tokens=40, rounds=3)


@pytest.mark.parametrize("interval", [1, None], ids=["delta-a-token", "delta-a-run"])
def test_engine_python_around_decode_runs_at_64(benchmark, model, interval):
    """The engine thread's Python a call into the core at 64 sequences in decode runs of 8, as
    on a GPU: the timer's schedule_ms and postprocess_ms in extra_info (on a GPU a forward step
    of the 1B shape is ~5 ms, so each millisecond here is a few percent of its throughput)."""
    config = EngineConfig(n_ctx=64 * 128, n_parallel=64, decode_steps=8, kv_unified=False)
    _bench_engine_timer(benchmark, model, config, max_tokens=64, rounds=2,
                        stream_interval=interval)


def test_http_round_trip_one_token(benchmark):
    """POST /v1/completions for one token against a real python -m cllm.serve."""
    with ServerProcess("--threads", "2") as server, httpx.Client(base_url=server.url,
                                                                 timeout=60) as client:
        body = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}
        benchmark(lambda: client.post("/v1/completions", json=body).raise_for_status())


@pytest.mark.parametrize("n_running", [1, 8])
def test_admission_to_first_token(benchmark, n_running):
    """From submit to a new request's first token while `n_running` others decode: the inbox,
    the next step's schedule, its prefill, and the delta back on the event loop."""
    engine = Engine(EngineConfig(n_ctx=16 * 1024, n_parallel=16), str(resolve_model()))
    loop = asyncio.new_event_loop()
    questions = (f"Question {i}: what is {i} times {i % 9}? Answer:" for i in range(10_000))

    async def drain(stream):
        async for _ in stream:
            pass

    async def start_background():
        sampling = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
        return [engine.submit(engine.model.tokenize(next(questions)), sampling)
                for _ in range(n_running)]

    async def first_token():
        stream = engine.submit(engine.model.tokenize(next(questions)),
                               SamplingParams(max_tokens=1, temperature=0))
        async for delta in stream:
            assert delta.token_ids or delta.finish_reason

    background = loop.run_until_complete(start_background())
    drains = [loop.create_task(drain(stream)) for stream in background]
    try:
        benchmark.pedantic(lambda: loop.run_until_complete(first_token()), rounds=20,
                           warmup_rounds=2)
    finally:
        for stream in background:
            stream.abort()
        loop.run_until_complete(asyncio.gather(*drains))
        loop.close()
        engine.shutdown()
