"""Request parsing and validation (cllm/http/schemas.py): no model needed."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cllm.config import SamplingParams
from cllm.errors import APIError
from cllm.http.schemas import (
    MAX_BATCH_CHOICES,
    ChatRequest,
    CompletionRequest,
    GenerateRequest,
    parse_chat,
    parse_completion,
    parse_detokenize,
    parse_generate,
    parse_json_body,
    parse_tokenize,
)

LIMITS = {"max_n": 4, "max_tokens_limit": 1000}


def completion(**fields):
    return parse_completion({"prompt": "Hello", **fields}, **LIMITS)


def chat(**fields):
    return parse_chat({"messages": [{"role": "user", "content": "Hi"}], **fields}, **LIMITS)


def rejects(call, param, status=400):
    """call() raises APIError with this status, naming param in the message and in .param."""
    with pytest.raises(APIError) as info:
        call()
    err = info.value
    assert err.status == status
    if param is not None:
        assert err.param == param
        assert param in err.message
    return err


# ---- APIError ----

def test_api_error_body_is_openai_shaped():
    err = APIError(429, "queue full", type="rate_limit_error", code="queue_full",
                   headers={"Retry-After": "1"})
    assert err.body() == {"error": {"message": "queue full", "type": "rate_limit_error",
                                    "code": "queue_full", "param": None}}
    assert err.status == 429 and err.headers == {"Retry-After": "1"} and str(err) == "queue full"
    assert APIError(400, "x").body()["error"]["type"] == "invalid_request_error"


# ---- parse_json_body ----

def test_json_body_parses_an_object():
    assert parse_json_body(b'{"prompt": "h\xc3\xa9"}', 100) == {"prompt": "hé"}


def test_json_body_keeps_escaped_surrogate_pairs():
    raw = b'{"prompt": "\\ud83d\\ude00 \\u00e9"}'
    assert parse_json_body(raw, 100) == {"prompt": "\U0001f600 \u00e9"}


def test_json_body_at_the_limit_passes_and_one_byte_over_is_413():
    raw = b'{"a": "' + b"x" * 10 + b'"}'
    assert parse_json_body(raw, len(raw)) == {"a": "x" * 10}
    err = rejects(lambda: parse_json_body(raw, len(raw) - 1), None, status=413)
    assert str(len(raw) - 1) in err.message


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b'{"prompt": "\\ud800"}', "lone surrogate"),
    (b'{"messages": [{"content": ["a", "\\udfff b"]}]}', "lone surrogate"),
    (b'{"\\ud83d": 1}', "lone surrogate"),
    (b'{"prompt": ', "not valid JSON"),
    (b"", "not valid JSON"),
    (b'{"a": NaN}', "not valid JSON"),
    (b'{"a": -Infinity}', "not valid JSON"),
    (b'{"a": 1e400}', "not valid JSON"),
    (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (b'"text"', "JSON object"),
    (b"null", "JSON object"),
])
def test_json_body_rejections(raw, words):
    err = rejects(lambda: parse_json_body(raw, 10_000_000), None)
    assert words in err.message


# ---- /v1/completions ----

def test_completion_defaults():
    req = completion()
    assert req == CompletionRequest(model=None, prompts=["Hello"], n=1, stream=False,
                                    include_usage=False, sampling=SamplingParams())
    assert req.sampling.max_tokens == 16 and req.sampling.temperature == 1.0


def test_completion_default_max_tokens_never_exceeds_the_limit():
    req = parse_completion({"prompt": "x"}, max_n=1, max_tokens_limit=8)
    assert req.sampling.max_tokens == 8


def test_completion_all_fields():
    req = completion(model="m", n=3, stream=True, stream_options={"include_usage": True},
                     max_tokens=1000, temperature=0, top_p=0.5, top_k=40, min_p=0.05,
                     repeat_penalty=1.1, presence_penalty=-2, frequency_penalty=2.0, seed=-1,
                     stop=["\n", "END"], ignore_eos=True, logprobs=20, echo=False,
                     user="someone", suffix=None, logit_bias={})
    assert (req.model, req.n, req.stream, req.include_usage) == ("m", 3, True, True)
    assert req.sampling == SamplingParams(
        max_tokens=1000, temperature=0.0, top_p=0.5, top_k=40, min_p=0.05, repeat_penalty=1.1,
        presence_penalty=-2.0, frequency_penalty=2.0, seed=-1, stop=("\n", "END"),
        ignore_eos=True, logprobs=20, user="someone")
    assert req.sampling.temperature == 0.0 and isinstance(req.sampling.temperature, float)


def test_completion_nulls_mean_defaults():
    req = completion(model=None, n=None, max_tokens=None, temperature=None, stop=None,
                     logprobs=None, seed=None, stream=None, stream_options=None)
    assert req == completion()


@pytest.mark.parametrize("temperature", [1e-40, 5e-324, 9.9e-7])
def test_temperatures_too_small_for_a_float_mean_greedy(temperature):
    """Below 1e-6, logits / temperature overflow a C float (NaN probabilities): greedy."""
    assert completion(temperature=temperature).sampling.temperature == 0.0
    assert chat(temperature=temperature).sampling.temperature == 0.0
    assert completion(temperature=1e-6).sampling.temperature == 1e-6


def test_completion_stop_as_one_string():
    assert completion(stop="###").sampling.stop == ("###",)


def test_include_usage_only_when_streaming():
    assert completion(stream_options={"include_usage": True}).include_usage is False


@pytest.mark.parametrize("prompt, expected", [
    ("text", ["text"]),
    (["text"], ["text"]),
    ([1, 2, 3], [[1, 2, 3]]),
    ([[0, 7]], [[0, 7]]),
    ([2**31 - 1], [[2**31 - 1]]),
    (["a", "b"], ["a", "b"]),                     # a batch, as OpenAI's SDK sends a list
    ([[1], [2, 3]], [[1], [2, 3]]),
    (["a", [5]], ["a", [5]]),
])
def test_completion_prompt_forms(prompt, expected):
    assert completion(prompt=prompt).prompts == expected


@pytest.mark.parametrize("prompt", [
    None, "", [], [""], [[]], 5, True, {"text": "x"},
    [1, -1], [1, 2**31], [1, True], [1, 2.0], [1, "2"], [10**30],
    ["a", ""], ["a", []], [[1], [-1]], [["a"], "b"], ["a", 5], [[1], [True]],
])
def test_completion_bad_prompts(prompt):
    body = {} if prompt is None else {"prompt": prompt}
    rejects(lambda: parse_completion(body, **LIMITS), "prompt")


def test_a_batch_makes_at_most_max_batch_choices():
    """prompts × n choices: up to MAX_BATCH_CHOICES (or max_n, if higher); past it a 400
    naming prompt. n alone stays bounded by max_n."""
    limit = max(MAX_BATCH_CHOICES, LIMITS["max_n"])
    assert len(completion(prompt=["x"] * limit).prompts) == limit
    assert completion(prompt=["x"] * (limit // 2), n=2).n == 2
    err = rejects(lambda: completion(prompt=["x"] * (limit // 2 + 1), n=2), "prompt")
    assert str(limit) in err.message
    rejects(lambda: completion(prompt=["x"] * (limit + 1)), "prompt")


@pytest.mark.parametrize("field, value", [
    ("max_tokens", "10"), ("max_tokens", 10.0), ("max_tokens", True), ("max_tokens", 0),
    ("max_tokens", -5),
    ("n", 0), ("n", -1), ("n", 5), ("n", "2"), ("n", False), ("n", 1.5),
    ("temperature", True), ("temperature", "0.7"), ("temperature", -0.1), ("temperature", 1e308),
    ("temperature", 10**30), ("temperature", 10**400), ("temperature", float("inf")),
    ("temperature", float("nan")),
    ("top_p", 1.5), ("top_p", [0.5]), ("min_p", -1), ("top_k", -1), ("top_k", 1.5),
    ("top_k", 10**30), ("repeat_penalty", 0), ("repeat_penalty", False),
    ("presence_penalty", 2.5), ("frequency_penalty", -3),
    ("seed", 1.5), ("seed", "42"), ("seed", True), ("seed", 10**30),
    ("stop", 5), ("stop", ["a", 5]), ("stop", [""]), ("stop", ""), ("stop", {"a": 1}),
    ("stop", ["s"] * 17), ("stop", ["x" * 257]),
    ("logprobs", 21), ("logprobs", -1), ("logprobs", True), ("logprobs", 1.0),
    ("ignore_eos", 1), ("ignore_eos", "true"),
    ("priority", 1.5), ("priority", "1"), ("priority", True), ("priority", 1 << 31),
    ("stream", "yes"), ("stream", 1), ("stream_options", "usage"), ("echo", "no"),
    ("echo", True), ("model", 5),
])
def test_completion_field_rejections(field, value):
    rejects(lambda: completion(**{field: value}), field)


def test_priority_is_read_on_every_route_that_samples():
    assert completion(priority=-2).sampling.priority == -2
    assert chat().sampling.priority == 0


TOOL = {"type": "function", "function": {"name": "f", "parameters": {}}}


def test_fields_that_would_change_the_output_are_refused_until_implemented():
    for parse in (completion, chat):
        err = rejects(lambda: parse(logit_bias={"50256": -100}), "logit_bias")
        assert "not supported" in err.message
    rejects(lambda: completion(best_of=3), "best_of")
    rejects(lambda: completion(suffix="end"), "suffix")
    assert completion(best_of=1, suffix="").n == 1  # what asks for nothing
    vllm = {"min_tokens": 5, "repetition_penalty": 1.3, "stop_token_ids": [7042],
            "include_stop_str_in_output": True, "skip_special_tokens": False}
    for parse in (completion, chat):
        for field, value in vllm.items():
            rejects(lambda: parse(**{field: value}), field)
    for field, value in {"echo": True, "add_generation_prompt": False,
                         "continue_final_message": True,
                         "chat_template_kwargs": {"enable_thinking": False}}.items():
        rejects(lambda: chat(**{field: value}), field)
    assert chat(min_tokens=0, repetition_penalty=1.0, stop_token_ids=[],
                include_stop_str_in_output=False, skip_special_tokens=True, echo=False,
                add_generation_prompt=True, continue_final_message=False,
                chat_template_kwargs={}).n == 1


# ---- structured output and tools ----

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("fields, kind, value", [
    ({"response_format": {"type": "json_object"}}, "json_schema", {"type": "object"}),
    ({"response_format": {"type": "json_object", "schema": SCHEMA}}, "json_schema", SCHEMA),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "json_schema", SCHEMA),
    ({"json_schema": SCHEMA}, "json_schema", SCHEMA),
    ({"grammar": 'root ::= "yes" | "no"'}, "gbnf", 'root ::= "yes" | "no"'),
])
def test_constraints_are_read_from_every_field_that_can_hold_one(fields, kind, value):
    for parse in (completion, chat):
        constraint = parse(**fields).constraint
        assert (constraint.kind, constraint.value) == (kind, value)
    assert parse_generate({"prompt": "x", **fields}, max_tokens_limit=10).constraint.value == value


@pytest.mark.parametrize("fields, param", [
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 5}}},
     "response_format.json_schema.schema"),
    ({"json_schema": "{}"}, "json_schema"),
    ({"grammar": ""}, "grammar"),
    ({"grammar": 'root ::= "a"', "json_schema": SCHEMA}, "grammar"),
])
def test_malformed_constraints_are_400s_naming_the_field(fields, param):
    rejects(lambda: chat(**fields), param)


def test_tools_and_tool_choice_are_parsed():
    tools = [TOOL, {"type": "function", "function": {"name": "g", "description": "d"}}]
    spec = chat(tools=tools, tool_choice={"type": "function", "function": {"name": "g"}},
                parallel_tool_calls=False).tools
    assert [t.name for t in spec.tools] == ["f", "g"] and spec.tools[1].description == "d"
    assert (spec.choice, spec.name, spec.parallel) == ("function", "g", False)
    assert spec.tools[1].parameters == {"type": "object", "properties": {}}
    assert chat(tools=tools).tools.choice == "auto"
    assert chat(tools=tools, tool_choice="required").tools.choice == "required"


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOL}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ({"tools": [TOOL, TOOL]}, "tools"),
    ({"tools": [TOOL], "tool_choice": "always"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "h"}}},
     "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": "f"}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": None}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "required", "json_schema": SCHEMA}, "tool_choice"),
])
def test_malformed_tools_are_400s_naming_the_field(fields, param):
    rejects(lambda: chat(**fields), param)


FUNCTION = {"name": "f", "description": "d", "parameters": {"type": "object"}}


def test_legacy_functions_are_tools_one_call_at_a_time():
    req = chat(functions=[FUNCTION, {"name": "g"}], function_call={"name": "g"})
    assert req.functions is True and chat().functions is False
    spec = req.tools
    assert [t.name for t in spec.tools] == ["f", "g"] and spec.tools[0].description == "d"
    assert (spec.choice, spec.name, spec.parallel) == ("function", "g", False)
    assert chat(functions=[FUNCTION]).tools.choice == "auto"
    assert chat(functions=[FUNCTION], function_call="none").tools.choice == "none"
    as_tool = {"type": "function", "function": FUNCTION}
    assert chat(functions=[FUNCTION]).tools.tools == chat(tools=[as_tool]).tools.tools


def test_legacy_function_turns_in_the_history_are_tool_turns():
    call = {"name": "f", "arguments": '{"x": 1}'}
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "function_call": call},
                {"role": "function", "name": "f", "content": "42"}]
    parsed = parse_chat({"messages": messages}, **LIMITS).messages
    assert parsed[1] == {"role": "assistant", "content": "",
                         "tool_calls": [{"type": "function", "function": call}]}
    assert parsed[2] == {"role": "tool", "content": "42"}
    bad = [*messages[:1], {"role": "assistant", "content": None, "function_call": "f"}]
    rejects(lambda: parse_chat({"messages": bad}, **LIMITS), "messages")


@pytest.mark.parametrize("fields, param", [
    ({"functions": FUNCTION}, "functions"),
    ({"functions": [{"name": "no spaces"}]}, "functions"),
    ({"functions": [FUNCTION, FUNCTION]}, "functions"),
    ({"functions": [FUNCTION], "function_call": "required"}, "function_call"),
    ({"functions": [FUNCTION], "function_call": {"name": "h"}}, "function_call"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"functions": [FUNCTION], "tools": [TOOL]}, "tools"),
    ({"functions": [FUNCTION], "tool_choice": "auto"}, "tool_choice"),
])
def test_malformed_legacy_functions_are_400s_naming_the_field(fields, param):
    rejects(lambda: chat(**fields), param)


@pytest.mark.parametrize("field, value", [
    ("modalities", ["text", "audio"]), ("modalities", ["audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}), ("web_search_options", {}),
])
def test_audio_and_web_search_are_refused_by_name(field, value):
    rejects(lambda: chat(**{field: value}), field)


def test_text_modality_asks_for_nothing():
    assert chat(modalities=["text"]) == chat()


def test_tool_calls_and_results_in_the_history_are_kept():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    parsed = parse_chat({"messages": messages}, **LIMITS).messages
    assert parsed[1] == {"role": "assistant", "content": "", "tool_calls": [call]}
    assert parsed[2] == {"role": "tool", "content": "42", "tool_call_id": "call_1"}
    bad = [*messages[:1], {"role": "assistant", "content": None, "tool_calls": [{"id": 1}]}]
    rejects(lambda: parse_chat({"messages": bad}, **LIMITS), "messages")


@pytest.mark.parametrize("field, value", [
    ("response_format", {"type": "text"}), ("response_format", None), ("tools", []),
    ("tools", None), ("tool_choice", "none"), ("tool_choice", None), ("logit_bias", {}),
    ("logit_bias", None),
])
def test_those_fields_asking_for_nothing_are_accepted(field, value):
    assert completion(**{field: value}) == completion()
    assert chat(**{field: value}) == chat()


def test_include_usage_must_be_boolean():
    rejects(lambda: completion(stream=True, stream_options={"include_usage": "yes"}),
            "include_usage")


def test_type_errors_say_what_was_sent():
    err = rejects(lambda: completion(max_tokens="10"), "max_tokens")
    assert err.message == "max_tokens must be an integer, got string"
    err = rejects(lambda: completion(temperature=True), "temperature")
    assert err.message == "temperature must be a number, got boolean"
    err = rejects(lambda: completion(n=9), "n")
    assert err.message == "n must be between 1 and 4, got 9"


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                max_size=4),
    max_leaves=12)
FIELDS = st.sampled_from([
    "prompt", "max_tokens", "n", "stream", "stream_options", "temperature", "top_p", "top_k",
    "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
    "ignore_eos", "logprobs", "echo", "model", "include_usage", "other"])


@settings(max_examples=500, deadline=None)
@given(st.dictionaries(FIELDS, JSON | st.integers(0, 50) | st.just([1, 2, 3]), max_size=8))
def test_any_json_object_parses_or_raises_api_error(body):
    try:
        req = parse_completion(body, **LIMITS)
    except APIError as err:
        assert err.status == 400 and err.message
    else:
        assert isinstance(req, CompletionRequest) and isinstance(req.sampling, SamplingParams)


# ---- /v1/chat/completions ----

def test_chat_defaults_run_to_the_limit():
    req = chat()
    assert req == ChatRequest(model=None, messages=[{"role": "user", "content": "Hi"}], n=1,
                              stream=False, include_usage=False,
                              sampling=SamplingParams(max_tokens=1000))


def test_chat_max_completion_tokens_wins_over_max_tokens():
    assert chat(max_tokens=5).sampling.max_tokens == 5
    assert chat(max_completion_tokens=7, max_tokens=5).sampling.max_tokens == 7
    rejects(lambda: chat(max_completion_tokens=0), "max_completion_tokens")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_clamped_to_it(field):
    """Clients send a fixed bound (Anthropic's 4,096) whatever the context: the reply ends with
    finish reason "length" where the context fills, as llama-server's does."""
    for value in (1001, 4096, 10**30):
        assert chat(**{field: value}).sampling.max_tokens == 1000
    assert completion(max_tokens=4096).sampling.max_tokens == 1000
    body = {"prompt": "x", "max_tokens": 4096}
    assert parse_generate(body, max_tokens_limit=1000).sampling.max_tokens == 1000


@pytest.mark.parametrize("fields, expected", [
    ({}, None),
    ({"logprobs": False}, None),
    ({"logprobs": True}, 0),
    ({"logprobs": True, "top_logprobs": 5}, 5),
    ({"logprobs": False, "top_logprobs": 0}, None),
])
def test_chat_logprobs(fields, expected):
    assert chat(**fields).sampling.logprobs == expected


@pytest.mark.parametrize("fields, param", [
    ({"logprobs": 3}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"n": 0}, "n"),
    ({"temperature": "hot"}, "temperature"),
])
def test_chat_field_rejections(fields, param):
    rejects(lambda: chat(**fields), param)


