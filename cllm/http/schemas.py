"""Request schemas for the HTTP API: JSON bodies checked into dataclasses.

Every problem with a request becomes an APIError naming the field, never another exception, so
the server can answer 400 (or 413) with an OpenAI-shaped body. Unknown fields are ignored: OpenAI
clients send extras we do not use. A field sent as null counts as absent."""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from cllm.config import MAX_TOP_LOGPROBS, SamplingParams
from cllm.engine.grammar_depth import TooDeep, schema_height
from cllm.errors import APIError
from cllm.http.tools import Tool, ToolSpec

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_TOKEN_ID = (1 << 31) - 1  # llama_token is int32
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions and /generate
# The choices (prompts × n) a batch of prompts on /v1/completions makes at most, or max_n where
# that is higher: each is a sequence in the engine. LangChain's batches send 20 prompts.
MAX_BATCH_CHOICES = 64


@dataclass(frozen=True, slots=True)
class Constraint:
    """What the output must match, before it is compiled (common.constrained compiles it): a
    JSON Schema ("json_schema") or a grammar ("gbnf", "lark"); `param` is the field it came
    from."""
    kind: str
    value: object
    param: str


@dataclass(slots=True)
class CompletionRequest:
    """POST /v1/completions: n choices for each prompt, prompt after prompt."""
    model: str | None
    prompts: list[str | list[int]]  # each text or token ids; several are a batch
    n: int
    stream: bool
    include_usage: bool  # stream_options.include_usage
    sampling: SamplingParams
    cache_prompt: bool = True  # llama-server's field: False computes the whole prompt
    return_token_ids: bool = False  # vLLM's field: prompt and output token ids in the response
    constraint: Constraint | None = None


@dataclass(slots=True)
class ChatRequest:
    """POST /v1/chat/completions. Each message is {"role", "content": str}, an assistant's
    also "tool_calls" when it called tools, a tool's "tool_call_id"."""
    model: str | None
    messages: list[dict]
    n: int
    stream: bool
    include_usage: bool
    sampling: SamplingParams
    cache_prompt: bool = True
    return_token_ids: bool = False
    constraint: Constraint | None = None
    tools: ToolSpec | None = None
    functions: bool = False  # tools came as the deprecated functions: the reply's calls as well


@dataclass(slots=True)
class GenerateRequest:
    """POST /generate, the original API."""
    prompt: str
    stream: bool
    sampling: SamplingParams
    cache_prompt: bool = True
    constraint: Constraint | None = None


