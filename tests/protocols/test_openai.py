"""OpenAI's chat completions (cllm/protocols/openai.py) through the official SDK against the real
server: the deprecated function-calling fields, fields refused by name, and logprobs at a stop
string."""
from __future__ import annotations

import json

import openai
import pytest
from http_checks import post_stream, sse_payloads
from server_process import ServerProcess

MODEL = "smollm2-135m-instruct"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--parallel", "2") as srv:
        yield srv


def test_a_forced_legacy_function_call_comes_back_as_function_call(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, functions=[WEATHER],
                                       function_call={"name": "get_weather"}, temperature=0,
                                       max_tokens=60)
    (choice,) = r.choices
    assert choice.finish_reason == "function_call", choice
    call = choice.message.function_call
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert choice.message.tool_calls is None


def test_a_streamed_legacy_function_call_comes_back_as_function_call(client):
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=ASK, functions=[WEATHER], function_call={"name": "get_weather"},
        temperature=0, max_tokens=60, stream=True))
    calls = [c.choices[0].delta.function_call for c in chunks
             if c.choices and c.choices[0].delta.function_call]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    assert chunks[-1].choices[0].finish_reason == "function_call"
    assert all(c.choices[0].delta.tool_calls is None for c in chunks if c.choices)


def test_a_legacy_conversation_goes_on_after_the_function_result(client):
    history = [*ASK, {"role": "assistant", "content": None,
                      "function_call": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
               {"role": "function", "name": "get_weather", "content": "Sunny, 24 C"}]
    r = client.chat.completions.create(model=MODEL, messages=history, functions=[WEATHER],
                                       function_call="none", temperature=0, max_tokens=20)
    assert r.choices[0].message.content and r.choices[0].message.function_call is None


@pytest.mark.parametrize("fields", [
    {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
    {"audio": {"voice": "alloy", "format": "wav"}},
    {"web_search_options": {}},
])
def test_audio_and_web_search_are_refused_by_name(client, fields):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **fields)
    assert info.value.body["param"] in fields


def test_the_text_modality_is_served(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=2,
                                       modalities=["text"])
    assert r.choices[0].message.content


def _logprob_tokens(path: str, whole: dict, chunks: list) -> list[list[str]]:
    """The tokens the logprobs of a whole reply and of a streamed one name."""
    if path == "/v1/completions":
        return [whole["choices"][0]["logprobs"]["tokens"],
                [t for c in chunks for t in (c["choices"][0]["logprobs"] or {}).get("tokens", [])]]
    content = lambda choice: (choice.get("logprobs") or {}).get("content") or []  # noqa: E731
    return [[e["token"] for e in content(whole["choices"][0])],
            [e["token"] for c in chunks if c["choices"] for e in content(c["choices"][0])]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_logprobs_end_where_the_text_ends_at_a_stop_string(http, path):
    """A stop string that begins inside a token and covers two more: the logprobs, whole and
    streamed, name the tokens of the returned text, the one partly in it included."""
    ask = ({"prompt": "The capital of France is"} if path == "/v1/completions"
           else {"messages": [{"role": "user", "content": "Describe Paris in one sentence."}]})
    ask |= {"model": MODEL, "max_tokens": 20, "temperature": 0}
    ask |= {"logprobs": 1} if path == "/v1/completions" else {"logprobs": True}
    free = http.post(path, json=ask).json()
    tokens = _logprob_tokens(path, free, [])[0]
    k = next(i for i in range(2, len(tokens) - 2)
             if len(tokens[i].strip()) >= 2 and all(tokens[i + 1:i + 3]))
    stop = tokens[k][1:] + tokens[k + 1] + tokens[k + 2]
    whole = http.post(path, json={**ask, "stop": [stop]}).json()
    _, body = post_stream(http, path, {**ask, "stop": [stop], "stream": True})
    chunks = sse_payloads(body)
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert _logprob_tokens(path, whole, chunks) == [tokens[:k + 1]] * 2
