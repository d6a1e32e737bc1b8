"""/v1/messages (Anthropic's Messages API): parsing without a model, then the real server
through the official anthropic SDK."""
from __future__ import annotations

import anthropic
import httpx
import pydantic
import pytest
from server_process import ServerProcess

from cllm.errors import APIError
from cllm.protocols.anthropic import parse_request

MODEL = "smollm2-135m-instruct"
TURNS = [{"role": "user", "content": "Write one sentence about the sea."}]
# The SDK no longer has arguments for the sampling fields the API still takes.
GREEDY = {"temperature": 0}


def parse(**fields):
    return parse_request({"messages": TURNS, "max_tokens": 10, **fields}, max_tokens_limit=100)


# ---- parsing ----

def test_system_turns_and_sampling():
    req = parse(system=[{"type": "text", "text": "Be brief."}], temperature=0.5, top_k=5,
                stop_sequences=["\n"],
                messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert req.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Hi"}]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.stop) == (10, 0.5, 5, ("\n",))


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": None}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"messages": []}, "messages"), ({"messages": [{"role": "system", "content": "x"}]},
                                     "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages"),
    ({"tools": [{"name": "f"}]}, "tools"), ({"stop_sequences": "x"}, "stop_sequences"),
    ({"stop_sequences": ["s"] * 17}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"output_config": "json"}, "output_config"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format"),
    ({"output_config": {"format": {"type": "json_schema"}}}, "output_config.format"),
    ({"output_format": {"type": "json_schema", "schema": 5}}, "output_format"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}}},
      "output_format": {"type": "json_schema", "schema": {}}}, "output_format"),
])
def test_rejections_name_the_field(fields, param):
    with pytest.raises(APIError) as info:
        parse(**fields)
    assert info.value.status == 400 and info.value.param == param


def test_max_tokens_past_the_context_is_clamped_to_it():
    assert parse(max_tokens=4096).sampling.max_tokens == 100


def test_structured_output_is_a_json_schema_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    constraint = parse(output_config={"format": {"type": "json_schema", "schema": schema},
                                      "effort": "low"}).constraint
    assert (constraint.kind, constraint.value, constraint.param) == (
        "json_schema", schema, "output_config.format")
    # The structured-outputs beta's field, which the SDK's beta client still sends.
    beta = parse(output_format={"type": "json_schema", "schema": schema}).constraint
    assert (beta.value, beta.param) == (schema, "output_format")
    assert parse().constraint is None and parse(output_config={"effort": "high"}).constraint is None


# ---- the server, through the SDK ----

@pytest.fixture(scope="module")
def server():
    # A slot of 2,048 tokens, a CPU server's default.
    with ServerProcess("--parallel", "2", "--ctx-size", "4096", "--api-key", "secret") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with anthropic.Anthropic(base_url=server.url, api_key="secret", max_retries=0,
                             timeout=120) as c:
        yield c


def chat_completion(server, max_tokens: int):
    with server.openai_client(api_key="secret") as c:
        return c.chat.completions.create(model=MODEL, messages=TURNS, max_tokens=max_tokens,
                                         temperature=0)


def test_a_message_answers_as_chat_does(client, server):
    m = client.messages.create(model=MODEL, max_tokens=30, messages=TURNS, extra_body=GREEDY)
    chat = chat_completion(server, 30)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    (block,) = m.content
    assert block.type == "text" and block.text == chat.choices[0].message.content
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == chat.usage.prompt_tokens
    assert chat.usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again
    # Anthropic's input_tokens leave the cache's out; OpenAI's prompt_tokens count them.
    again = client.messages.create(model=MODEL, max_tokens=30, messages=TURNS, extra_body=GREEDY)
    assert again.usage.cache_read_input_tokens == chat.usage.prompt_tokens_details.cached_tokens
    cached = again.usage.cache_read_input_tokens
    assert again.usage.input_tokens == chat.usage.prompt_tokens - cached
    assert m.usage.output_tokens == chat.usage.completion_tokens
    assert m.stop_reason == ("max_tokens" if chat.choices[0].finish_reason == "length"
                             else "end_turn")


