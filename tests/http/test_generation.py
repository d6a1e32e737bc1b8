"""Serving one request's engine streams (cllm/http/generation.py): deltas merged in the batches they
arrived in, and a streamed response that writes each batch's events at once."""
import asyncio
import json

import pytest

from cllm.config import EngineConfig, SamplingParams
from cllm.engine.engine import Engine
from cllm.http.formats import CompletionFormat
from cllm.http.generation import Generation, merge

MAX_TOKENS = 17  # the first token from the prompt's step, then two decode runs of 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(model_path):
    eng = Engine(EngineConfig(n_ctx=2048, n_parallel=4, n_threads=2, kv_unified=False,
                              decode_steps=8), model_path)
    yield eng
    eng.shutdown()


def submit(engine, n=1):
    prompt = engine.model.tokenize("The history of the printing press begins")
    return [engine.submit(prompt, GREEDY.for_choice(i), stream_interval=1) for i in range(n)]


def test_a_decode_runs_deltas_come_in_one_batch(engine):
    async def batches():
        return [batch async for batch in merge(submit(engine))]

    sizes = [len(batch) for batch in asyncio.run(batches())]
    # One token a delta (interval 1): the first alone, then each run's eight together.
    assert sizes[0] == 1 and max(sizes) == 8 and sum(sizes) == MAX_TOKENS, sizes


def test_batches_of_several_streams_carry_every_delta_once(engine):
    async def deltas():
        return [item async for batch in merge(submit(engine, n=2)) for item in batch]

    items = asyncio.run(deltas())
    for index in (0, 1):
        mine = [delta for i, delta in items if i == index]
        assert sum(len(d.token_ids) for d in mine) == MAX_TOKENS
        assert [d.finish_reason is not None for d in mine] == [False] * (len(mine) - 1) + [True]


def test_a_batchs_events_go_out_in_one_write(engine):
    fmt = CompletionFormat("cmpl-test", "model", 0, None, False)  # no logprobs: no token lookups

    async def writes():
        generation = Generation(submit(engine), fmt)
        await generation.first_event()
        return [chunk async for chunk in generation.sse(include_usage=True)]

    writes_ = asyncio.run(writes())
    events = [[json.loads(line[6:]) if line != b"data: [DONE]" else "[DONE]"
               for line in write.split(b"\n\n") if line] for write in writes_]
    assert [len(e) for e in events[:3]] == [1, 8, 8]  # then the usage chunk, then [DONE]
    texts = [e["choices"][0]["text"] for write in events[:3] for e in write]
    assert len(texts) == MAX_TOKENS and all(texts[1:])
    assert events[3][0]["usage"]["completion_tokens"] == MAX_TOKENS
    assert events[-1] == ["[DONE]"]
