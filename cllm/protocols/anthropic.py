"""POST /v1/messages: Anthropic's Messages API for text and client tools (and
/v1/messages/count_tokens), whole or streamed as its events, with its error shape. Clients
written for Claude (the `anthropic` SDK, tools built on it) run unchanged against the local
model."""
from __future__ import annotations

import json
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cllm.config import SamplingParams
from cllm.engine.engine import Delta
from cllm.engine.sequence import FINISH_LENGTH
from cllm.errors import APIError
from cllm.http import schemas, tools
from cllm.http.common import (
    AppState,
    chat_prompt,
    constrained,
    new_format,
    read_json,
    request_model,
    respond,
)
from cllm.http.formats import Choice, TypedEventsFormat, matched_stop
from cllm.http.responses import anthropic_error
from cllm.http.tools import CallParser, ToolSpec, split_reply
from cllm.protocols.anthropic_tools import chat_turns, read_tools, tool_use_block


@dataclass(slots=True)
class MessagesRequest:
    messages: list[dict]  # chat messages, the system prompt first if any
    stream: bool
    sampling: SamplingParams
    # Structured output's JSON Schema, or the grammar of a forced tool call.
    constraint: schemas.Constraint | None = None
    tools: ToolSpec | None = None

    @property
    def calls(self) -> bool:
        """Whether the reply may call tools (and is parsed for calls)."""
        return self.tools is not None and self.tools.calls


def parse_request(body: dict, *, max_tokens_limit: int) -> MessagesRequest:
    """messages (user and assistant turns: text, tool_use and tool_result blocks), system,
    max_tokens (required), temperature, top_p, top_k, stop_sequences, stream, tools and
    tool_choice, and structured output (output_config.format)."""
    messages = read_conversation(body)
    spec = read_tools(body)
    constraint = _output_format(body)
    if spec is not None and (grammar := tools.call_grammar(spec)) is not None:
        if constraint is not None:
            raise APIError(400, f"tool_choice {body['tool_choice']['type']!r} constrains the "
                           f"reply already: it does not go with {constraint.param}",
                           param="tool_choice")
        constraint = schemas.Constraint("lark", grammar, "tool_choice")
    max_tokens = schemas.read_max_tokens(body, "max_tokens", max_tokens_limit, None)
    if max_tokens is None:
        raise APIError(400, "max_tokens is required", param="max_tokens")
    stops = body.get("stop_sequences")
    if stops is not None and not (isinstance(stops, list)
                                  and all(isinstance(s, str) for s in stops)):
        raise APIError(400, "stop_sequences must be an array of strings",
                       param="stop_sequences")
    fields = {"temperature": body.get("temperature"), "top_p": body.get("top_p"),
              "top_k": body.get("top_k"), "stop_sequences": stops,
              "priority": body.get("priority")}
    sampling = schemas.read_sampling(fields, max_tokens, None, stop_field="stop_sequences")
    stream = schemas.read_field(body, "stream", "a boolean", False)
    return MessagesRequest(messages, stream, sampling, constraint, spec)


def read_conversation(body: dict) -> list[dict]:
    """messages (user and assistant turns: text, tool_use and tool_result blocks) and system,
    as chat messages, the system prompt first if any; extended thinking is refused."""
    if isinstance(body.get("thinking"), dict) and body["thinking"].get("type") == "enabled":
        raise APIError(400, "extended thinking is not supported", param="thinking")
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise APIError(400, "messages must be a non-empty array", param="messages")
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
            raise APIError(400, f"messages[{i}].role must be user or assistant",
                           param="messages")
    system = body.get("system")
    if system is not None:
        turns = [{"role": "system", "content": system}, *turns]
    return schemas.read_messages(chat_turns(turns))  # text blocks are chat's text parts


def _output_format(body: dict) -> schemas.Constraint | None:
    """Structured output, {"type": "json_schema", "schema": {...}}, constrained as OpenAI's
    response_format is: output_config.format (what messages.parse sends), or output_format,
    the structured-outputs beta's field that the SDK's beta client still sends. The rest of
    output_config (effort) is a hint to the model."""
    config = schemas.read_field(body, "output_config", "an object", {})
    given = [(param, value) for param, value in (("output_config.format", config.get("format")),
                                                 ("output_format", body.get("output_format")))
             if value is not None]
    if len(given) > 1:
        raise APIError(400, "output_config.format and output_format: give only one",
                       param="output_format")
    if not given:
        return None
    param, value = given[0]
    if not (isinstance(value, dict) and value.get("type") == "json_schema"
            and isinstance(value.get("schema"), dict)):
        raise APIError(400, f'{param} must be {{"type": "json_schema", "schema": {{...}}}}',
                       param=param)
    return schemas.Constraint("json_schema", value["schema"], param)


