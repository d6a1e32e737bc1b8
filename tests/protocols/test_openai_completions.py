"""OpenAI's /v1/completions (cllm/protocols/openai.py) through the official SDK against the real
server: batches of prompts, whole and streamed."""
from __future__ import annotations

import openai
import pytest
from server_process import ServerProcess

from cllm.http.schemas import MAX_BATCH_CHOICES

MODEL = "smollm2-135m-instruct"
PROMPTS = ["1, 2, 3, 4,", "The capital of France is", "Once upon a time", "def add(a, b):"]
GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--parallel", "4") as srv:
        yield srv


@pytest.fixture(scope="module")
def alone(client):
    """Each prompt's greedy completion, asked for by itself."""
    return [client.completions.create(prompt=p, **GREEDY) for p in PROMPTS]


def test_a_batch_answers_each_prompt_as_alone(client, alone):
    """Choices indexed across prompts × n (prompt index * n + i), usage summed over the
    prompts, each prompt counted once for its n choices."""
    r = client.completions.create(prompt=PROMPTS, n=2, **GREEDY)
    assert [c.index for c in r.choices] == list(range(2 * len(PROMPTS)))
    for c in r.choices:
        single = alone[c.index // 2].choices[0]
        assert (c.text, c.finish_reason) == (single.text, single.finish_reason)
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)


def test_a_streamed_batch_builds_the_same_choices(client):
    whole = client.completions.create(prompt=PROMPTS, n=2, **GREEDY)
    texts, reasons, usage = {}, {}, None
    for chunk in client.completions.create(prompt=PROMPTS, n=2, stream=True,
                                           stream_options={"include_usage": True}, **GREEDY):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert reasons == {c.index: c.finish_reason for c in whole.choices}
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_a_batch_of_token_id_prompts(client, http, alone):
    ids = [http.post("/tokenize", json={"content": p, "add_special": True}).json()["tokens"]
           for p in PROMPTS[:2]]
    r = client.completions.create(prompt=ids, **GREEDY)
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone[:2]]
    r = http.post("/v1/completions", json={"prompt": ids, "return_token_ids": True, **GREEDY})
    assert [c["prompt_token_ids"] for c in r.json()["choices"]] == ids


def test_twenty_prompts_as_langchains_batches_send_them(client):
    prompts = [f"Question {i}: what is {i} plus {i}? Answer:" for i in range(20)]
    r = client.completions.create(prompt=prompts, model=MODEL, max_tokens=2, temperature=0)
    assert sorted(c.index for c in r.choices) == list(range(20))
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)


def test_a_batch_past_the_cap_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(prompt=["x"] * (MAX_BATCH_CHOICES + 1), **GREEDY)
    assert info.value.body["param"] == "prompt"
    assert client.completions.create(prompt="Hi", **GREEDY).choices[0].text  # still serving
