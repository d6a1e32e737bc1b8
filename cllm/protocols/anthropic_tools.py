"""Tools on Anthropic's Messages API, translated to and from the OpenAI tool path
(cllm/http/tools.py): `tools` and `tool_choice` become a ToolSpec, the history's `tool_use` and
`tool_result` blocks become chat's tool calls and tool messages, and a reply's calls become
`tool_use` blocks."""
from __future__ import annotations

import json
import re

from cllm.errors import APIError
from cllm.http import schemas
from cllm.http.tools import ToolSpec

# A tool's fields; cache_control is a hint (the prefix cache keeps prompts by itself).
_TOOL_FIELDS = {"name", "description", "input_schema", "type", "cache_control"}
_CHOICE_FIELDS = {"type", "name", "disable_parallel_tool_use"}
# Anthropic's tool_choice types, as OpenAI's tool_choice.
_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


def read_tools(body: dict) -> ToolSpec | None:
    """tools ([{name, description, input_schema}]) and tool_choice ({type: auto, any, tool
    (with name) or none; disable_parallel_tool_use}), read as OpenAI's would be; errors name
    Anthropic's fields."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None and not isinstance(tools, list):
        raise APIError(400, "tools must be an array", param="tools")
    for i, tool in enumerate(tools or ()):
        _check_tool(i, tool)
    if choice is not None:
        _check_choice(choice)
    choice = choice or {"type": "auto"}
    as_openai = {
        "tools": [{"type": "function",
                   "function": {"name": t.get("name"), "description": t.get("description"),
                                "parameters": t.get("input_schema")}} for t in tools or ()],
        "tool_choice": ({"type": "function", "function": {"name": choice.get("name")}}
                        if choice["type"] == "tool" else _CHOICES[choice["type"]]),
        "parallel_tool_calls": not choice.get("disable_parallel_tool_use", False)}
    try:
        return schemas.read_tool_spec(as_openai)
    except APIError as e:
        message = re.sub(r"tools\[(\d+)\]\.function\.parameters", r"tools[\1].input_schema",
                         e.message)
        raise APIError(400, re.sub(r"tools\[(\d+)\]\.function", r"tools[\1]", message),
                       param=e.param) from None


def _check_tool(i: int, tool: object) -> None:
    if not isinstance(tool, dict):
        raise APIError(400, f"tools[{i}] must be an object", param="tools")
    unknown = sorted(set(tool) - _TOOL_FIELDS)
    if unknown:
        raise APIError(400, f"tools[{i}].{unknown[0]} is not supported", param="tools")
    if tool.get("type", "custom") != "custom":
        raise APIError(400, f"tools[{i}].type {tool['type']!r} is not supported: only client "
                       "tools (name, description, input_schema)", param="tools")
    if not isinstance(tool.get("input_schema"), dict):
        raise APIError(400, f"tools[{i}].input_schema must be a JSON Schema object",
                       param="tools")


def _check_choice(choice: object) -> None:
    if not isinstance(choice, dict) or choice.get("type") not in (*_CHOICES, "tool"):
        raise APIError(400, 'tool_choice must be {"type": "auto", "any", "tool" or "none"}',
                       param="tool_choice")
    unknown = sorted(set(choice) - _CHOICE_FIELDS)
    if unknown:
        raise APIError(400, f"tool_choice.{unknown[0]} is not supported", param="tool_choice")
    if choice["type"] == "tool" and not isinstance(choice.get("name"), str):
        raise APIError(400, 'tool_choice {"type": "tool"} needs the tool\'s "name"',
                       param="tool_choice")
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise APIError(400, "tool_choice.disable_parallel_tool_use must be a boolean",
                       param="tool_choice")


# ---- the history ----

def chat_turns(turns: list[dict]) -> list[dict]:
    """Anthropic's turns as chat messages: an assistant turn's tool_use blocks become its
    tool_calls, a user turn's tool_result blocks each a tool message (before the turn's text,
    as the results answer the calls just before them). Text blocks stay content parts."""
    out = []
    for i, turn in enumerate(turns):
        content = turn.get("content")
        if not isinstance(content, list) or turn["role"] == "system":
            out.append(turn)
        elif turn["role"] == "assistant":
            out.append(_assistant_turn(i, content))
        else:
            out += _user_turn(i, content)
    return out


def _blocks_of(content: list, kind: str) -> list[dict]:
    return [b for b in content if isinstance(b, dict) and b.get("type") == kind]


def _rest(content: list, kind: str) -> list:
    return [b for b in content if not (isinstance(b, dict) and b.get("type") == kind)]


def _assistant_turn(i: int, content: list) -> dict:
    calls = []
    for block in _blocks_of(content, "tool_use"):
        if not (isinstance(block.get("name"), str) and isinstance(block.get("input"), dict)):
            raise APIError(400, f"messages[{i}]: a tool_use block needs a name and an input "
                           "object", param="messages")
        calls.append({"id": block.get("id"), "type": "function",
                      "function": {"name": block["name"], "arguments": block["input"]}})
    turn = {"role": "assistant", "content": _rest(content, "tool_use")}
    return {**turn, "tool_calls": calls} if calls else turn


def _user_turn(i: int, content: list) -> list[dict]:
    results = [{"role": "tool", "tool_call_id": block.get("tool_use_id"),
                "content": _result_text(i, block)}
               for block in _blocks_of(content, "tool_result")]
    text = _rest(content, "tool_result")
    return results + ([{"role": "user", "content": text}] if text or not results else [])


def _result_text(i: int, block: dict) -> str:
    """A tool_result's content (a string or text blocks) as text; a result marked is_error says
    so, the model having no other way to tell."""
    content = block.get("content", "")
    if isinstance(content, list):
        if not all(isinstance(b, dict) and b.get("type") == "text"
                   and isinstance(b.get("text"), str) for b in content):
            raise APIError(400, f"messages[{i}]: a tool_result's content must be a string or "
                           "text blocks", param="messages")
        content = "\n".join(b["text"] for b in content)
    if not isinstance(content, str):
        raise APIError(400, f"messages[{i}]: a tool_result's content must be a string or text "
                       "blocks", param="messages")
    if not isinstance(block.get("is_error", False), bool):
        raise APIError(400, f"messages[{i}]: a tool_result's is_error must be a boolean",
                       param="messages")
    return f"Error: {content}" if block.get("is_error") else content


# ---- the reply ----

def tool_use_block(call: dict) -> dict:
    """An OpenAI tool call (cllm/http/tools.py new_call) as a tool_use block."""
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
            "name": call["function"]["name"], "input": json.loads(call["function"]["arguments"])}