class MessagesFormat(TypedEventsFormat):
    """A message, or the events that build one: message_start, its content blocks (each
    start, deltas, stop), message_delta with the stop reason and the output tokens,
    message_stop.

    Without tools the content is one text block. With tools (`tool_calls`: the request offered
    them), the reply's calls are tool_use blocks after its text, and the text block is there
    only where the reply has text; `parallel` False keeps the first call only. A call streams
    as a tool_use block's start (its input empty) and one input_json_delta with its input,
    once the whole call has arrived."""

    def __init__(self, *args, stops: tuple[str, ...], is_eog, detokenize,
                 tool_calls: bool = False, parallel: bool = True, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.request_id = "msg_" + self.request_id.partition("-")[2]
        self.stops = stops
        self.is_eog = is_eog
        self.detokenize = detokenize
        self.tool_calls = tool_calls
        self.max_calls = None if parallel else 1
        self._streamed = Choice()
        self._parser = CallParser()
        self._blocks = 0  # content blocks started so far, streamed
        self._text_open = False  # whether the last one started is a text block still open

    def error_body(self, error: APIError) -> dict:
        return anthropic_error(error)

    def response(self, choices: list[Choice]) -> dict:
        (choice,) = choices
        text, calls = split_reply(choice.text) if self.tool_calls else (choice.text, [])
        calls = calls[:self.max_calls]
        content = ([{"type": "text", "text": text}] if text or not calls else []) \
            + [tool_use_block(c) for c in calls]
        reason, sequence = self._stop(choice, bool(calls))
        return {**self._message(content, reason, sequence), "usage": self._usage(choice)}

    def chunks(self, index: int, delta: Delta, first: bool) -> list[dict]:
        out = []
        if first:
            started = Choice(prompt_tokens=delta.prompt_tokens, cached_tokens=delta.cached_tokens)
            out.append({"type": "message_start", "message": {
                **self._message([], None, None), "usage": self._usage(started)}})
        self._streamed.add(delta)
        text, calls = delta.text, []
        if self.tool_calls:
            text, calls = self._parser.feed(delta.text)
            if delta.finish_reason is not None:
                text += self._parser.close()
        if text or first and not self.tool_calls:
            out += self._text_events(text)
        for call in calls:
            out += self._call_events(call)
        if delta.finish_reason is not None:
            if not self._blocks:  # an empty reply: an empty text block, as a whole one has
                out += self._text_events("")
            reason, sequence = self._stop(self._streamed, bool(self._parser.calls))
            out += [*self._close_text(),
                    {"type": "message_delta",
                     "delta": {"stop_reason": reason, "stop_sequence": sequence},
                     "usage": self._usage(self._streamed)},
                    {"type": "message_stop"}]
        return out

    def _text_events(self, text: str) -> list[dict]:
        out = []
        if not self._text_open:
            out.append({"type": "content_block_start", "index": self._blocks,
                        "content_block": {"type": "text", "text": ""}})
            self._blocks += 1
            self._text_open = True
        if text:
            out.append({"type": "content_block_delta", "index": self._blocks - 1,
                        "delta": {"type": "text_delta", "text": text}})
        return out

    def _close_text(self) -> list[dict]:
        if not self._text_open:
            return []
        self._text_open = False
        return [{"type": "content_block_stop", "index": self._blocks - 1}]

    def _call_events(self, call: dict) -> list[dict]:
        if self.max_calls is not None and self._parser.calls.index(call) >= self.max_calls:
            return []
        closed = self._close_text()
        block, index = tool_use_block(call), self._blocks
        self._blocks += 1
        partial = json.dumps(block["input"], ensure_ascii=False)
        return [*closed,
                {"type": "content_block_start", "index": index,
                 "content_block": {**block, "input": {}}},
                {"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": partial}},
                {"type": "content_block_stop", "index": index}]

    def _message(self, content: list[dict], reason: str | None, sequence: str | None) -> dict:
        return {"id": self.request_id, "type": "message", "role": "assistant",
                "model": self.model, "content": content, "stop_reason": reason,
                "stop_sequence": sequence}

    def _usage(self, choice: Choice) -> dict:
        """Anthropic's counts: input_tokens are those not read from the cache (OpenAI's
        prompt_tokens count both)."""
        return {"input_tokens": choice.prompt_tokens - choice.cached_tokens,
                "output_tokens": choice.completion_tokens,
                "cache_read_input_tokens": choice.cached_tokens}

    def _stop(self, choice: Choice, called: bool) -> tuple[str, str | None]:
        """Anthropic's stop_reason, and the stop sequence that ended the message, if one did."""
        if called and choice.finish_reason != FINISH_LENGTH:
            return "tool_use", None
        if choice.finish_reason == FINISH_LENGTH:
            return "max_tokens", None
        if choice.token_ids and self.is_eog(choice.token_ids[-1]):
            return "end_turn", None
        sequence = matched_stop(self.detokenize(choice.token_ids), self.stops)
        # Without one, a structured output's grammar ended the message: its natural end.
        return ("stop_sequence", sequence) if sequence else ("end_turn", None)


async def create_message(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config)
    engine = await state.engine_for(request, body)
    req = parse_request(body, max_tokens_limit=engine.max_seq_len)
    sampling = await constrained(engine, req.sampling, req.constraint)
    prompt = await _prompt(request, engine, req.messages, req.tools)
    fmt = new_format(MessagesFormat, request, "msg", sampling, stops=sampling.stop,
                     is_eog=engine.model.is_eog, detokenize=engine.model.detokenize,
                     tool_calls=req.calls, parallel=req.tools is None or req.tools.parallel)
    return await respond(request, fmt, prompt, sampling, 1, req.stream, False, True)


async def count_tokens(request: Request, state: AppState) -> Response:
    """POST /v1/messages/count_tokens: {"input_tokens": N}, the tokens the conversation's
    prompt would take (with the tools offered), as a message would read it."""
    body = await read_json(request, state.config)
    engine = await state.engine_for(request, body)
    prompt = await _prompt(request, engine, read_conversation(body), read_tools(body))
    return JSONResponse({"input_tokens": len(prompt)})


async def _prompt(request: Request, engine, messages: list[dict],
                  spec: ToolSpec | None) -> list[int]:
    """The conversation's prompt tokens, with the tools it offers the model."""
    messages, offered = tools.prompt_messages(messages, spec,
                                              request_model(request).renderer.template.takes_tools)
    return await chat_prompt(request, engine, messages, offered)