def test_chat_messages_are_normalized():
    req = parse_chat({"messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
        {"role": "tool", "content": "42", "tool_call_id": "x"},
        {"role": "user", "content": [], "name": "bob"},
    ]}, **LIMITS)
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "42", "tool_call_id": "x"},
        {"role": "user", "content": ""},
    ]


@pytest.mark.parametrize("messages, words", [
    (None, "non-empty array"),
    ([], "non-empty array"),
    ({"role": "user", "content": "x"}, "non-empty array"),
    (["hi"], "messages[0] must be an object"),
    ([{"content": "x"}], "messages[0].role"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": ["user"], "content": "x"}], "messages[0].role"),
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": "ok"},
      {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[1].content[0]"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}],
     "messages[0].content[1]"),
    ([{"role": "user", "content": ["plain string part"]}], "messages[0].content[0]"),
])
def test_chat_bad_messages(messages, words):
    body = {} if messages is None else {"messages": messages}
    err = rejects(lambda: parse_chat(body, **LIMITS), "messages")
    assert words in err.message


def test_chat_rejects_image_parts_saying_only_text_is_supported():
    err = rejects(lambda: chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:"}}]}]), "messages")
    assert "only text" in err.message


# ---- /generate, /tokenize, /detokenize ----

def test_generate_defaults():
    req = parse_generate({"prompt": "Once"}, max_tokens_limit=1000)
    assert req == GenerateRequest(prompt="Once", stream=False, sampling=SamplingParams(
        max_tokens=16, temperature=1.0, top_p=1.0, top_k=0))


def test_generate_fields():
    req = parse_generate({"prompt": "Once", "max_tokens": 50, "temperature": 0.7, "top_p": 0.9,
                          "top_k": 40, "stream": True, "seed": 7, "stop": ".",
                          "ignore_eos": True, "min_p": 0.1, "repeat_penalty": 1.2},
                         max_tokens_limit=1000)
    assert req.stream is True
    assert req.sampling == SamplingParams(max_tokens=50, temperature=0.7, top_p=0.9, top_k=40,
                                          seed=7, stop=(".",), ignore_eos=True, min_p=0.1,
                                          repeat_penalty=1.2)


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": [1, 2]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_k": True}, "top_k"),
    ({"prompt": "x", "stream": "false"}, "stream"),
    ({"prompt": "x", "logit_bias": {"1": 2}}, "logit_bias"),  # would change the output
])
def test_generate_rejections(body, param):
    rejects(lambda: parse_generate(body, max_tokens_limit=1000), param)


