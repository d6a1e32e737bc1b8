"""/v1/responses (OpenAI's Responses API, stateless): parsing without a model, then the real
server through the official openai SDK."""
from __future__ import annotations

import openai
import pytest
from model_facts import ON_GPU_NOT_BATCH_INVARIANT
from server_process import ServerProcess

from cllm.errors import APIError
from cllm.protocols.openai_responses import parse_request

MODEL = "smollm2-135m-instruct"
QUESTION = "Name three colours."


def parse(**fields):
    return parse_request({"input": QUESTION, **fields}, max_tokens_limit=100)


# ---- parsing ----

def test_string_input_is_one_user_message_and_instructions_the_system_one():
    req = parse(instructions="Be brief.", max_output_tokens=5, temperature=0)
    assert req.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": QUESTION}]
    assert req.sampling.max_tokens == 5 and req.sampling.temperature == 0 and not req.stream
    assert parse().sampling.max_tokens == 100


def test_message_items_with_text_parts():
    req = parse(input=[
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": QUESTION}])
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "user"]
    assert req.messages[2]["content"] == "Hello!"


@pytest.mark.parametrize("fields, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": 3}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({"text": {"format": {"type": "json_object"}}}, "text"), ({"text": "plain"}, "text"),
    ({"text": {"format": "text"}}, "text"),
    ({"max_output_tokens": 0}, "max_output_tokens"), ({"temperature": "hot"}, "temperature"),
])
def test_rejections_name_the_field(fields, param):
    with pytest.raises(APIError) as info:
        parse(**fields)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("text", [{"format": {"type": "text"}, "verbosity": "low"},
                                  {"verbosity": "high"}, {}])
def test_text_options_other_than_the_format_are_accepted(text):
    assert parse(text=text) == parse()


def test_max_output_tokens_past_the_context_is_clamped_to_it():
    assert parse(max_output_tokens=4096).sampling.max_tokens == 100


# ---- the server, through the SDK ----

@pytest.fixture(scope="module")
def client():
    with ServerProcess("--parallel", "2") as srv:
        with srv.openai_client() as c:
            yield c


def chat_text(client, max_tokens: int) -> str:
    r = client.chat.completions.create(model=MODEL, max_tokens=max_tokens, temperature=0,
                                       messages=[{"role": "system", "content": "Be brief."},
                                                 {"role": "user", "content": QUESTION}])
    return r.choices[0].message.content


@ON_GPU_NOT_BATCH_INVARIANT  # the second request's prompt comes from the prefix cache
def test_a_response_answers_as_chat_does(client):
    r = client.responses.create(model=MODEL, input=QUESTION, instructions="Be brief.",
                                max_output_tokens=40, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.output_text == chat_text(client, 40) and r.output_text
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert r.usage.output_tokens <= 40 and r.usage.input_tokens > 5
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=3,
                                temperature=0, extra_body={"ignore_eos": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3


def test_streamed_events_build_the_same_response(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20,
                                    temperature=0)
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=20,
                                          temperature=0, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text


def test_the_sdk_stream_helper_assembles_the_final_response(client):
    # The helper reads response.completed: the reply must end before max_output_tokens.
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=200,
                                 temperature=0) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert "".join(texts) == final.output_text and final.output_text


def test_bad_requests_are_openai_shaped_400s(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=QUESTION, previous_response_id="resp_x")
    assert info.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[])
