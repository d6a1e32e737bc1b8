"""Ollama's API (cllm/protocols/ollama.py): its bodies read without a model, then the real server
through the `ollama` client and raw requests."""
import json
import math
import os
from importlib.metadata import version

import httpx
import jsonschema
import ollama
import pytest
from server_process import ServerProcess

from cllm.errors import APIError
from cllm.http.formats import Choice
from cllm.protocols.ollama import DEFAULTS, OllamaFormat, parse_request, read_keep_alive

MODEL = "smollm2-135m-instruct"


# ---- bodies, without a model ----

def test_ollama_defaults_apply_to_options_left_out():
    req = parse_request({}, limit=1000)
    s = req.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_penalty) == tuple(
        DEFAULTS[k] for k in ("temperature", "top_k", "top_p", "min_p", "repeat_penalty"))
    assert s.max_tokens == 1000  # num_predict -1: until the context is full
    assert req.stream and req.constraint is None


def test_options_map_to_sampling():
    req = parse_request({"stream": False, "options": {
        "temperature": 0, "top_k": 5, "top_p": 0.5, "min_p": 0.1, "seed": 7, "num_predict": 12,
        "stop": ["\n"], "repeat_penalty": 1.3, "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "repeat_last_n": 64, "mirostat": 0}}, limit=1000)
    s = req.sampling
    assert (s.temperature, s.top_k, s.top_p, s.min_p, s.seed, s.max_tokens, s.stop) == (
        0.0, 5, 0.5, 0.1, 7, 12, ("\n",))
    assert (s.repeat_penalty, s.presence_penalty, s.frequency_penalty) == (1.3, 0.5, 0.25)
    assert not req.stream


def test_format_becomes_a_json_schema_constraint():
    assert parse_request({"format": "json"}, 10).constraint.value == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert parse_request({"format": schema}, 10).constraint.value == schema
    assert parse_request({"format": ""}, 10).constraint is None


@pytest.mark.parametrize("value, seconds", [
    (300, 300), (-1, -1), ("5m", 300), ("1h30m", 5400), ("0", 0), ("-1", -1), ("1.5s", 1.5),
    ("250ms", 0.25), ("-1m", -60)])
def test_keep_alive_durations(value, seconds):
    assert read_keep_alive({"keep_alive": value}) == pytest.approx(seconds)


@pytest.mark.parametrize("value", ["soon", "5x", "1h30", True])
def test_a_keep_alive_that_is_no_duration_is_refused_by_name(value):
    with pytest.raises(APIError) as info:
        read_keep_alive({"keep_alive": value})
    assert info.value.status == 400 and info.value.param == "keep_alive"


@pytest.mark.parametrize("body, param", [
    ({"options": {"mirostat": 2}}, "options.mirostat"),
    ({"options": {"num_gpu": 1}}, "options.num_gpu"),
    ({"options": {"repeat_last_n": 128}}, "options.repeat_last_n"),
    ({"options": {"num_predict": 0}}, "options.num_predict"),
    ({"options": {"num_ctx": 1001}}, "options.num_ctx"),
    ({"options": {"top_p": 2}}, "top_p"),
    ({"think": True}, "think"), ({"logprobs": True}, "logprobs"),
    ({"format": "yaml"}, "format"), ({"stream": "yes"}, "stream"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(APIError) as info:
        parse_request(body, limit=1000)
    assert info.value.status == 400 and info.value.param == param
    assert param.split(".")[-1] in info.value.message


def _format(chat: bool) -> OllamaFormat:
    return OllamaFormat("id", MODEL, 0, None, False, chat=chat, tool_calls=chat, started=0,
                        load_ns=5)


def test_a_reply_s_tool_call_comes_in_ollama_s_shape():
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    body = _format(chat=True).response([Choice(text=text, finish_reason="stop",
                                               prompt_tokens=9, completion_tokens=20)])
    assert body["message"] == {"role": "assistant", "content": "Sure.", "tool_calls": [
        {"function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}}}]}
    assert body["done"] and body["done_reason"] == "stop" and body["load_duration"] == 5


# ---- the server ----

@pytest.fixture(scope="module")
def server():
    with ServerProcess("--parallel", "2", "--ctx-size", "4096") as srv:
        yield srv


@pytest.fixture(scope="module")
def api(server):
    return ollama.Client(host=server.url, timeout=120)


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


def _tokens(server, text):
    return httpx.post(server.url + "/tokenize", json={"content": text}).json()["tokens"]


def _check_measurements(reply, max_tokens):
    assert reply.done and reply.done_reason in ("stop", "length")
    assert 0 < reply.eval_count <= max_tokens
    assert reply.prompt_eval_count > 0
    assert 0 < reply.prompt_eval_duration and 0 < reply.eval_duration
    assert reply.total_duration >= reply.prompt_eval_duration + reply.eval_duration
    assert reply.load_duration >= 0 and reply.created_at.endswith("Z")


def test_chat_whole_and_streamed_give_the_same_greedy_reply(api):
    messages = [{"role": "user", "content": "Name three colours."}]
    options = {"temperature": 0, "num_predict": 12}
    whole = api.chat(model=MODEL, messages=messages, options=options, stream=False)
    parts = list(api.chat(model=MODEL, messages=messages, options=options, stream=True))
    assert whole.message.role == "assistant" and whole.message.content
    _check_measurements(whole, 12)
    assert not any(p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count


def test_generate_counts_the_raw_prompt_and_stops_at_num_predict(api, server):
    prompt = "Zebras in the quantum orchard counted"
    reply = api.generate(model=MODEL, prompt=prompt, raw=True,
                         options={"temperature": 0, "num_predict": 5})
    assert reply.prompt_eval_count == len(_tokens(server, prompt))
    assert reply.eval_count == 5 and reply.done_reason == "length" and reply.response
    _check_measurements(reply, 5)
    assert reply.context is None  # deprecated in Ollama: not returned


def test_generate_streams_ndjson(server):
    with httpx.stream("POST", server.url + "/api/generate", timeout=120, json={
            "model": MODEL, "prompt": "Hello", "options": {"num_predict": 4, "seed": 1}}) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [line["done"] for line in lines] == [False] * (len(lines) - 1) + [True]
    assert lines[-1]["eval_count"] == 4 and lines[-1]["done_reason"] == "length"


def test_num_ctx_bounds_the_sequence(api, server):
    prompt = "One two three"
    n = len(_tokens(server, prompt))
    reply = api.generate(model=MODEL, prompt=prompt, raw=True,
                         options={"num_ctx": n + 3, "temperature": 0})
    assert reply.eval_count == 3 and reply.done_reason == "length"


def test_format_json_and_a_schema(api):
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    reply = api.chat(model=MODEL, messages=[{"role": "user", "content": "A person as JSON"}],
                     format=schema, options={"temperature": 0, "num_predict": 60})
    jsonschema.validate(json.loads(reply.message.content), schema)
    reply = api.generate(model=MODEL, prompt="A list of fruits as JSON", format="json",
                         options={"temperature": 0, "num_predict": 60})
    assert isinstance(json.loads(reply.response), dict)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def _asked_and_answered(city):
    """An exchange in Ollama's shape: a call with its arguments as an object, its result."""
    return [{"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": city}}}]},
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
            {"role": "assistant", "content": f"It is sunny in {city}."}]


def test_a_tool_call_comes_in_ollama_s_shape_whole_and_streamed(api):
    # Two earlier exchanges show SmolLM2 the convention; greedy, it then calls the tool.
    messages = [*_asked_and_answered("Rome"), *_asked_and_answered("Oslo"),
                {"role": "user", "content": "Weather in Paris?"}]
    options = {"temperature": 0, "num_predict": 60}
    whole = api.chat(model=MODEL, messages=messages, tools=[WEATHER], options=options)
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})]
    assert whole.message.content == "" and whole.done_reason == "stop"
    parts = list(api.chat(model=MODEL, messages=messages, tools=[WEATHER], options=options,
                          stream=True))
    streamed = [(c.function.name, c.function.arguments)
                for p in parts for c in p.message.tool_calls or ()]
    assert streamed == calls and parts[-1].done


def test_embed_and_the_older_embeddings(api, server):
    reply = api.embed(model=MODEL, input=["a cat", "the stock market"])
    assert len(reply.embeddings) == 2 and reply.prompt_eval_count > 0
    assert all(math.isclose(math.hypot(*v), 1.0, rel_tol=1e-4) for v in reply.embeddings)
    openai = httpx.post(server.url + "/v1/embeddings", json={"input": "a cat"}).json()
    assert reply.embeddings[0] == pytest.approx(openai["data"][0]["embedding"], abs=1e-6)
    older = api.embeddings(model=MODEL, prompt="a cat")
    assert older.embedding == pytest.approx(reply.embeddings[0], abs=1e-6)


def test_embed_truncates_unless_told_not_to(server):
    long = "word " * 20000
    assert _post(server, "/api/embed", {"input": long}).status_code == 200
    refused = _post(server, "/api/embed", {"input": long, "truncate": False})
    assert refused.status_code == 400 and "tokens" in refused.json()["error"]
    dims = _post(server, "/api/embed", {"input": "x", "dimensions": 8})
    assert dims.status_code == 400 and "dimensions" in dims.json()["error"]


def test_tags_show_ps_and_version_describe_the_model(api, server, model_path):
    (listed,) = api.list().models
    assert listed.model == MODEL and listed.size == os.path.getsize(model_path)
    details = listed.details
    assert (details.format, details.family, details.parameter_size,
            details.quantization_level) == ("gguf", "llama", "134.52M", "Q4_1")
    shown = api.show(MODEL)
    assert shown.details == details and "<|im_start|>" in shown.template
    assert shown.modelinfo["general.architecture"] == "llama"
    assert "completion" in shown.capabilities and "insert" not in shown.capabilities
    (loaded,) = api.ps().models
    assert loaded.expires_at.year > 2300  # resident for good, as Ollama shows keep_alive < 0
    (card,) = httpx.get(server.url + "/v1/models").json()["data"]
    assert loaded.context_length == card["max_model_len"]
    assert loaded.size_vram in (0, card["meta"]["size"])  # the weights, where a GPU holds them
    assert httpx.get(server.url + "/api/version").json() == {"version": version("cllm")}


def test_an_empty_request_answers_that_the_model_is_loaded(server):
    for path, body in (("/api/chat", {"messages": []}), ("/api/generate", {})):
        r = _post(server, path, {"model": MODEL, **body})
        assert r.status_code == 200 and r.json()["done_reason"] == "load"


@pytest.mark.parametrize("path, body, name", [
    ("/api/chat", {"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]},
     "images"),
    ("/api/generate", {"prompt": "hi", "images": ["aGk="]}, "images"),
    ("/api/generate", {"prompt": "hi", "context": [1, 2]}, "context"),
    ("/api/generate", {"prompt": "hi", "template": "{{ .Prompt }}"}, "template"),
    ("/api/generate", {"prompt": "def f(", "suffix": ")"}, "suffix"),  # no FIM tokens
    ("/api/generate", {"prompt": "hi", "raw": True, "system": "x"}, "system"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}], "think": True}, "think"),
    ("/api/chat", {"messages": [{"role": "user", "content": "hi"}],
                   "options": {"mirostat": 1}}, "mirostat"),
    ("/api/show", {"model": MODEL, "verbose": True}, "verbose"),
])
def test_refusals_come_in_ollama_s_error_shape(server, path, body, name):
    r = _post(server, path, {"model": MODEL, **body})
    assert r.status_code == 400 and set(r.json()) == {"error"} and name in r.json()["error"]


def test_the_client_sees_refusals_and_unknown_models(api):
    with pytest.raises(ollama.ResponseError) as info:
        api.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                 options={"num_ctx": 10**6})
    assert info.value.status_code == 400 and "num_ctx" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        api.chat(model="llama3:8b", messages=[{"role": "user", "content": "hi"}])
    assert info.value.status_code == 404 and "llama3:8b" in info.value.error
