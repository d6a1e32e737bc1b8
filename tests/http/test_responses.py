"""Response bodies and SSE framing (cllm/http/responses.py): no model needed."""
import json
import math

import pytest

from cllm.errors import APIError
from cllm.http.responses import (
    Token,
    chat_choice,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_logprobs,
    completion_response,
    generate_failure,
    generate_success,
    sse_event,
    token_name,
    usage_chunk,
    usage_dict,
)

ID, MODEL, CREATED = "cmpl-1", "smollm2", 1700000000


def test_usage():
    assert usage_dict(5, 7, 3) == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12,
                                   "prompt_tokens_details": {"cached_tokens": 3}}


def test_completion_response():
    choice = completion_choice(0, "Hi", "stop", None)
    assert completion_response(ID, MODEL, CREATED, [choice], usage_dict(1, 2)) == {
        "id": ID, "object": "text_completion", "created": CREATED, "model": MODEL,
        "choices": [{"index": 0, "text": "Hi", "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3,
                  "prompt_tokens_details": {"cached_tokens": 0}}}


def test_completion_chunk():
    assert completion_chunk(ID, MODEL, CREATED, 2, " there", None, None) == {
        "id": ID, "object": "text_completion", "created": CREATED, "model": MODEL,
        "choices": [{"index": 2, "text": " there", "logprobs": None, "finish_reason": None}]}


def test_completion_logprobs_clamp_minus_infinity():
    assert completion_logprobs(["a", "b"], [-0.5, -math.inf], [{"a": -0.5, "c": -math.inf}, {}],
                               [0, 1]) == {
        "tokens": ["a", "b"], "token_logprobs": [-0.5, -9999.0],
        "top_logprobs": [{"a": -0.5, "c": -9999.0}, {}], "text_offset": [0, 1]}


def test_chat_response():
    choice = chat_choice(0, "Hello!", "length", None)
    assert chat_response("chatcmpl-1", MODEL, CREATED, [choice], usage_dict(3, 4)) == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": CREATED, "model": MODEL,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"},
                     "logprobs": None, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                  "prompt_tokens_details": {"cached_tokens": 0}}}


def test_chat_chunks_role_then_content_then_finish():
    first = chat_chunk(ID, MODEL, CREATED, 0, role=True, text="", finish_reason=None,
                       logprobs=None)
    middle = chat_chunk(ID, MODEL, CREATED, 1, role=False, text="Hi", finish_reason=None,
                        logprobs=None)
    last = chat_chunk(ID, MODEL, CREATED, 0, role=False, text=None, finish_reason="stop",
                      logprobs=None)
    assert first == {"id": ID, "object": "chat.completion.chunk", "created": CREATED,
                     "model": MODEL, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                        "content": ""},
                                                  "logprobs": None, "finish_reason": None}]}
    assert middle["choices"] == [{"index": 1, "delta": {"content": "Hi"}, "logprobs": None,
                                  "finish_reason": None}]
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "stop"


def test_token_names():
    assert token_name("é".encode()) == "é"
    assert token_name(b"\xf0\x9f") == "bytes:\\xf0\\x9f"  # half of an emoji
    assert token_name(b"a\xe4") != token_name(b"a\xe5")


def test_chat_logprobs_carry_the_tokens_bytes():
    half, other = Token("bytes:\\xf0\\x9f", b"\xf0\x9f"), Token("<|im_end|>", None)
    assert chat_logprobs([(half, -0.1, [(half, -0.1), (other, -math.inf)])]) == {"content": [{
        "token": "bytes:\\xf0\\x9f", "logprob": -0.1, "bytes": [240, 159],
        "top_logprobs": [{"token": "bytes:\\xf0\\x9f", "logprob": -0.1, "bytes": [240, 159]},
                         {"token": "<|im_end|>", "logprob": -9999.0, "bytes": None}]}]}


def test_usage_chunks_have_no_choices():
    usage = usage_dict(1, 1)
    assert usage_chunk(ID, MODEL, CREATED, usage, chat=True) == {
        "id": ID, "object": "chat.completion.chunk", "created": CREATED, "model": MODEL,
        "choices": [], "usage": usage}
    assert usage_chunk(ID, MODEL, CREATED, usage, chat=False)["object"] == "text_completion"


def test_generate_bodies():
    assert generate_success("text", 3, "length") == {
        "success": True, "data": {"text": "text", "generated_tokens": 3, "finish_reason": "length"}}
    err = APIError(408, "request timed out", type="timeout_error", code="timeout")
    assert generate_failure(err) == {"success": False, "error": {
        "message": "request timed out", "type": "timeout_error", "code": "timeout"}}


def test_sse_framing_is_exact():
    assert sse_event({"a": "é", "b": [1, None]}) == 'data: {"a":"é","b":[1,null]}\n\n'.encode()
    assert sse_event("[DONE]") == b"data: [DONE]\n\n"


@pytest.mark.parametrize("text", ["a\x85b\u2028c\u2029d\re\nf",
                                  "你\x85好", "你\u2028好", "你\u2029好"])
def test_sse_event_stays_one_line_for_clients_that_split_on_unicode_line_breaks(text):
    # A model may generate any of them, alone or together, in non-ASCII text or not.
    event = sse_event({"text": text}).decode()
    lines = event.splitlines()
    assert len(lines) == 2 and lines[1] == ""
    assert json.loads(lines[0].removeprefix("data: ")) == {"text": text}


def test_sse_payload_with_logprobs_is_strict_json():
    event = sse_event(chat_chunk(ID, MODEL, CREATED, 0, role=False, text="x", finish_reason=None,
                                 logprobs=chat_logprobs([(Token("x", b"x"), -math.inf, [])])))
    assert b"Infinity" not in event and b"NaN" not in event
    payload = json.loads(event.removeprefix(b"data: ").removesuffix(b"\n\n"))
    assert payload["choices"][0]["logprobs"]["content"][0]["logprob"] == -9999.0
