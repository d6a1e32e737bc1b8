"""Tool calling's text side (cllm/http/tools.py): the prompt, the forcing grammar, the reply parser.
No model needed; the end-to-end tests are in tests/engine/test_structured.py."""
import json

import llguidance
import pytest
from pydantic import BaseModel
from tool_models import Node, Person

from cllm.http.tools import CallParser, Tool, ToolSpec, call_grammar, prompt_messages, split_reply

WEATHER = Tool("get_weather", "Weather in a city",
               {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]})
TIME = Tool("get_time", "", {"type": "object", "properties": {}})
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_a_template_without_tools_gets_them_described_in_the_system_message():
    messages = [{"role": "user", "content": "Hi"}]
    out, offered = prompt_messages(messages, ToolSpec((WEATHER,)), template_takes_tools=False)
    assert offered is None and out[1] == messages[0]
    assert out[0]["role"] == "system" and '"name": "get_weather"' in out[0]["content"]
    assert "<tool_call>" in out[0]["content"]
    system = [{"role": "system", "content": "Be brief."}, *messages]
    out, _ = prompt_messages(system, ToolSpec((WEATHER,)), template_takes_tools=False)
    assert len(out) == 2 and out[0]["content"].startswith("Be brief.\n\n")


def test_a_template_with_tools_gets_them_and_the_messages_as_they_are():
    messages = [{"role": "user", "content": "Hi"}]
    out, offered = prompt_messages(messages, ToolSpec((WEATHER,)), template_takes_tools=True)
    assert out is messages and offered == [WEATHER.openai()]


def test_tool_choice_none_offers_no_tools():
    messages = [{"role": "user", "content": "Hi"}]
    assert prompt_messages(messages, ToolSpec((WEATHER,), "none"), False) == (messages, None)


def test_calls_and_results_in_the_history_become_text():
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}]
    out, _ = prompt_messages(messages, None, template_takes_tools=False)
    assert out == [{"role": "assistant", "content": CALL},
                   {"role": "tool", "content": "<tool_response>\nsunny\n</tool_response>"}]


def test_a_whole_reply_splits_into_content_and_calls():
    content, calls = split_reply(f"Let me look.\n{CALL}")
    assert content == "Let me look."
    (call,) = calls
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert split_reply("No call here.") == ("No call here.", [])


def test_a_block_that_is_not_a_call_stays_content():
    text = "<tool_call>\nnot json\n</tool_call>"
    assert split_reply(text) == (text, [])
    assert split_reply("<tool_call>\n{\"name\": ") == ("<tool_call>\n{\"name\": ", [])


DEEP = "[" * 5000 + "]" * 5000  # deeper than Python's recursion limit lets json parse


def test_history_arguments_nested_past_the_recursion_limit_stay_as_sent():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
    out, _ = prompt_messages([{"role": "assistant", "content": "", "tool_calls": [call]}], None,
                             template_takes_tools=False)
    assert DEEP in out[0]["content"]


@pytest.mark.parametrize("arguments", [DEEP, json.dumps(DEEP)], ids=["object", "string"])
def test_a_reply_whose_call_is_nested_past_the_recursion_limit_stays_content(arguments):
    text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
    assert split_reply(text) == (text, [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 100])
@pytest.mark.parametrize("before, between, after, expected", [
    ("Sure. ", "\n", "", "Sure."),
    ("Sure. \n", " \n ", "\n", "Sure."),
    ("", "\n", " Done. ", "Done."),
    ("One moment. ", " And ", "", "One moment.  And"),
])
def test_streamed_pieces_give_the_same_content_and_calls(size, before, between, after,
                                                         expected):
    """The streamed content is the whole reply's, whitespace next to calls included."""
    text = f"{before}{CALL}{between}{CALL.replace('Paris', 'Rome')}{after}"
    parser = CallParser()
    content, calls = "", []
    for i in range(0, len(text), size):
        piece, new = parser.feed(text[i:i + size])
        content, calls = content + piece, calls + new
        assert "<" not in piece  # nothing of a call leaks into the content
    content += parser.close()
    whole_content, whole_calls = split_reply(text)
    assert content == whole_content == expected
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Paris", "Rome"]