def test_tokenize():
    assert parse_tokenize({"content": "Hello"}) == ("Hello", False, False)
    assert parse_tokenize({"content": "", "add_special": True}) == ("", True, False)
    assert parse_tokenize({"content": "x", "with_pieces": True}) == ("x", False, True)
    rejects(lambda: parse_tokenize({"content": "x", "with_pieces": "yes"}), "with_pieces")
    rejects(lambda: parse_tokenize({}), "content")
    rejects(lambda: parse_tokenize({"content": [1]}), "content")
    rejects(lambda: parse_tokenize({"content": "x", "add_special": 1}), "add_special")


def test_return_token_ids_is_a_boolean_off_by_default():
    assert completion().return_token_ids is False and chat().return_token_ids is False
    assert completion(return_token_ids=True).return_token_ids is True
    assert chat(return_token_ids=True).return_token_ids is True
    rejects(lambda: completion(return_token_ids=1), "return_token_ids")


def test_detokenize():
    assert parse_detokenize({"tokens": [1, 0, 42]}) == [1, 0, 42]
    assert parse_detokenize({"tokens": []}) == []
    for tokens in (None, "1 2", [1, -1], [True], [1.0], [2**31]):
        rejects(lambda: parse_detokenize({"tokens": tokens}), "tokens")


def test_seed_space_is_llama_cpps_and_n_choices_wrap_within_it():
    from cllm.config import MAX_SEED
    assert MAX_SEED == 2**32 - 2  # 2**32 - 1 is llama.cpp's "random"
    assert SamplingParams(seed=-1).seed is None  # llama-server's "random"
    for outside in (2**32 - 1, 2**63, -2):
        with pytest.raises(ValueError, match="seed"):
            SamplingParams(seed=outside)
    last = SamplingParams(seed=MAX_SEED)
    assert [last.for_choice(i).seed for i in range(3)] == [MAX_SEED, 0, 1]
    assert SamplingParams().for_choice(5).seed is None
