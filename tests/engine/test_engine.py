"""The engine with the real default model: continuous batching end to end, no HTTP."""
import asyncio
import functools
import random

import pytest
from engine_checks import FaultyContext, assert_idle, run_tokens
from model_facts import ON_GPU_NOT_BATCH_INVARIANT

from cllm.config import EngineConfig, SamplingParams
from cllm.engine.engine import (
    Engine,
    EngineStoppedError,
    PromptTooLongError,
    default_backend_sampling,
    default_successor_wait,
)
from cllm.engine.prefix_cache import common_packed_prefix, pack
from cllm.engine.sequence import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from cllm.engine.successor_wait import HISTORY
from cllm.llama import _core

MAX_TOKENS = 12
CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
               "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
               "<|im_start|>assistant\n")
PROMPTS = [f"Question {i}: what is {i} plus {i % 7}? Answer:" for i in range(72)]


@pytest.fixture(scope="module")
def engine(model_path):
    # Split KV: each sequence attends over its own cells, which makes greedy output independent
    # of the batch on the CPU (what the seed matrix asserts).
    eng = Engine(EngineConfig(n_ctx=32 * 256, n_parallel=32, n_batch=512, n_threads=2,
                              kv_unified=False), model_path)
    yield eng
    eng.shutdown()


async def run(engine, prompt, **sampling):
    """(text, token ids, final delta) of one request."""
    return await run_tokens(engine, engine.model.tokenize(prompt), **sampling)


async def run_many(engine, prompts, concurrency, **sampling):
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt):
        async with gate:
            return await run(engine, prompt, **sampling)

    return await asyncio.gather(*(one(p) for p in prompts))


@pytest.fixture(scope="module")
def alone(engine):
    """Each prompt's greedy continuation when it runs by itself."""
    async def all_alone():
        return [await run(engine, p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                for p in PROMPTS]
    return asyncio.run(all_alone())


@pytest.mark.parametrize("concurrency", [8, 16, 24, 32])
@ON_GPU_NOT_BATCH_INVARIANT
def test_seed_matrix_every_request_completes_with_its_solo_text(engine, alone, concurrency):
    results = asyncio.run(run_many(engine, PROMPTS, concurrency, max_tokens=MAX_TOKENS,
                                   temperature=0, ignore_eos=True))
    for (text, tokens, final), (solo_text, solo_tokens, _) in zip(results, alone):
        assert final.finish_reason == FINISH_LENGTH and final.error is None
        assert final.completion_tokens == len(tokens) == MAX_TOKENS
        assert tokens == solo_tokens and text == solo_text
    assert_idle(engine)


def test_stop_string_spanning_tokens_is_not_emitted(engine):
    text, tokens, _ = asyncio.run(run(engine, "The capital of France is", max_tokens=20,
                                      temperature=0))
    assert "Paris" in text
    stop = "aris"  # starts inside a token
    cut, _, final = asyncio.run(run(engine, "The capital of France is", max_tokens=20,
                                    temperature=0, stop=(stop,)))
    assert final.finish_reason == FINISH_STOP
    assert cut == text[:text.index(stop)]


def collect(engine, tokens, **sampling):
    """Every delta of one request."""
    async def drain():
        return [d async for d in engine.submit(tokens, SamplingParams(**sampling))]
    return asyncio.run(drain())


def test_end_of_generation_token_stops_a_chat_reply(engine):
    deltas = collect(engine, engine.model.tokenize(CHAT_PROMPT, parse_special=True),
                     max_tokens=200, temperature=0)
    assert deltas[-1].finish_reason == FINISH_STOP
    assert deltas[-1].completion_tokens < 200
    assert engine.model.is_eog(deltas[-1].token_ids[-1])


def test_logprobs_arrive_with_each_token(engine):
    _, tokens, _ = asyncio.run(run(engine, "Hello", max_tokens=4, temperature=0))
    deltas = collect(engine, engine.model.tokenize("Hello"), max_tokens=4, temperature=0,
                     logprobs=3)
    entries = [lp for d in deltas for lp in d.logprobs]
    assert [e.token_id for e in entries] == tokens
    assert all(len(e.top) == 3 and e.top[0][0] == e.token_id for e in entries)


def test_logprobs_cover_the_returned_text_only_and_go_out_with_it(engine):
    """A stop string that begins inside a token and runs over two more: the logprobs end at the
    token partly returned (llama-server's rule), and a token's logprob never goes out before
    some of its text does (text that may begin the stop string is held back with its tokens)."""
    prompt = engine.model.tokenize("The capital of France is")
    _, tokens, _ = asyncio.run(run_tokens(engine, prompt, max_tokens=20, temperature=0))
    pieces = [engine.model.token_to_piece(t).decode() for t in tokens]
    k = next(i for i in range(2, len(pieces) - 2)
             if len(pieces[i].strip()) >= 2 and all(pieces[i + 1:i + 3]))
    stop = pieces[k][1:] + pieces[k + 1] + pieces[k + 2]
    deltas = collect(engine, prompt, max_tokens=20, temperature=0, logprobs=1, stop=(stop,))
    assert deltas[-1].finish_reason == FINISH_STOP
    text = "".join(d.text for d in deltas)
    assert text == "".join(pieces[:k]) + pieces[k][:1]
    entries = [e for d in deltas for e in d.logprobs]
    assert [e.token_id for e in entries] == tokens[:k + 1]
    sent_text, sent = "", 0
    for delta in deltas:
        sent_text += delta.text
        sent += len(delta.logprobs)
        assert len("".join(pieces[:sent - 1])) < len(sent_text) or sent == 0


def test_abort_mid_stream_frees_its_seq_id_within_a_step(engine):
    async def scenario():
        stream = engine.submit(engine.model.tokenize("Count: one, two,"),
                               SamplingParams(max_tokens=500, temperature=0, ignore_eos=True))
        async for delta in stream:
            if delta.token_ids:
                break
        seq = stream.seq
        held = seq.seq_id
        assert held is not None and engine.scheduler.cache.slots[held].live
        steps_at_abort = engine.timer.steps
        stream.abort()
        final = await stream.__anext__()
        while final.finish_reason is None:
            final = await stream.__anext__()
        return seq, final, engine.timer.steps - steps_at_abort

    seq, final, steps_after = asyncio.run(scenario())
    assert final.finish_reason == FINISH_ABORT
    assert steps_after <= 1  # at most the step already running when the abort came
    assert seq.num_output_tokens < 500
    assert_idle(engine)


def test_on_end_gets_each_final_delta_once_read_or_not(engine):
    async def scenario():
        ended = []
        tokens = engine.model.tokenize("Count: one, two,")
        read = engine.submit(tokens, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                             on_end=ended.append)
        async for _ in read:
            pass
        left = engine.submit(tokens, SamplingParams(max_tokens=500, temperature=0,
                                                    ignore_eos=True), on_end=ended.append)
        async for delta in left:
            if delta.token_ids:
                break
        left.abort()  # its final delta is never read
        while len(ended) < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.1)  # a second report would have arrived by now
        return ended

    ended = asyncio.run(asyncio.wait_for(scenario(), timeout=60))
    assert [d.finish_reason for d in ended] == [FINISH_LENGTH, FINISH_ABORT]
    assert ended[0].completion_tokens == 3 and 0 < ended[1].completion_tokens < 500
    assert_idle(engine)


