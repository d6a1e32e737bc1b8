"""/v1/messages (Anthropic's Messages API): parsing without a model, then the real server
through the official anthropic SDK."""
from __future__ import annotations

import anthropic
import httpx
import jsonschema
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
    ({"tools": [{"name": "f"}]}, "tools"), ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"stop_sequences": "x"}, "stop_sequences"),
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


# ---- tools, parsed ----

ADDRESS_SCHEMA = {  # a Pydantic model with a nested one: its schema has $defs
    "type": "object", "required": ["name", "address"],
    "properties": {"name": {"type": "string"}, "address": {"$ref": "#/$defs/Address"}},
    "$defs": {"Address": {"type": "object", "required": ["city", "zip"],
                          "properties": {"city": {"type": "string"},
                                         "zip": {"type": "string", "maxLength": 5}}}}}
TOOLS = [{"name": "record_person", "description": "Record a person and where they live.",
          "input_schema": ADDRESS_SCHEMA},
         {"name": "get_weather", "description": "The weather in a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                           "required": ["city"]}}]


def test_tools_and_tool_choice_become_the_tool_path():
    spec = parse(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather",
                                           "disable_parallel_tool_use": True}).tools
    assert [t.name for t in spec.tools] == ["record_person", "get_weather"]
    assert spec.tools[0].parameters == ADDRESS_SCHEMA
    assert (spec.choice, spec.name, spec.parallel) == ("function", "get_weather", False)
    assert parse(tools=TOOLS, tool_choice={"type": "any"}).tools.choice == "required"
    assert parse(tools=TOOLS).tools.choice == "auto"
    assert not parse(tools=TOOLS, tool_choice={"type": "none"}).calls
    assert parse(tools=TOOLS, tool_choice={"type": "any"}).constraint.param == "tool_choice"


@pytest.mark.parametrize("fields, named", [
    ({"tools": [{**TOOLS[1], "strict": True}]}, "tools[0].strict"),
    ({"tools": [{**TOOLS[1], "input_examples": []}]}, "tools[0].input_examples"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{**TOOLS[1], "name": "a b"}]}, "tools[0].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "'nope'"),
    ({"tools": TOOLS, "tool_choice": {"type": "auto", "strict": 1}}, "tool_choice.strict"),
    ({"tools": TOOLS, "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config"),
])
def test_tool_fields_refused_by_name(fields, named):
    with pytest.raises(APIError) as info:
        parse(**fields)
    assert info.value.status == 400 and named in info.value.message


def test_tool_use_and_tool_result_blocks_become_calls_and_tool_messages():
    turns = [TURNS[0],
             {"role": "assistant", "content": [
                 {"type": "text", "text": "Let me look."},
                 {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                  "input": {"city": "Paris"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1",
                  "content": [{"type": "text", "text": "18 C"}]},
                 {"type": "text", "text": "And tomorrow?"}]},
             {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "toolu_2", "name": "get_weather",
                  "input": {"city": "Paris"}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_2", "content": "no data",
                  "is_error": True}]}]
    messages = parse(tools=TOOLS, messages=turns).messages
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "user", "assistant",
                                            "tool"]
    assert messages[1]["content"] == "Let me look."
    assert messages[1]["tool_calls"] == [{"id": "toolu_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert messages[2] == {"role": "tool", "content": "18 C", "tool_call_id": "toolu_1"}
    assert messages[3]["content"] == "And tomorrow?"
    assert messages[5]["content"] == "Error: no data"


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


# ---- tools, through the SDK ----

def test_a_forced_tool_call_validates_against_its_schema_with_defs(client):
    m = client.messages.create(model=MODEL, max_tokens=200, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "record_person"},
                               messages=[{"role": "user", "content":
                                          "Alice lives in Paris, zip 75001. Record her."}],
                               extra_body=GREEDY)
    assert m.stop_reason == "tool_use"
    (block,) = [b for b in m.content if b.type == "tool_use"]
    assert block.name == "record_person" and block.id.startswith("toolu_")
    jsonschema.validate(block.input, ADDRESS_SCHEMA)


def test_streaming_a_tool_call_accumulates_to_the_whole_ones_input(client):
    ask = {"model": MODEL, "max_tokens": 200, "tools": TOOLS,
           "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
           "messages": [{"role": "user", "content": "What is the weather in Rome?"}],
           "extra_body": GREEDY}
    whole = client.messages.create(**ask)
    with client.messages.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_message()
    blocks = [e for e in events if e.type.startswith("content_block")]
    assert [e.type for e in blocks] == ["content_block_start", "content_block_delta",
                                        "content_block_stop"]
    assert blocks[0].content_block.type == "tool_use" and blocks[0].content_block.input == {}
    assert blocks[1].delta.type == "input_json_delta"
    assert final.stop_reason == whole.stop_reason == "tool_use"
    strip = lambda m: [(b.type, getattr(b, "name", None), getattr(b, "input", None))  # noqa
                       for b in m.content]
    assert strip(final) == strip(whole)
    assert len([b for b in whole.content if b.type == "tool_use"]) == 1


def test_auto_tools_with_a_tool_result_round_trip(client):
    """A call forced first, its result sent back as a tool_result: the model answers with text
    under tool_choice auto, and the result reaches its prompt."""
    question = {"role": "user", "content": "What is the weather in Rome?"}
    call = client.messages.create(model=MODEL, max_tokens=100, tools=TOOLS[1:],
                                  tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                  messages=[question],
                                  extra_body=GREEDY)
    (use,) = [b for b in call.content if b.type == "tool_use"]
    history = [question, {"role": "assistant", "content": call.content},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "Sunny, 31 degrees Celsius."}]}]
    reply = client.messages.create(model=MODEL, max_tokens=60, tools=TOOLS[1:],
                                   messages=history, extra_body=GREEDY)
    assert reply.stop_reason in ("end_turn", "tool_use", "max_tokens")
    assert reply.content and all(b.type in ("text", "tool_use") for b in reply.content)
    with_result = client.messages.count_tokens(model=MODEL, tools=TOOLS[1:], messages=history)
    without = client.messages.count_tokens(model=MODEL, messages=history)
    shorter = client.messages.count_tokens(model=MODEL, tools=TOOLS[1:], messages=history[:1])
    assert with_result.input_tokens > without.input_tokens  # the tools are in the prompt
    assert with_result.input_tokens > shorter.input_tokens + 10  # and so are call and result


def test_unknown_fields_inside_tools_are_refused_by_name(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=10, messages=TURNS,
                               tools=[{**TOOLS[1], "strict": True}])
    assert "tools[0].strict" in info.value.message
    assert client.messages.create(model=MODEL, max_tokens=5, messages=TURNS).content