def test_streaming_builds_the_same_message(client):
    whole = client.messages.create(model=MODEL, max_tokens=20, messages=TURNS, extra_body=GREEDY)
    with client.messages.stream(model=MODEL, max_tokens=20, messages=TURNS,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_the_streams_first_usage_agrees_with_its_last(client):
    """message_start's input tokens are those not read from the cache, as message_delta's
    (the second request finds its prompt cached)."""
    for _ in range(2):
        with client.messages.stream(model=MODEL, max_tokens=5, messages=TURNS,
                                    extra_body=GREEDY) as stream:
            events = list(stream)
        start = next(e for e in events if e.type == "message_start").message.usage
        end = next(e for e in events if e.type == "message_delta").usage
        assert start.input_tokens == end.input_tokens
        assert start.cache_read_input_tokens == end.cache_read_input_tokens
    assert end.cache_read_input_tokens > 0


def test_stop_reasons(client):
    short = client.messages.create(model=MODEL, max_tokens=200, extra_body=GREEDY,
                                   messages=[{"role": "user", "content": "Say hi."}])
    assert short.stop_reason == "end_turn" and short.stop_sequence is None
    cut = client.messages.create(model=MODEL, max_tokens=2, messages=TURNS, extra_body=GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    text = client.messages.create(model=MODEL, max_tokens=30, messages=TURNS,
                                  extra_body=GREEDY).content[0].text
    word = text.split()[2]
    stopped = client.messages.create(model=MODEL, max_tokens=30, messages=TURNS,
                                     extra_body=GREEDY, stop_sequences=["zzz", word])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


def test_max_tokens_past_a_slots_context_is_served(client):
    m = client.messages.create(model=MODEL, max_tokens=4096, extra_body=GREEDY,
                               messages=[{"role": "user", "content": "Say hi."}])
    assert m.stop_reason == "end_turn" and m.content[0].text


class Ticket(pydantic.BaseModel):
    title: str
    urgent: bool


def test_structured_output_through_messages_parse(client):
    ask = [{"role": "user", "content": "File a ticket: the printer is on fire."}]
    m = client.messages.parse(model=MODEL, max_tokens=200, messages=ask, output_format=Ticket,
                              extra_body=GREEDY)
    assert isinstance(m.parsed_output, Ticket), m.content
    assert m.stop_reason == "end_turn"
    with client.messages.stream(model=MODEL, max_tokens=200, messages=ask,
                                output_format=Ticket, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.parsed_output == m.parsed_output


def test_a_system_prompt_reaches_the_model(client):
    plain = client.messages.create(model=MODEL, max_tokens=1, messages=TURNS)
    system = client.messages.create(model=MODEL, max_tokens=1, messages=TURNS,
                                    system="You are a pirate who sails the seven seas. " * 10)
    assert (system.usage.input_tokens + system.usage.cache_read_input_tokens
            > plain.usage.input_tokens + plain.usage.cache_read_input_tokens)


def test_errors_have_anthropics_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=0, messages=TURNS)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": "secret"},
                   json={"model": MODEL, "messages": TURNS})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens is required"
    # X-Api-Key counts on /v1/messages only: other routes keep Bearer.
    assert httpx.post(server.url + "/v1/completions", headers={"x-api-key": "secret"},
                      json={"prompt": "Hi", "max_tokens": 1}).status_code == 401
    with anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0) as bad:
        with pytest.raises(anthropic.AuthenticationError) as info:
            bad.messages.create(model=MODEL, max_tokens=1, messages=TURNS)
    assert info.value.body["error"]["type"] == "authentication_error"


def test_count_tokens_counts_what_a_message_would_read(client):
    system = "Be brief."
    m = client.messages.create(model=MODEL, max_tokens=1, messages=TURNS, system=system)
    counted = client.messages.count_tokens(model=MODEL, messages=TURNS, system=system)
    assert counted.input_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.count_tokens(model=MODEL, messages=[])
    assert info.value.body["error"]["type"] == "invalid_request_error"