def test_prompt_longer_than_a_sequence_context_is_refused(engine):
    async def scenario():
        return engine.submit(list(range(100, 100 + engine.max_seq_len)), SamplingParams())

    with pytest.raises(PromptTooLongError):
        asyncio.run(scenario())


def test_thousand_requests_leave_nothing_behind(engine):
    rng = random.Random(7)
    prompts = [f"Item {i}: {'word ' * rng.randint(1, 20)}" for i in range(1000)]

    async def scenario():
        gate = asyncio.Semaphore(48)

        async def one(i, prompt):
            async with gate:
                return await run(engine, prompt, max_tokens=rng.randint(1, 4),
                                 temperature=rng.choice([0.0, 0.8]), seed=i, ignore_eos=True)

        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    results = asyncio.run(scenario())
    assert all(final.finish_reason == FINISH_LENGTH and tokens for _, tokens, final in results)
    assert_idle(engine)


def test_tiny_unified_cache_completes_everything_through_preemption(model_path):
    # 8 sequences of ~30 prompt + 48 generated tokens need ~620 cells; the cache has 256.
    small = Engine(EngineConfig(n_ctx=256, n_parallel=8, n_batch=128, n_threads=2,
                                kv_unified=True), model_path)
    try:
        results = asyncio.run(run_many(small, PROMPTS[:8], 8, max_tokens=48, temperature=0,
                                       ignore_eos=True))
        assert all(final.finish_reason == FINISH_LENGTH and len(tokens) == 48
                   for _, tokens, final in results)
        assert small.scheduler.num_preemptions > 0
        assert_idle(small)
    finally:
        small.shutdown()


