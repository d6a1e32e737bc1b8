"""Response bodies for the HTTP API, as plain dicts the server serializes.

Shapes follow OpenAI's completions and chat completions (streamed or not) and the original
/generate API. Nothing here touches the engine or the network."""
from __future__ import annotations

import json
from typing import NamedTuple

from cllm.errors import APIError

# OpenAI reports impossible tokens as -9999.0; -inf and NaN are not valid JSON.
MIN_LOGPROB = -9999.0


def _logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB  # NaN > x is False: NaN maps too


class Token(NamedTuple):
    """A token as logprobs show it: its name, and the bytes it adds to the text (None for a
    control token, which adds none)."""
    text: str
    raw: bytes | None


def token_name(raw: bytes) -> str:
    """A token's bytes as text. A token may hold part of a character: then, as OpenAI writes
    it, 'bytes:' and the bytes escaped, so that no two tokens share a name (U+FFFD for each
    would)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `cached_tokens` are the prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


# ---- /v1/completions ----

def completion_logprobs(tokens: list[str], token_logprobs: list[float],
                        top: list[dict[str, float]], text_offset: list[int]) -> dict:
    """The legacy completions shape: parallel lists, one entry per generated token."""
    return {"tokens": tokens, "token_logprobs": [_logprob(lp) for lp in token_logprobs],
            "top_logprobs": [{t: _logprob(lp) for t, lp in d.items()} for d in top],
            "text_offset": text_offset}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: dict | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def completion_response(request_id: str, model: str, created: int, choices: list[dict],
                        usage: dict | None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def completion_chunk(request_id: str, model: str, created: int, index: int, text: str,
                     finish_reason: str | None, logprobs: dict | None) -> dict:
    # OpenAI streams completions as text_completion objects with one choice each.
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [completion_choice(index, text, finish_reason, logprobs)]}


# ---- /v1/chat/completions ----

def _token_logprob(token: Token, logprob: float) -> dict:
    return {"token": token.text, "logprob": _logprob(logprob),
            "bytes": None if token.raw is None else list(token.raw)}


def chat_logprobs(entries: list[tuple[Token, float, list[tuple[Token, float]]]]) -> dict:
    """entries: (token, logprob, [(top token, top logprob), ...]) per generated token."""
    return {"content": [{**_token_logprob(token, lp),
                         "top_logprobs": [_token_logprob(t, tlp) for t, tlp in top]}
                        for token, lp, top in entries]}


def chat_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                tool_calls: list[dict] | None = None, functions: bool = False) -> dict:
    """A reply; one that called tools has their `tool_calls` (the first call's `function_call`
    when the request offered the deprecated `functions`, which made one call a reply), and
    null content if it said nothing besides."""
    message = {"role": "assistant", "content": text}
    if tool_calls:
        calls = ({"function_call": tool_calls[0]["function"]} if functions
                 else {"tool_calls": tool_calls})
        message = {"role": "assistant", "content": text or None, **calls}
    return {"index": index, "message": message, "logprobs": logprobs,
            "finish_reason": finish_reason}


def chat_response(request_id: str, model: str, created: int, choices: list[dict],
                  usage: dict | None) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage}


def chat_chunk(request_id: str, model: str, created: int, index: int, *, role: bool,
               text: str | None, finish_reason: str | None, logprobs: dict | None,
               tool_calls: list[dict] | None = None, function_call: dict | None = None) -> dict:
    """A streamed piece of choice `index`: the first carries the role, the last the
    finish_reason with an empty delta. Each tool call comes whole, with its "index" among the
    choice's calls; so does a deprecated `function_call`."""
    delta: dict = {"role": "assistant"} if role else {}
    if text is not None:
        delta["content"] = text
    if tool_calls:
        delta["tool_calls"] = tool_calls
    if function_call:
        delta["function_call"] = function_call
    return {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": model, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, model: str, created: int, usage: dict, *, chat: bool) -> dict:
    """The last chunk before [DONE] when stream_options.include_usage: no choices, the usage."""
    return {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage}


# ---- /generate and framing ----

def generate_success(text: str, generated_tokens: int, finish_reason: str) -> dict:
    return {"success": True, "data": {"text": text, "generated_tokens": generated_tokens,
                                      "finish_reason": finish_reason}}


def generate_failure(error: APIError) -> dict:
    return {"success": False,
            "error": {"message": error.message, "type": error.type, "code": error.code}}


# Anthropic's error types by HTTP status.
_ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                          403: "permission_error", 404: "not_found_error",
                          408: "timeout_error", 413: "request_too_large",
                          429: "rate_limit_error", 503: "overloaded_error"}


def ollama_error(error: APIError) -> dict:
    """An error as Ollama's API shapes it (/api/...)."""
    return {"error": error.message}


def anthropic_error(error: APIError) -> dict:
    """An error as Anthropic's Messages API shapes it (/v1/messages)."""
    return {"type": "error", "error": {
        "type": _ANTHROPIC_ERROR_TYPES.get(error.status, "api_error"),
        "message": error.message}}


# JSON leaves these raw in strings, but clients that split a stream with str.splitlines (httpx's
# aiter_lines among them) break lines at them too, and would receive half an event.
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                      "\u2029": "\\u2029"})


# One encoder for every event: json.dumps builds a new one per call when given arguments.
_COMPACT_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)


def sse_event(payload: dict | str) -> bytes:
    """One server-sent event: a compact JSON payload, or a literal such as "[DONE]"."""
    return b"data: " + _one_line(payload) + b"\n\n"


def json_line(payload: dict) -> bytes:
    """One line of newline-delimited JSON (Ollama's streams)."""
    return _one_line(payload) + b"\n"


def _one_line(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else _COMPACT_JSON.encode(payload)
    # Translating costs ~4x the encoding, and every token of non-English text is non-ASCII:
    # look for the three characters first.
    if not data.isascii() and ("\u2028" in data or "\u2029" in data or "\x85" in data):
        data = data.translate(_UNICODE_LINE_BREAKS)
    return data.encode()


def typed_event(payload: dict) -> bytes:
    """One server-sent event that names its payload's type (Anthropic's Messages, OpenAI's
    Responses)."""
    return f"event: {payload['type']}\n".encode() + sse_event(payload)