def _invalid(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


# ---- JSON body and typed fields ----

def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # "1e400" parses to inf
        raise ValueError(f"number {text} is out of range")
    return value


def parse_json_body(raw: bytes, max_bytes: int) -> dict:
    """The request body as a JSON object: 413 when too large, 400 when not a JSON object."""
    if len(raw) > max_bytes:
        raise APIError(413, f"request body is {len(raw)} bytes, the limit is {max_bytes}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float)
    except (ValueError, RecursionError) as e:  # ValueError covers JSONDecodeError and huge ints
        raise APIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(text) and _has_lone_surrogate(body):
        raise APIError(400, "request body is not valid Unicode: a string holds a lone surrogate "
                            "(a \\uD800-\\uDFFF escape that is not half of a pair)")
    return body


# Only a \uD800-\uDFFF escape can put a surrogate in a string: UTF-8 cannot encode one.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def _has_lone_surrogate(value: object) -> bool:
    """Whether a string in the parsed body (keys too) has a surrogate without its pair: such text
    has no UTF-8 form, so the tokenizer cannot take it."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return False


def _json_type(value: object) -> str:
    for kind, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"),
                       (list, "array"), (dict, "object")):
        if isinstance(value, kind):
            return name
    return "null"


_KINDS = {"an integer": int, "a number": (int, float), "a boolean": bool, "a string": str,
          "an object": dict}


def read_field(body: dict, name: str, kind: str, default=None):
    """body[name] if it has the JSON type `kind`, `default` when absent or null.
    bool is a subclass of int in Python, but true is never a number in JSON."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, _KINDS[kind]) or (isinstance(value, bool) and kind != "a boolean"):
        raise _invalid(name, f"{name} must be {kind}, got {_json_type(value)}")
    if kind == "a number":
        return _to_float(name, value)
    return value


def _to_float(name: str, value: int | float) -> float:
    try:
        result = float(value)
    except OverflowError:  # an int beyond the float range
        result = math.inf
    if not math.isfinite(result):
        raise _invalid(name, f"{name} must be a finite number")
    return result


def read_count(body: dict, name: str, lo: int, hi: int, default: int | None) -> int | None:
    value = read_field(body, name, "an integer", default)
    if value is not None and not lo <= value <= hi:
        raise _invalid(name, f"{name} must be between {lo} and {hi}, got {value}")
    return value


def read_max_tokens(body: dict, name: str, limit: int, default: int | None) -> int | None:
    """A bound on the reply's tokens, at least 1. One past `limit`, what a sequence's context
    holds, is clamped to it, as llama-server does: clients send a fixed bound (Anthropic's
    4,096) whatever the context, and the reply ends with finish reason "length" where the
    context fills. Only a prompt that leaves no room is refused (PromptTooLongError)."""
    value = read_field(body, name, "an integer", default)
    if value is not None and value < 1:
        raise _invalid(name, f"{name} must be at least 1, got {value}")
    return value if value is None else min(value, limit)


def _stop(value: object, field: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(value)
    raise _invalid(field, f"{field} must be a string or an array of strings")


def _stream(body: dict) -> tuple[bool, bool]:
    """(stream, stream_options.include_usage)."""
    stream = read_field(body, "stream", "a boolean", False)
    options = read_field(body, "stream_options", "an object", {})
    return stream, stream and read_field(options, "include_usage", "a boolean", False)


_SAMPLING_FIELDS = frozenset(SamplingParams.__slots__)
# Below this, logits / temperature overflow a C float and the softmax is NaN: such a
# temperature means "the most likely token", which is greedy sampling (0).
MIN_TEMPERATURE = 1e-6


def _temperature(body: dict) -> float:
    value = read_field(body, "temperature", "a number", 1.0)
    return 0.0 if 0.0 < value < MIN_TEMPERATURE else value


def read_sampling(body: dict, max_tokens: int, logprobs: int | None,
                  stop_field: str = "stop") -> SamplingParams:
    """The sampling fields shared by every endpoint; SamplingParams checks the ranges. The stop
    strings come from `stop_field` (Anthropic's `stop_sequences`), and its errors name it."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_temperature(body),
            top_p=read_field(body, "top_p", "a number", 1.0),
            top_k=read_field(body, "top_k", "an integer", 0),
            min_p=read_field(body, "min_p", "a number", 0.0),
            repeat_penalty=read_field(body, "repeat_penalty", "a number", 1.0),
            presence_penalty=read_field(body, "presence_penalty", "a number", 0.0),
            frequency_penalty=read_field(body, "frequency_penalty", "a number", 0.0),
            seed=read_field(body, "seed", "an integer"),
            stop=_stop(body.get(stop_field), stop_field),
            ignore_eos=read_field(body, "ignore_eos", "a boolean", False),
            logprobs=logprobs,
            priority=read_field(body, "priority", "an integer", 0),
            user=read_field(body, "user", "a string", ""),
        )
    except ValueError as e:
        # SamplingParams' messages name the field ("top_p must be between ..."): reuse that name.
        words = str(e).replace(",", " ").split()
        name = next((w for w in words if w in _SAMPLING_FIELDS), None)
        raise _invalid(stop_field if name == "stop" else name, str(e)) from None


def read_cache_prompt(body: dict) -> bool:
    """llama-server's per-request switch: false computes the whole prompt, cached or not."""
    return read_field(body, "cache_prompt", "a boolean", True)


def _return_token_ids(body: dict) -> bool:
    """vLLM's switch: the prompt's and each choice's token ids in the response."""
    return read_field(body, "return_token_ids", "a boolean", False)


# Fields that change the output but are not implemented yet: refused, never silently ignored.
# Each maps to the values that ask for nothing (null, absent, and these), which are accepted.
NOT_IMPLEMENTED = {"logit_bias": ({},),
                    # vLLM's own sampling fields
                    "min_tokens": (0,), "repetition_penalty": (1,), "stop_token_ids": ([],),
                    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,)}
_NOT_IMPLEMENTED_IN_COMPLETIONS = {**NOT_IMPLEMENTED, "best_of": (1,), "suffix": ("",),
                                   "echo": (False,)}
# vLLM's chat switches: a reply always starts a new assistant turn and holds only the reply.
# OpenAI's audio replies and web search: a reply is text, from the model alone.
_NOT_IMPLEMENTED_IN_CHAT = {**NOT_IMPLEMENTED, "echo": (False,), "add_generation_prompt": (True,),
                            "continue_final_message": (False,), "chat_template_kwargs": ({},),
                            "modalities": (["text"],), "audio": (), "web_search_options": ()}


def refuse_unimplemented(body: dict, fields: dict = NOT_IMPLEMENTED) -> None:
    for name, harmless in fields.items():
        value = body.get(name)
        if value is not None and value not in harmless:
            raise _invalid(name, f"{name} is not supported yet")


# ---- structured output ----

def _schema(param: str, value: object) -> dict | bool:
    if not isinstance(value, (dict, bool)):
        raise _invalid(param, f"{param} must be a JSON Schema (an object or a boolean)")
    return value


def _response_format(value: object) -> Constraint | None:
    """OpenAI's response_format; llama-server's {"type": "json_object", "schema": {...}} too."""
    if not isinstance(value, dict):
        raise _invalid("response_format", "response_format must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = value.get("schema")
        return Constraint("json_schema", {"type": "object"} if schema is None
                          else _schema("response_format.schema", schema), "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise _invalid("response_format", "response_format.json_schema must be an object "
                           'holding the "schema"')
        schema = spec.get("schema")
        return Constraint("json_schema", {} if schema is None
                          else _schema("response_format.json_schema.schema", schema),
                          "response_format")
    raise _invalid("response_format",
                   "response_format.type must be text, json_object or json_schema")


def read_constraint(body: dict) -> Constraint | None:
    """The output's constraint from response_format, or llama-server's json_schema or grammar
    (GBNF) fields: at most one of them."""
    given = [name for name in ("response_format", "json_schema", "grammar")
             if body.get(name) is not None]
    if len(given) > 1:
        raise _invalid(given[1], f"{' and '.join(given)}: give only one")
    if not given:
        return None
    if given[0] == "response_format":
        return _response_format(body["response_format"])
    if given[0] == "json_schema":
        return Constraint("json_schema", _schema("json_schema", body["json_schema"]),
                          "json_schema")
    grammar = body["grammar"]
    if not isinstance(grammar, str) or not grammar.strip():
        raise _invalid("grammar", "grammar must be a non-empty GBNF grammar")
    return Constraint("gbnf", grammar, "grammar")


def _tool(i: int, value: object) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type", "function") != "function":
        raise _invalid("tools", f'{where} must be {{"type": "function", "function": {{...}}}}')
    function = value.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", function["name"]):
        raise _invalid("tools", f"{where}.function.name must be 1 to 64 letters, digits, "
                       "'_', '.' or '-'")
    description = function.get("description") or ""
    if not isinstance(description, str):
        raise _invalid("tools", f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    parameters = {"type": "object", "properties": {}} if parameters is None else parameters
    if not isinstance(parameters, dict):
        raise _invalid("tools", f"{where}.function.parameters must be a JSON Schema object")
    try:
        schema_height(parameters)  # a forced call's grammar holds it
    except TooDeep as exc:
        raise _invalid("tools", f"{where}.function.parameters: the schema is {exc}") from None
    return Tool(function["name"], description, parameters)


# OpenAI's deprecated function calling: each field and the one it became.
_LEGACY_FIELDS = {"functions": "tools", "function_call": "tool_choice"}


def uses_functions(body: dict) -> bool:
    """Whether a chat request calls tools the deprecated way, its reply then in that shape."""
    return any(body.get(name) is not None for name in _LEGACY_FIELDS)


def _functions_spec(body: dict) -> ToolSpec | None:
    """functions and function_call, read as the tools and tool_choice they became, one call a
    reply as they made; errors name the fields as they were sent."""
    for field in _LEGACY_FIELDS.values():
        if body.get(field) is not None:
            raise _invalid(field, f"{field} does not go with functions or function_call, its "
                           "older form")
    functions, call = body.get("functions"), body.get("function_call")
    if functions is not None and not isinstance(functions, list):
        raise _invalid("functions", "functions must be an array")
    if not (call in (None, "auto", "none")
            or isinstance(call, dict) and isinstance(call.get("name"), str)):
        raise _invalid("function_call", 'function_call must be "auto", "none" or {"name": ...}')
    as_tools = {"tools": [{"type": "function", "function": f} for f in functions or ()],
                "tool_choice": {"type": "function", "function": call}
                if isinstance(call, dict) else call,
                "parallel_tool_calls": False}
    try:
        return read_tool_spec(as_tools)
    except APIError as e:
        message = re.sub(r"tools\[(\d+)\]\.function", r"functions[\1]", e.message)
        for old, new in _LEGACY_FIELDS.items():
            message = message.replace(new, old)
        old_name = {new: old for old, new in _LEGACY_FIELDS.items()}[e.param]
        raise _invalid(old_name, message) from None


def read_tool_spec(body: dict) -> ToolSpec | None:
    """tools, tool_choice and parallel_tool_calls; None when no tool is offered."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = read_field(body, "parallel_tool_calls", "a boolean", True)
    if tools is not None and not isinstance(tools, list):
        raise _invalid("tools", "tools must be an array")
    if not tools:
        if choice not in (None, "none", "auto"):
            raise _invalid("tool_choice", "tool_choice needs tools")
        return None
    parsed = tuple(_tool(i, t) for i, t in enumerate(tools))
    if len({t.name for t in parsed}) != len(parsed):
        raise _invalid("tools", "tools: two functions have the same name")
    if choice is None or choice in ("auto", "none", "required"):
        return ToolSpec(parsed, choice or "auto", None, parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _invalid("tool_choice", 'tool_choice must be "auto", "none", "required" or '
                       '{"type": "function", "function": {"name": ...}}')
    if name not in {t.name for t in parsed}:
        raise _invalid("tool_choice", f"tool_choice names {name!r}, which is not in tools")
    return ToolSpec(parsed, "function", name, parallel)


# ---- endpoints ----

def is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_ID


def read_prompt(value: object) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # OpenAI's batch form holding a single prompt
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value:
        if all(is_token(t) for t in value):
            return value
        if any(isinstance(p, (str, list)) for p in value):
            raise _invalid("prompt", "prompt: one prompt per request, use n for several")
        raise _invalid("prompt", f"prompt token ids must be integers from 0 to {MAX_TOKEN_ID}")
    raise _invalid("prompt", "prompt must be a non-empty string or array of token ids")


def read_prompts(value: object) -> list[str | list[int]]:
    """/v1/completions' prompt: one (read_prompt), or a batch, as OpenAI takes it: an array of
    texts or of token-id arrays."""
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list))
                                                          for p in value):
        return [_batch_prompt(i, p) for i, p in enumerate(value)]
    return [read_prompt(value)]


def _batch_prompt(i: int, value: str | list) -> str | list[int]:
    if (isinstance(value, str) and value
            or isinstance(value, list) and value and all(is_token(t) for t in value)):
        return value
    raise _invalid("prompt", f"prompt[{i}] must be a non-empty string or array of token ids "
                   f"from 0 to {MAX_TOKEN_ID}")


def _batch_n(body: dict, prompts: int, max_n: int) -> int:
    """n, bounded by max_n; with a batch of prompts, prompts × n by MAX_BATCH_CHOICES too."""
    n = read_count(body, "n", 1, max_n, 1)
    limit = max(MAX_BATCH_CHOICES, max_n)
    if prompts > 1 and prompts * n > limit:
        raise _invalid("prompt", f"prompt: {prompts} prompts with n {n} make {prompts * n} "
                       f"choices; a request makes at most {limit}")
    return n


def parse_completion(body: dict, *, max_n: int, max_tokens_limit: int) -> CompletionRequest:
    prompts = read_prompts(body.get("prompt"))
    refuse_unimplemented(body, _NOT_IMPLEMENTED_IN_COMPLETIONS)
    max_tokens = read_max_tokens(body, "max_tokens", max_tokens_limit,
                                 min(DEFAULT_COMPLETION_MAX_TOKENS, max_tokens_limit))
    logprobs = read_count(body, "logprobs", 0, MAX_TOP_LOGPROBS, None)
    stream, include_usage = _stream(body)
    return CompletionRequest(
        model=read_field(body, "model", "a string"), prompts=prompts,
        n=_batch_n(body, len(prompts), max_n), stream=stream, include_usage=include_usage,
        sampling=read_sampling(body, max_tokens, logprobs),
        cache_prompt=read_cache_prompt(body), return_token_ids=_return_token_ids(body),
        constraint=read_constraint(body))


def _content(where: str, role: str, content: object) -> str:
    """A message's content as text: text parts are joined with newlines (as vLLM does)."""
    if isinstance(content, str):
        return content
    if content is None and role == "assistant":  # an assistant turn that only called tools
        return ""
    if not isinstance(content, list):
        raise _invalid("messages", f"{where}.content must be a string or an array of text parts")
    texts = []
    for j, part in enumerate(content):
        text = part.get("text") if isinstance(part, dict) and part.get("type") == "text" else None
        if not isinstance(text, str):
            raise _invalid("messages", f"{where}.content[{j}]: only text parts"
                           ' {"type": "text", "text": "..."} are supported')
        texts.append(text)
    return "\n".join(texts)


def read_messages(value: object) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise _invalid("messages", "messages must be a non-empty array")
    messages = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid("messages", f"{where} must be an object")
        role = message.get("role")
        if role == "function":  # the deprecated form of a tool's result
            role = "tool"
        if not isinstance(role, str) or role not in ROLES:
            raise _invalid("messages", f"{where}.role must be one of {', '.join(ROLES)}")
        content = _content(where, role, message.get("content"))
        # OpenAI's "developer" is its newer name for "system", which chat templates know.
        kept = {"role": "system" if role == "developer" else role, "content": content}
        calls = message.get("tool_calls") if role == "assistant" else None
        if role == "assistant" and not calls and message.get("function_call") is not None:
            calls = [{"type": "function", "function": message["function_call"]}]  # deprecated
        if calls:
            kept["tool_calls"] = _tool_calls(where, calls)
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            kept["tool_call_id"] = message["tool_call_id"]
        messages.append(kept)
    return messages


def _tool_calls(where: str, calls: object) -> list[dict]:
    """An assistant message's earlier calls: [{"id", "type", "function": {"name", "arguments"}}]."""
    if not isinstance(calls, list):
        raise _invalid("messages", f"{where}.tool_calls must be an array")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments", ""), (str, dict))):
            raise _invalid("messages", f"{where}.tool_calls[{j}] must be "
                           '{"id", "type": "function", "function": {"name", "arguments"}}')
    return calls


def parse_chat(body: dict, *, max_n: int, max_tokens_limit: int) -> ChatRequest:
    """Without max_tokens (or max_completion_tokens, its newer name) a reply may run until the
    context is full: max_tokens_limit."""
    messages = read_messages(body.get("messages"))
    refuse_unimplemented(body, _NOT_IMPLEMENTED_IN_CHAT)
    functions = uses_functions(body)
    tools = _functions_spec(body) if functions else read_tool_spec(body)
    constraint = read_constraint(body)
    if tools is not None and tools.choice in ("required", "function") and constraint:
        raise _invalid("tool_choice", f"tool_choice {tools.choice!r} constrains the reply "
                       "already: it does not go with response_format, json_schema or grammar")
    max_tokens = read_max_tokens(body, "max_completion_tokens", max_tokens_limit, None)
    if max_tokens is None:
        max_tokens = read_max_tokens(body, "max_tokens", max_tokens_limit, max_tokens_limit)
    want_logprobs = read_field(body, "logprobs", "a boolean", False)
    top = read_count(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, 0)
    if top and not want_logprobs:
        raise _invalid("top_logprobs", "top_logprobs requires logprobs to be true")
    stream, include_usage = _stream(body)
    return ChatRequest(
        model=read_field(body, "model", "a string"), messages=messages,
        n=read_count(body, "n", 1, max_n, 1), stream=stream, include_usage=include_usage,
        sampling=read_sampling(body, max_tokens, top if want_logprobs else None),
        cache_prompt=read_cache_prompt(body), return_token_ids=_return_token_ids(body),
        constraint=constraint, tools=tools, functions=functions)


def parse_generate(body: dict, *, max_tokens_limit: int) -> GenerateRequest:
    """The original API: {"prompt", "max_tokens", "temperature", "top_p", "top_k", "stream"}, plus
    seed, stop, ignore_eos, min_p, repeat_penalty and the penalties. Defaults: max_tokens 16,
    temperature 1.0, top_p 1.0, top_k 0 (off)."""
    refuse_unimplemented(body)
    prompt = read_field(body, "prompt", "a string")
    if not prompt:
        raise _invalid("prompt", "prompt must be a non-empty string")
    max_tokens = read_max_tokens(body, "max_tokens", max_tokens_limit,
                                 min(DEFAULT_COMPLETION_MAX_TOKENS, max_tokens_limit))
    return GenerateRequest(prompt=prompt, stream=read_field(body, "stream", "a boolean", False),
                           sampling=read_sampling(body, max_tokens, None),
                           cache_prompt=read_cache_prompt(body), constraint=read_constraint(body))


def parse_tokenize(body: dict) -> tuple[str, bool, bool]:
    """llama-server's /tokenize: {"content": str, "add_special": bool, "with_pieces": bool}
    (both false by default)."""
    content = read_field(body, "content", "a string")
    if content is None:
        raise _invalid("content", "content is required")
    return (content, read_field(body, "add_special", "a boolean", False),
            read_field(body, "with_pieces", "a boolean", False))


def parse_detokenize(body: dict) -> list[int]:
    """llama-server's /detokenize: {"tokens": [int, ...]}."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_token(t) for t in tokens):
        raise _invalid("tokens", f"tokens must be an array of integers from 0 to {MAX_TOKEN_ID}")
    return tokens