@ON_GPU_NOT_BATCH_INVARIANT
def test_decode_runs_in_c_give_the_same_tokens_and_stop_at_eog(model_path, alone):
    # Every prompt in the first step (prefill_stagger), so that the steps counted are decodes.
    multi = Engine(EngineConfig(n_ctx=16 * 256, n_parallel=16, n_batch=512, n_threads=2,
                                decode_steps=5, kv_unified=False, prefill_stagger=512),
                   model_path)
    try:
        assert multi.decode_steps == 5
        results = asyncio.run(run_many(multi, PROMPTS[:16], 16, max_tokens=MAX_TOKENS,
                                       temperature=0, ignore_eos=True))
        assert [tokens for _, tokens, _ in results] == [tokens for _, tokens, _ in alone[:16]]
        assert multi.timer.steps < MAX_TOKENS  # runs happened: one step a token would need more
        # and the step timer has the core's timing of their forward steps, within their laps
        timer = multi.timer
        assert timer.steps < timer.run_steps <= timer.forward_steps
        assert timer.run["llama_decode"] > 0 and timer.run["sample"] > 0
        assert 0 < timer.run["outside"] < timer.totals["decode"] - timer.run["llama_decode"]
        chat = multi.model.tokenize(CHAT_PROMPT, parse_special=True)
        deltas = collect(multi, chat, max_tokens=200, temperature=0)
        assert deltas[-1].finish_reason == FINISH_STOP
        assert multi.model.is_eog(deltas[-1].token_ids[-1])
        # A prompt cached but for its last token: that token is a step of its own, so the
        # first token leaves at once instead of with a run's worth of tokens.
        cached = collect(multi, chat, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
        assert cached[-1].cached_tokens == cached[-1].prompt_tokens - 1
        assert len(cached[0].token_ids) == 1 and len(cached[1].token_ids) > 1
        assert_idle(multi)
    finally:
        multi.shutdown()


# ---- the prefix cache with the real model ----

DOCUMENT = " ".join(f"Paragraph {i}: the harbour town kept its lighthouse lit through the "
                    f"winter storms of year {1900 + i}, and the keepers wrote it down."
                    for i in range(12))
QUESTIONS = [f"\nQuestion {i}: what happened in year {1900 + i}? Answer:" for i in range(8)]


@pytest.mark.parametrize("kv_unified", [True, False], ids=["one-pool", "split-streams"])
def test_sampling_in_the_graph_serves_every_kind_of_request_as_the_host_does(model_path,
                                                                             kv_unified):
    """Backend sampling (the GPU default) beside requests that need host logits: greedy,
    logprobs, a grammar and a seeded sample run together and give the host's tokens."""
    def requests(eng):
        return [run_tokens(eng, eng.model.tokenize(PROMPTS[0]), max_tokens=8, temperature=0),
                run_tokens(eng, eng.model.tokenize(PROMPTS[1]), max_tokens=8, temperature=0,
                           ignore_eos=True),
                run_tokens(eng, eng.model.tokenize(PROMPTS[2]), max_tokens=8, temperature=0,
                           logprobs=2),
                run_tokens(eng, eng.model.tokenize(PROMPTS[3]), max_tokens=8, temperature=0,
                           grammar=eng.grammars.gbnf('root ::= "yes" | "no"')),
                run_tokens(eng, eng.model.tokenize(PROMPTS[4]), max_tokens=8, temperature=0.8,
                           seed=11)]

    results = []
    for backend_sampling in (True, False):
        eng = Engine(EngineConfig(n_ctx=4096, n_parallel=8, n_threads=2, kv_unified=kv_unified,
                                  backend_sampling=backend_sampling), model_path)
        try:
            assert eng.ctx.backend_sampling is backend_sampling

            async def together():
                return await asyncio.gather(*requests(eng))
            results.append([(ids, delta.finish_reason) for _, ids, delta in asyncio.run(together())])
        finally:
            eng.shutdown()
    assert results[0] == results[1]


def test_default_kv_layout_is_split_on_a_cpu_and_one_pool_on_a_gpu(engine):
    default = EngineConfig()
    assert default.kv_unified is None and default.prefix_cache
    assert engine.kv_unified is False  # the module engine asks for split explicitly


def test_the_graph_samples_by_default_on_a_gpu_only(monkeypatch):
    monkeypatch.setattr(_core, "supports_gpu_offload", lambda: True)
    assert default_backend_sampling()
    monkeypatch.setattr(_core, "supports_gpu_offload", lambda: False)
    assert not default_backend_sampling()


def test_the_engine_waits_for_successors_by_default_on_a_cpu_only(monkeypatch):
    monkeypatch.setattr(_core, "supports_gpu_offload", lambda: True)
    assert default_successor_wait() == 0
    monkeypatch.setattr(_core, "supports_gpu_offload", lambda: False)
    assert default_successor_wait() == 0.5


def test_a_shared_prefix_is_computed_once(model_path):
    """8 concurrent requests share a document: it is prefilled once (7 report it cached, as far
    as their prompts agree, or to the last whole block where a CPU layout needs it), and a
    repeat of a whole prompt recomputes only its last token."""
    prompts = [DOCUMENT + q for q in QUESTIONS]
    eng = Engine(EngineConfig(n_ctx=8 * 1024, n_parallel=8, n_threads=2), model_path)
    try:
        assert eng.kv_unified is _core.supports_gpu_offload()  # the default layout
        assert eng.ctx.backend_sampling is _core.supports_gpu_offload()  # and sampling
        token_lists = [eng.model.tokenize(p) for p in prompts]

        async def together():
            return await asyncio.gather(*(run_tokens(eng, t, max_tokens=MAX_TOKENS,
                                                     temperature=0) for t in token_lists))
        results = asyncio.run(together())
        block = eng.scheduler.cache.block
        shared = min(common_packed_prefix(pack(token_lists[0]), pack(t)) for t in token_lists[1:])
        cached = sorted(final.cached_tokens for _, _, final in results)
        assert cached[0] == 0 and all(shared // block * block <= n <= shared for n in cached[1:])
        assert all(final.completion_tokens == MAX_TOKENS or final.finish_reason == FINISH_STOP
                   for _, _, final in results)
        assert_idle(eng)
        _, _, final = asyncio.run(run_tokens(eng, token_lists[3], max_tokens=2, temperature=0))
        assert final.cached_tokens == len(token_lists[3]) - 1
        _, _, final = asyncio.run(run_tokens(eng, token_lists[3], cache_prompt=False, max_tokens=2,
                                          temperature=0))
        assert final.cached_tokens == 0
        assert_idle(eng)
    finally:
        eng.shutdown()


def test_in_one_pool_only_replies_that_come_back_stay_cached(model_path):
    """One-shot requests leave only their prompts' cells in one pool (llama.cpp agrees); once a
    quarter of the requests continue earlier replies, as a chat's turns do, replies stay."""
    eng = Engine(EngineConfig(n_ctx=4096, n_parallel=4, n_threads=2, kv_unified=True),
                 model_path)
    try:
        prompts = [eng.model.tokenize(p) for p in PROMPTS[:5]]
        computed = 0  # prompt cells computed (a prompt may share the start of an earlier one)
        for prompt in prompts:
            _, _, final = asyncio.run(run_tokens(eng, prompt, max_tokens=20, temperature=0,
                                                 ignore_eos=True))
            computed += len(prompt) - final.cached_tokens
        # (The first request kept its reply until the second showed replies are not continued.)
        assert eng.cached_cells == computed
        assert_idle(eng)
        history, turns, cached = prompts[0], [], []
        for _ in range(4):  # turns 2 and 3: two continuations in the seven admissions counted
            turns.append(history + [9] * 20)  # a 20-token question (its text is not the point)
            _, ids, final = asyncio.run(run_tokens(eng, turns[-1], max_tokens=20, temperature=0,
                                                   ignore_eos=True))
            cached.append(final.cached_tokens)
            history = turns[-1] + ids
        # Turns 2 and 3 find only the last turn's prompt (replies were dropped); turn 3 keeps
        # its reply, and turn 4 starts from all of turn 3 but the last, undecoded token.
        assert cached[1:] == [len(turns[0]), len(turns[1]), len(turns[2]) + 19]
        assert_idle(eng)
    finally:
        eng.shutdown()


def test_in_one_pool_dropped_prompts_leave_no_cells_and_are_computed_again(model_path):
    """With prompts and replies dropped, a finished request leaves nothing in the pool
    (llama.cpp agrees), and the same prompt again is computed in full."""
    eng = Engine(EngineConfig(n_ctx=2048, n_parallel=2, n_threads=2, kv_unified=True,
                              cache_prompts="drop", cache_replies="drop"), model_path)
    try:
        prompt = eng.model.tokenize(PROMPTS[0])
        for _ in range(2):
            _, _, final = asyncio.run(run_tokens(eng, prompt, max_tokens=4, temperature=0))
            assert final.cached_tokens == 0
            assert eng.cached_cells == 0
            assert_idle(eng)
    finally:
        eng.shutdown()


def test_a_long_prompt_evicts_cached_prefixes_and_nothing_live_is_lost(model_path):
    small = Engine(EngineConfig(n_ctx=1024, n_parallel=4, n_batch=256, n_threads=2,
                                kv_unified=True), model_path)
    try:
        docs = [small.model.tokenize(f"Document {k}. " + DOCUMENT[k * 40:]) for k in range(3)]
        for doc in docs:  # three finished requests leave ~900 cells cached
            asyncio.run(run_tokens(small, doc[:300], max_tokens=2, temperature=0))
        assert small.cached_cells >= 850

        async def long_beside_running():
            running = run_tokens(small, docs[0][:40], max_tokens=60, temperature=0,
                                 ignore_eos=True)
            long = run_tokens(small, docs[1][:200] + docs[2][:500], max_tokens=20,
                              temperature=0, ignore_eos=True)
            return await asyncio.gather(running, long)

        results = asyncio.run(long_beside_running())
        assert [final.completion_tokens for _, _, final in results] == [60, 20]
        assert [final.finish_reason for _, _, final in results] == [FINISH_LENGTH] * 2
        assert small.scheduler.num_preemptions == 0  # cached prefixes made the room
        still_cached = [small.scheduler.cache.best_match(doc[:300], 299, None)[1] == 299
                        for doc in docs]
        assert not all(still_cached)
        assert_idle(small)
    finally:
        small.shutdown()


def test_a_thousand_mixed_requests_leave_only_the_cache(model_path):
    """Shared and unshared prompts, aborts and cache_prompt=false through a small shared pool:
    afterwards llama.cpp holds exactly the cached cells and no sequence is live."""
    pool = Engine(EngineConfig(n_ctx=2048, n_parallel=8, n_batch=256, n_threads=2,
                               kv_unified=True), model_path)
    rng = random.Random(7)
    heads = [pool.model.tokenize(DOCUMENT[k * 50:k * 50 + 400]) for k in range(4)]

    async def one(i, gate):
        tokens = rng.choice(heads)[:rng.randrange(1, 90)] + [rng.randrange(300, 20000)
                                                            for _ in range(rng.randrange(1, 6))]
        async with gate:
            stream = pool.submit(tokens, SamplingParams(max_tokens=rng.randrange(1, 4),
                                                        temperature=0),
                                 cache_prompt=i % 5 != 0)
            async for delta in stream:
                if i % 11 == 0:
                    stream.abort()
            return delta

    async def main():
        gate = asyncio.Semaphore(16)
        return await asyncio.gather(*(one(i, gate) for i in range(1000)))

    try:
        finals = asyncio.run(main())
        assert all(f.finish_reason in (FINISH_LENGTH, FINISH_STOP, FINISH_ABORT) for f in finals)
        assert sum(f.cached_tokens for f in finals) > 0
        assert_idle(pool)
    finally:
        pool.shutdown()


def test_greedy_text_is_the_same_cached_or_computed_and_whatever_runs_beside_it(model_path):
    """The default layout on a CPU: 8 requests over one 130-token preamble, at concurrency 8 with
    the prefix cache and again from a warm cache, give the texts each got alone with nothing
    cached. (Beyond 256 cells, a sequence decoded alone takes another of ggml's CPU attention
    paths than one decoded beside others: see docs/design/batch-invariance.md.)"""
    preamble = ("You are the harbour master's assistant. Answer each question about the "
                "harbour's records briefly and plainly. " * 7)
    prompts = [preamble + q for q in QUESTIONS]
    eng = Engine(EngineConfig(n_ctx=8 * 512, n_parallel=8, n_threads=2), model_path)
    try:
        if eng.kv_unified:
            pytest.xfail("llama.cpp's CUDA kernels are not batch-invariant (see test_core)")
        token_lists = [eng.model.tokenize(p) for p in prompts]
        first = pack(token_lists[0])
        assert 128 <= min(common_packed_prefix(first, pack(t)) for t in token_lists[1:])
        alone = [asyncio.run(run_tokens(eng, t, cache_prompt=False, max_tokens=40,
                                        temperature=0, ignore_eos=True))[0]
                 for t in token_lists]
        for t in token_lists:  # evict: every slot starts cold again
            asyncio.run(run_tokens(eng, [1] + t[1:2], max_tokens=1, temperature=0))
        assert eng.scheduler.cache.best_match(token_lists[0], len(token_lists[0]) - 1,
                                              None)[1] == 0

        async def together():
            return await asyncio.gather(*(run_tokens(eng, t, max_tokens=40, temperature=0,
                                                     ignore_eos=True) for t in token_lists))
        cold_cache = asyncio.run(together())
        assert sum(final.cached_tokens > 0 for _, _, final in cold_cache) == 7
        warm_cache = asyncio.run(together())
        assert all(final.cached_tokens > 0 for _, _, final in warm_cache)
        assert [text for text, _, _ in cold_cache] == alone
        assert [text for text, _, _ in warm_cache] == alone
    finally:
        eng.shutdown()


# ---- failures, injected ----


def test_kv_full_during_a_step_preempts_and_every_request_still_completes(model_path):
    eng = Engine(EngineConfig(n_ctx=1024, n_parallel=4, n_threads=2, kv_unified=True),
                 model_path)
    try:
        eng.ctx = FaultyContext(eng.ctx, _core.KVCacheFullError(1, "injected"))
        results = asyncio.run(run_many(eng, PROMPTS[:4], 4, max_tokens=8, temperature=0,
                                       ignore_eos=True))
        assert [final.completion_tokens for _, _, final in results] == [8] * 4
        assert eng.scheduler.num_preemptions == 1
        assert_idle(eng)
    finally:
        eng.shutdown()


def test_a_request_the_step_ended_hears_it_even_when_the_rest_of_that_step_fails(model_path):
    """The engine's loop fails after a step ended a request (here freeing its sampler raises):
    that request still gets its end, with its tokens, instead of waiting for ever; the engine
    then refuses new work with the failure stated."""
    class FailingEnd(FaultyContext):
        def end_sequence(self, *args):
            self._maybe_fail("end_sequence", args)
            return self._ctx.end_sequence(*args)

    eng = Engine(EngineConfig(n_ctx=1024, n_parallel=2, n_threads=2), model_path)
    try:
        eng.ctx = FailingEnd(eng.ctx, RuntimeError("injected"), method="end_sequence")

        async def scenario():
            return await asyncio.wait_for(run(eng, PROMPTS[0], max_tokens=3, temperature=0,
                                              ignore_eos=True), timeout=60)
        _, tokens, final = asyncio.run(scenario())
        assert final.finish_reason == FINISH_LENGTH and len(tokens) == 3
        try:  # refused at once, or, posted before the engine closed, ended with the failure
            _, _, later = asyncio.run(run(eng, PROMPTS[1], max_tokens=3))
            assert later.finish_reason == "error" and "injected" in later.error
        except EngineStoppedError as exc:
            assert "injected" in str(exc)
    finally:
        eng.shutdown()


class SamplesNothingOnce:
    """A context whose next step (`method`: "step" or "decode_run") gives its first row no
    token (-1) where it sampled one, once."""

    def __init__(self, ctx, method):
        self._ctx, self.method, self.done = ctx, method, False

    def step(self, *args):
        sampled = self._ctx.step(*args)
        if self.method == "step" and not self.done:
            sampled[0], self.done = -1, True
        return sampled

    def decode_run(self, *args, **kwargs):
        tokens, counts = self._ctx.decode_run(*args, **kwargs)
        if self.method == "decode_run" and not self.done and counts[0] > 1:
            tokens[counts[0] - 1], self.done = -1, True  # row 0's last token
        return tokens, counts

    def __getattr__(self, name):
        return getattr(self._ctx, name)


@pytest.mark.parametrize("method", ["step", "decode_run"])
def test_a_row_that_sampled_no_token_ends_its_request_with_an_error(model_path, method):
    """Never a request waiting for ever: it ends with the error (and the tokens it had, from a
    run), its cells go back, the other request and later ones go on."""
    eng = Engine(EngineConfig(n_ctx=1024, n_parallel=2, n_threads=2, kv_unified=True,
                              decode_steps=8 if method == "decode_run" else 1), model_path)
    try:
        eng.ctx = SamplesNothingOnce(eng.ctx, method)

        async def scenario():
            return await asyncio.wait_for(asyncio.gather(
                run(eng, PROMPTS[0], max_tokens=12, temperature=0, ignore_eos=True),
                run(eng, PROMPTS[1], max_tokens=12, temperature=0, ignore_eos=True)), 60)
        results = asyncio.run(scenario())
        assert eng.ctx.done
        finals = sorted(final.finish_reason for _, _, final in results)
        assert finals == ["error", "length"]
        failed = next(final for _, _, final in results if final.finish_reason == "error")
        assert failed.error == "the step sampled no token"
        assert asyncio.run(run(eng, PROMPTS[2], max_tokens=4, temperature=0,
                               ignore_eos=True))[2].finish_reason == FINISH_LENGTH
        assert_idle(eng)
    finally:
        eng.shutdown()


def test_a_failed_decode_ends_its_request_with_an_error_and_the_engine_goes_on(model_path):
    eng = Engine(EngineConfig(n_ctx=1024, n_parallel=4, n_threads=2, kv_unified=True),
                 model_path)
    try:
        eng.ctx = FaultyContext(eng.ctx, _core.DecodeError(-3, "injected"))
        _, tokens, final = asyncio.run(run(eng, PROMPTS[0], max_tokens=4))
        assert final.finish_reason == "error" and "injected" in final.error and tokens == []
        _, tokens, final = asyncio.run(run(eng, PROMPTS[2], max_tokens=4, temperature=0,
                                           ignore_eos=True))
        assert final.finish_reason == FINISH_LENGTH and len(tokens) == 4
        assert_idle(eng)
    finally:
        eng.shutdown()


@ON_GPU_NOT_BATCH_INVARIANT  # the short rows' texts are compared with theirs decoded alone
def test_a_row_that_fails_its_batch_fails_alone_and_the_others_go_on(model_path, alone):
    """A decode that fails whenever one long prefill is in the batch (as a GPU out of memory
    for that prefill would) ends only that request; the rows beside it decode their own text."""
    eng = Engine(EngineConfig(n_ctx=8 * 512, n_parallel=8, n_batch=512, n_threads=2,
                              decode_steps=1, kv_unified=False), model_path)
    try:
        long_prefill = _core.DecodeError(-2, "injected: no memory for this prefill")
        eng.ctx = FaultyContext(eng.ctx, long_prefill, times=-1,
                                when=lambda seq_ids, positions, n_tokens, *_: max(n_tokens) > 200)

        async def together():
            short = [run(eng, p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
                     for p in PROMPTS[:3]]
            return await asyncio.gather(run(eng, DOCUMENT, max_tokens=4), *short)
        (_, tokens, final), *short = asyncio.run(together())
        assert final.finish_reason == "error" and "no memory for this prefill" in final.error
        assert tokens == []
        assert [t for _, t, _ in short] == [t for _, t, _ in alone[:3]]
        assert all(f.finish_reason == FINISH_LENGTH for _, _, f in short)
        assert_idle(eng)
    finally:
        eng.shutdown()


@ON_GPU_NOT_BATCH_INVARIANT
def test_a_failed_decode_run_loses_no_request(model_path, alone):
    eng = Engine(EngineConfig(n_ctx=8 * 256, n_parallel=8, n_batch=512, n_threads=2,
                              decode_steps=5, kv_unified=False), model_path)
    try:
        eng.ctx = FaultyContext(eng.ctx, _core.DecodeError(-3, "injected"), after=2,
                                method="decode_run")
        results = asyncio.run(run_many(eng, PROMPTS[:8], 8, max_tokens=MAX_TOKENS,
                                       temperature=0, ignore_eos=True))
        assert eng.ctx.times == 0  # the fault happened
        assert [tokens for _, tokens, _ in results] == [tokens for _, tokens, _ in alone[:8]]
        assert all(final.finish_reason == FINISH_LENGTH for _, _, final in results)
        assert_idle(eng)
    finally:
        eng.shutdown()


def test_a_dead_engine_ends_its_requests_and_refuses_new_ones(model_path):
    eng = Engine(EngineConfig(n_ctx=1024, n_parallel=4, n_threads=2), model_path)
    try:
        def broken(now):
            raise RuntimeError("injected scheduler bug")
        eng.scheduler.schedule = broken
        _, _, final = asyncio.run(run(eng, PROMPTS[0], max_tokens=4))
        assert final.finish_reason == "error" and "injected scheduler bug" in final.error
        assert "injected scheduler bug" in eng.failure

        async def submit_again():
            eng.submit(eng.model.tokenize(PROMPTS[1]), SamplingParams(max_tokens=2))
        with pytest.raises(EngineStoppedError):
            asyncio.run(submit_again())
    finally:
        eng.shutdown()


@ON_GPU_NOT_BATCH_INVARIANT
def test_decode_runs_go_on_while_a_request_waits_for_a_slot(model_path, alone):
    """With every slot taken, a waiting request cannot start before a running one ends: the
    others decode in runs meanwhile, each ending at the step where a row stops (not one step
    a call, as while a slot is free), and the waiting request starts in the call after."""
    eng = Engine(EngineConfig(n_ctx=2048, n_parallel=1, n_threads=2, kv_unified=False,
                              decode_steps=8), model_path)
    try:
        results = asyncio.run(run_many(eng, PROMPTS[:3], 3, max_tokens=MAX_TOKENS,
                                       temperature=0, ignore_eos=True))
        assert [tokens for _, tokens, _ in results] == [tokens for _, tokens, _ in alone[:3]]
        assert_idle(eng)
    finally:
        eng.shutdown()
    # The engine thread counts a call after handing its tokens over, so the last call's count
    # is read once the thread has stopped. Each request: its prompt step, then runs of 8 over
    # its other MAX_TOKENS - 1 tokens.
    calls_each = 1 + -(-(MAX_TOKENS - 1) // 8)
    assert (eng.timer.steps, eng.timer.forward_steps) == (3 * calls_each, 3 * MAX_TOKENS)


def test_a_stop_string_inside_a_decode_run_counts_no_token_past_it(model_path, engine):
    """Decode runs of 8 steps stop where single steps stop: the same text and token count."""
    prompt = engine.model.tokenize("Count from one to twenty: one, two, three,")
    text, tokens, _ = asyncio.run(run_tokens(engine, prompt, max_tokens=30, temperature=0))
    stop = text[len(text) // 2:len(text) // 2 + 6]
    assert stop.strip()
    _, one_step, final_one = asyncio.run(run_tokens(engine, prompt, max_tokens=30, temperature=0,
                                                           stop=[stop]))
    runs = Engine(EngineConfig(n_ctx=2048, n_parallel=2, n_threads=2, kv_unified=False,
                               decode_steps=8), model_path)
    try:
        # max_tokens a few tokens past the stop string: a run that makes both ends at the
        # stop string too, not at max_tokens
        for max_tokens in (30, len(one_step) + 1, len(one_step) + 2, len(one_step) + 3):
            text_runs, in_runs, final_runs = asyncio.run(
                run_tokens(runs, prompt, max_tokens=max_tokens, temperature=0, stop=[stop]))
            assert final_runs.finish_reason == final_one.finish_reason == FINISH_STOP, max_tokens
            assert in_runs == one_step and final_runs.completion_tokens == len(one_step) < 30
            assert stop not in text_runs
        assert_idle(runs)
    finally:
        runs.shutdown()


@ON_GPU_NOT_BATCH_INVARIANT
@pytest.mark.parametrize("after", [0, 6], ids=["at-its-prompt", "mid-reply"])
def test_a_preempted_seeded_request_samples_what_it_would_have_alone(model_path, engine, after):
    """Its sampler, with its random generator's state, waits for it while it is preempted;
    also when it is preempted at its prompt step, with nothing cached (its slot cleared)."""
    prompt = engine.model.tokenize(PROMPTS[5])
    sampling = dict(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    alone = asyncio.run(run_tokens(engine, prompt, **sampling))[1]
    eng = Engine(EngineConfig(n_ctx=2048, n_parallel=2, n_threads=2, kv_unified=False),
                 model_path)
    try:
        eng.ctx = FaultyContext(eng.ctx, _core.KVCacheFullError(1, "injected"), after=after)
        preempted = asyncio.run(run_tokens(eng, prompt, **sampling))[1]
        assert eng.scheduler.num_preemptions == 1
        assert preempted == alone
        assert_idle(eng)
    finally:
        eng.shutdown()


def test_a_request_sent_as_another_ends_starts_in_the_next_step(model_path):
    """A client that sends its next request as soon as its last one ends: once a few ends have
    shown that, the engine waits for the successor after each end (successor_wait), so it
    starts in the very next step instead of after a decode step of the others. Each short
    request here is a prompt step and a decode step; between the steps that end two of them,
    the long request beside them decodes in those two steps only: once where first tokens go
    apart from the decodes (split streams on a CPU: in the second's decode step), twice where a
    prompt step carries them (a GPU). One decode step a call: a decode run goes on past a row's
    end and hands the end over when it stops, so the client sends the successor after the whole
    run."""
    eng = Engine(EngineConfig(n_ctx=4 * 512, n_parallel=4, n_threads=2, kv_unified=False,
                              successor_wait=0.5, decode_steps=1), model_path)
    try:
        decoded_at_ends = asyncio.run(_chain_beside_a_long_request(eng, PROMPTS[:16]))
        least_gap = 1 if eng.scheduler.first_tokens_apart else 2
        assert_idle(eng)
    finally:
        eng.shutdown()
    gaps = [b - a for a, b in zip(decoded_at_ends, decoded_at_ends[1:])]
    settled = gaps[HISTORY:]  # the first ends show the engine that successors come at once
    assert sum(gap == least_gap for gap in settled) >= 0.75 * len(settled), gaps


CLIENT_TURNAROUND = 0.001  # seconds from a request's end to its successor's arrival: over HTTP
# several; in this process without it, the successor would be in the inbox before the engine
# thread looks, wait or not.


async def _chain_beside_a_long_request(eng, prompts):
    """Send `prompts` one after another (two greedy tokens each), each CLIENT_TURNAROUND after
    the one before ends, beside one long request; return how many tokens the long one had been handed when each
    ended (counted once its end's step has been handed over whole)."""
    loop = asyncio.get_running_loop()
    long = eng.submit(eng.model.tokenize("Count: one, two,"),
                      SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True))
    decoded, marks, done = [0], [], loop.create_future()

    def count():
        decoded[0] += sum(len(delta.token_ids) for delta in long.ready())
        marks.append(decoded[0])

    def send(i):
        if i == len(prompts):
            long.abort()
            done.set_result(None)
            return
        def on_end(final):
            assert final.completion_tokens == 2
            loop.call_soon(count)
            loop.call_later(CLIENT_TURNAROUND, send, i + 1)
        eng.submit(eng.model.tokenize(prompts[i]), SamplingParams(max_tokens=2, temperature=0,
                                                                   ignore_eos=True), on_end=on_end)

    async for delta in long:  # its first token: it decodes from here on
        decoded[0] += len(delta.token_ids)
        break
    send(0)
    await done
    async for _ in long:  # its end, after the abort
        pass
    return marks


# ---- priority ----

async def _until_end(ended, name, stream, first_delta=None):
    """The text of `stream` from `first_delta` on; `name` joins `ended` when it ends."""
    text = first_delta.text if first_delta else ""
    async for delta in stream:
        text += delta.text
    ended.append(name)
    return text


@ON_GPU_NOT_BATCH_INVARIANT
def test_a_request_of_higher_priority_preempts_one_whose_text_stays_what_it_was(model_path):
    """Two low-priority requests hold both slots; an urgent one arrives, preempts the newer of
    them and ends first; the preempted one resumes and ends with the text it has alone (greedy
    and seeded)."""
    eng = Engine(EngineConfig(n_ctx=2 * 512, n_parallel=2, n_threads=2, kv_unified=False),
                 model_path)
    low = [dict(max_tokens=48, temperature=0, ignore_eos=True),
           dict(max_tokens=48, temperature=0.9, seed=5, ignore_eos=True)]
    try:
        alone = [asyncio.run(run(eng, PROMPTS[i], **low[i]))[0] for i in range(2)]
        ended = []
        until_end = functools.partial(_until_end, ended)

        async def together():
            streams = [eng.submit(eng.model.tokenize(PROMPTS[i]),
                                  SamplingParams(priority=5, **low[i])) for i in range(2)]
            firsts = [await stream.__anext__() for stream in streams]  # both run now
            lows = [asyncio.create_task(until_end(f"low{i}", streams[i], firsts[i]))
                    for i in range(2)]
            urgent = eng.submit(eng.model.tokenize(PROMPTS[2]),
                                SamplingParams(max_tokens=4, temperature=0, priority=0))
            await until_end("urgent", urgent)
            return await asyncio.gather(*lows)

        texts = asyncio.run(together())
        assert ended[0] == "urgent"
        assert eng.scheduler.num_preemptions == 1
        assert texts == alone
        assert_idle(eng)
    finally:
        eng.shutdown()


# ---- users ----

@ON_GPU_NOT_BATCH_INVARIANT
def test_a_person_beside_a_batch_runs_in_the_lane_and_no_text_changes(model_path):
    """A batch user holds both slots with more waiting; a person's request starts in the lane at
    once, ends before any batch request, and takes nothing from the batch: no preemption, every
    greedy text what it is alone."""
    eng = Engine(EngineConfig(n_ctx=2 * 512, n_parallel=2, n_threads=2, kv_unified=False),
                 model_path)
    batch = dict(max_tokens=40, temperature=0, ignore_eos=True, user="batch")
    try:
        assert eng.ctx.n_seq_max == 3 and eng.max_seq_len == 512  # the lane's stream, as long
        alone = [asyncio.run(run(eng, PROMPTS[i], **batch))[0] for i in range(4)]
        person_alone = asyncio.run(run(eng, PROMPTS[4], max_tokens=4, temperature=0))[0]
        ended = []
        until_end = functools.partial(_until_end, ended)

        async def together():
            streams = [eng.submit(eng.model.tokenize(PROMPTS[i]), SamplingParams(**batch))
                       for i in range(4)]
            firsts = [await streams[i].__anext__() for i in range(2)]  # two run, two wait
            tasks = [asyncio.create_task(until_end(f"batch{i}", streams[i],
                                                   firsts[i] if i < 2 else None))
                     for i in range(4)]
            person = eng.submit(eng.model.tokenize(PROMPTS[4]),
                                SamplingParams(max_tokens=4, temperature=0, user="person"))
            text = await until_end("person", person)
            return text, await asyncio.gather(*tasks)

        person_text, texts = asyncio.run(together())
        assert ended[0] == "person"
        assert eng.scheduler.num_preemptions == 0
        assert (person_text, texts) == (person_alone, alone)
        assert_idle(eng)
    finally:
        eng.shutdown()