def _accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher for `grammar` takes `text` whole (byte tokenizer)."""
    tokenizer = llguidance.LLTokenizer("byte")
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar))
    tokens = tokenizer.tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize("parallel", [False, True])
def test_the_named_choice_grammar_takes_exactly_one_call_of_that_tool(parallel):
    grammar = call_grammar(ToolSpec((WEATHER, TIME), "function", "get_weather", parallel))
    assert _accepts(grammar, CALL)
    assert not _accepts(grammar, CALL.replace("get_weather", "get_time"))
    assert not _accepts(grammar, CALL.replace('"city"', '"town"'))
    assert not _accepts(grammar, f"{CALL}\n{CALL}")


def test_the_required_choice_grammar_takes_any_tool_and_several_calls():
    grammar = call_grammar(ToolSpec((WEATHER, TIME), "required"))
    time_call = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert _accepts(grammar, CALL) and _accepts(grammar, time_call)
    assert _accepts(grammar, f"{CALL}\n{time_call}")
    assert not _accepts(grammar, "Hello")


def test_auto_and_none_are_not_constrained():
    assert call_grammar(ToolSpec((WEATHER,), "auto")) is None
    assert call_grammar(ToolSpec((WEATHER,), "none")) is None


# ---- tools whose parameters refer to their own $defs, as every nested Pydantic model's do ----

def _parcel_schema() -> dict:
    """Another model named Address, with other fields, as two tools of one app may have."""
    class Address(BaseModel):
        postcode: int

    class Parcel(BaseModel):
        to: Address
    return Parcel.model_json_schema()


PERSON = Tool("save_person", "", Person.model_json_schema())
TREE = Tool("save_tree", "", Node.model_json_schema())
PARCEL = Tool("send_parcel", "", _parcel_schema())


def _call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_pydantic_schemas_use_defs_and_references():
    assert "$defs" in PERSON.parameters and "$ref" in json.dumps(PERSON.parameters)
    assert "Address" in PERSON.parameters["$defs"] and "Address" in PARCEL.parameters["$defs"]


def test_a_forced_call_resolves_a_tools_references_in_its_own_defs():
    grammar = call_grammar(ToolSpec((PERSON, WEATHER), "function", "save_person"))
    person = {"name": "Ann", "address": {"street": "Main St", "city": "Oslo"}}
    assert _accepts(grammar, _call("save_person", person))
    assert not _accepts(grammar, _call("save_person", {**person, "address": {"street": "x"}}))


def test_a_forced_call_of_a_recursive_model_nests():
    grammar = call_grammar(ToolSpec((TREE,), "function", "save_tree"))
    tree = {"label": "a", "children": [{"label": "b", "children": [
        {"label": "c", "children": []}]}]}
    assert _accepts(grammar, _call("save_tree", tree))
    assert not _accepts(grammar, _call("save_tree", {"label": "a", "children": [{"x": 1}]}))


def test_two_tools_with_a_def_of_the_same_name_each_keep_their_own():
    grammar = call_grammar(ToolSpec((PERSON, PARCEL, TREE), "required"))
    person = {"name": "Ann", "address": {"street": "Main St", "city": "Oslo"}}
    parcel = {"to": {"postcode": 1234}}
    assert _accepts(grammar, _call("save_person", person))
    assert _accepts(grammar, _call("send_parcel", parcel))
    assert not _accepts(grammar, _call("send_parcel", {"to": person["address"]}))
    assert not _accepts(grammar, _call("save_person", {**person, "address": parcel["to"]}))


def test_a_reference_to_the_root_of_a_tools_parameters_stays_inside_them():
    """A "#" self-reference (a hand-written recursive schema) means the tool's parameters, not
    the call around them."""
    chain = Tool("chain", "", {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}, "required": ["next"]})
    grammar = call_grammar(ToolSpec((chain,), "function", "chain"))
    assert _accepts(grammar, _call("chain", {"next": {"next": None}}))
    assert not _accepts(grammar, _call("chain", {"next": {"name": "chain", "arguments": {}}}))
