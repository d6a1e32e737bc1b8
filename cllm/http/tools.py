"""Tool calling in the Hermes convention: the tools described to the model in its prompt, its
calls written as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, a grammar that forces
such calls (tool_choice "required" or a named function), and a parser that turns a reply, whole
or as it streams, into content and OpenAI tool_calls.

A chat template that takes a `tools` variable gets the tools and renders them its own way; for
one that does not (SmolLM2's, gemma3's), the description goes into the system message."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from cllm.engine.json_schema import as_compiled, rooted

OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    description: str
    parameters: dict  # JSON Schema of the arguments

    def openai(self) -> dict:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A request's tools and tool_choice: "auto", "none", "required" or "function" (then
    `name` is the one to call)."""
    tools: tuple[Tool, ...]
    choice: str = "auto"
    name: str | None = None
    parallel: bool = True

    @property
    def calls(self) -> bool:
        """Whether the reply may call tools (and is parsed for calls)."""
        return self.choice != "none"


# ---- the prompt ----

def _system_text(tools: tuple[Tool, ...]) -> str:
    listing = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return ("You may call one or more functions to answer. The functions, described in JSON "
            f"Schema, are inside <tools></tools>:\n<tools>\n{listing}\n</tools>\n"
            "To call a function, reply with a JSON object holding its name and arguments "
            f"inside {OPEN}{CLOSE} tags:\n"
            f'{OPEN}\n{{"name": <function-name>, "arguments": <arguments-object>}}\n{CLOSE}')


def _call_text(call: dict) -> str:
    function = call.get("function", {})
    arguments = function.get("arguments", "{}")
    try:
        arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (ValueError, RecursionError):  # the client's own history: keep what it sent
        pass
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{OPEN}\n{body}\n{CLOSE}"


def prompt_messages(messages: list[dict], spec: ToolSpec | None,
                    template_takes_tools: bool) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to render. A template that takes `tools` gets them and the messages
    as they are; otherwise the tools are described in the system message, earlier calls
    become <tool_call> text and tool results <tool_response> text."""
    offered = spec.tools if spec is not None and spec.calls else ()
    if template_takes_tools:
        return messages, [t.openai() for t in offered] or None
    out = [_as_text(m) for m in messages]
    if offered:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + _system_text(offered)}
        else:
            out.insert(0, {"role": "system", "content": _system_text(offered)})
    return out, None


def _as_text(message: dict) -> dict:
    if message["role"] == "assistant" and message.get("tool_calls"):
        texts = [message["content"]] if message["content"] else []
        texts += [_call_text(c) for c in message["tool_calls"]]
        return {"role": "assistant", "content": "\n".join(texts)}
    if message["role"] == "tool":
        content = message["content"]
        return {"role": "tool", "content": f"<tool_response>\n{content}\n</tool_response>"}
    return {"role": message["role"], "content": message["content"]}


# ---- the grammar of forced calls ----

def _call_schema(tool: Tool) -> dict:
    return {"type": "object", "properties": {"name": {"const": tool.name},
                                             "arguments": {"$ref": _arguments_ref(tool)}},
            "required": ["name", "arguments"], "additionalProperties": False}


def _arguments_ref(tool: Tool) -> str:
    return f"#/$defs/{tool.name}"  # a name is letters, digits, '_', '.', '-': no escaping


def _arguments_defs(tools: tuple[Tool, ...]) -> dict:
    """Each tool's parameters under the call schema's $defs by the tool's name, with their own
    references ("#/$defs/Address", "#") made to point there: the call schema is the root those
    resolve against, and two tools may each have an "Address" of their own."""
    return {t.name: rooted(as_compiled(t.parameters), _arguments_ref(t)[1:]) for t in tools}


def call_grammar(spec: ToolSpec) -> str | None:
    """A Lark grammar (llguidance's dialect) whose texts are one call of the tool named by
    tool_choice, or for "required" one call of any tool (one or more with `parallel`). None
    when the model chooses freely. A named choice asks for that call, as vLLM reads it: the
    same call again and again, until max_tokens, is what a small model did with more allowed."""
    if spec.choice not in ("function", "required"):
        return None
    tools = tuple(t for t in spec.tools if spec.choice == "required" or t.name == spec.name)
    calls = [_call_schema(t) for t in tools]
    schema = {**(calls[0] if spec.choice == "function" else {"anyOf": calls}),
              "$defs": _arguments_defs(tools),
              # Compact JSON: free whitespace is where a small model loses itself.
              "x-guidance": {"whitespace_flexible": False, "item_separator": ", ",
                             "key_separator": ": "}}
    rule = 'call ("\\n" call)*' if spec.parallel and spec.choice == "required" else "call"
    return (f"start: {rule}\n"
            f'call: "{OPEN}\\n" body "\\n{CLOSE}"\n'
            f"body: %json {json.dumps(schema)}\n")


# ---- the reply ----

def new_call(name: str, arguments: object) -> dict:
    """An OpenAI tool call with a fresh id; arguments as a JSON string."""
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


class CallParser:
    """Splits a reply into content and tool calls as its text arrives. Text that may be the
    start of a call is held back until it is known; a block that is not a valid call stays
    content. Whitespace around calls is layout, not content: the content's whitespace at its
    end waits for more content, and is dropped where the reply ends after calls; content that
    starts after a call loses its leading whitespace. A whole reply (split_reply) goes through
    the same rules, so streamed and whole content agree."""

    def __init__(self) -> None:
        self._held = ""  # text not yet given out: a possible or an open <tool_call> block
        self._space = ""  # whitespace at the end of the content given out so far
        self._said = False  # whether any content other than whitespace was given out
        self.calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, new calls) that `text` completes."""
        self._held += text
        content, calls = [], []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._held, OPEN)
                content.append(self._content(self._held[:len(self._held) - keep]))
                self._held = self._held[len(self._held) - keep:]
                break
            end = self._held.find(CLOSE, start)
            if end < 0:
                content.append(self._content(self._held[:start]))
                self._held = self._held[start:]
                break
            block = self._held[start:end + len(CLOSE)]
            call = _parse_call(block[len(OPEN):-len(CLOSE)])
            content.append(self._content(self._held[:start] if call
                                         else self._held[:end + len(CLOSE)]))
            if call:
                calls.append(call)
                self.calls.append(call)
            self._held = self._held[end + len(CLOSE):]
        return "".join(content), calls

    def close(self) -> str:
        """What is left once the reply has ended: an unfinished block is content, and the
        whitespace still waiting is content unless the reply made calls."""
        held, self._held = self._held, ""
        text = self._content(held)
        space, self._space = self._space, ""
        return text if self.calls else text + space

    def _content(self, text: str) -> str:
        """The content to give out now of `text`, which follows what was given out."""
        text = self._space + text
        if self.calls and not self._said:
            text = text.lstrip()
        body = text.rstrip()
        self._space = text[len(body):]
        self._said = self._said or bool(body)
        return body


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _parse_call(body: str) -> dict | None:
    """The call a <tool_call> block holds, or None where it holds none (it stays content): not
    JSON, not a call, or nested past what Python's recursion limit lets json parse."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    return new_call(value["name"], arguments)


def split_reply(text: str) -> tuple[str, list[dict]]:
    """A whole reply as (content, tool calls)."""
    parser = CallParser()
    content, calls = parser.feed(text)
    return content + parser.close(), calls
