"""POST /v1/responses: OpenAI's Responses API, stateless (as llama-server serves it): text in,
one text message out, whole or as its stream of typed events.

Stateless means nothing is stored: `previous_response_id` is refused, and a conversation is
sent whole in `input`."""
from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response

from cllm.config import SamplingParams
from cllm.engine.engine import Delta
from cllm.engine.sequence import FINISH_LENGTH
from cllm.errors import APIError
from cllm.http import schemas
from cllm.http.common import AppState, chat_prompt, new_format, read_json, respond
from cllm.http.formats import Choice, TypedEventsFormat

_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(slots=True)
class ResponsesRequest:
    messages: list[dict]  # chat messages, as parse_chat makes them
    instructions: str | None
    stream: bool
    sampling: SamplingParams


def parse_request(body: dict, *, max_tokens_limit: int) -> ResponsesRequest:
    """input: a string (one user message) or an array of messages whose content is a string or
    text parts; instructions: the system message; max_output_tokens; the sampling fields."""
    if body.get("previous_response_id") is not None:
        raise APIError(400, "this server stores no responses: send the whole conversation in "
                       "input instead of previous_response_id", param="previous_response_id")
    schemas.refuse_unimplemented(body)
    if body.get("tools"):
        raise APIError(400, "tools are not supported on /v1/responses; use /v1/chat/completions",
                       param="tools")
    _text_format(body)
    instructions = schemas.read_field(body, "instructions", "a string")
    messages = ([{"role": "system", "content": instructions}] if instructions else [])
    messages += _input(body.get("input"))
    max_tokens = schemas.read_max_tokens(body, "max_output_tokens", max_tokens_limit,
                                         max_tokens_limit)
    return ResponsesRequest(messages, instructions,
                            stream=schemas.read_field(body, "stream", "a boolean", False),
                            sampling=schemas.read_sampling(body, max_tokens, None))


def _text_format(body: dict) -> None:
    """Only text output: text.format.type is "text" or absent. Its other options (verbosity)
    are hints to the model, which a model without them meets as it writes anyway."""
    text = schemas.read_field(body, "text", "an object", {})
    form = text.get("format")
    if form is not None and (not isinstance(form, dict) or form.get("type") != "text"):
        raise APIError(400, "only text output is supported: text.format.type must be text",
                       param="text")


def error_event(error: APIError, sequence_number: int) -> dict:
    """What ends a stream that failed (OpenAI's ResponseErrorEvent): also sent by a scale-out
    front whose replica died mid-stream, numbered after the last event it relayed."""
    return {"type": "error", "sequence_number": sequence_number, "code": error.code,
            "message": error.message, "param": error.param}


def _input(value: object) -> list[dict]:
    if isinstance(value, str) and value:
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise APIError(400, "input must be a non-empty string or array of messages",
                       param="input")
    messages = []
    for i, item in enumerate(value):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise APIError(400, f"input[{i}]: only messages are supported", param="input")
        content = item.get("content")
        if isinstance(content, list):  # the Responses API's part types, as chat's text parts
            content = [{"type": "text", "text": p.get("text")}
                       if isinstance(p, dict) and p.get("type") in _TEXT_PARTS else p
                       for p in content]
        messages.append({"role": item.get("role"), "content": content})
    try:
        return schemas.read_messages(messages)
    except APIError as e:  # its checks, named as this API names the field
        raise APIError(400, e.message.replace("messages", "input"), param="input") from None


class ResponsesFormat(TypedEventsFormat):
    """A response object, or the events that build one: created, in_progress, the message's
    item and text part added, text deltas, their done events, then completed (or incomplete,
    when max_output_tokens cut it short)."""

    def __init__(self, *args, settings: SamplingParams, instructions: str | None,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.settings = settings
        self.instructions = instructions
        # OpenAI's ids: "resp_...", and "msg_..." for the message item.
        self.request_id = self.request_id.replace("-", "_", 1)
        self.message_id = "msg_" + self.request_id.partition("_")[2]
        self._sequence = 0
        self._streamed = Choice()

    def error_body(self, error: APIError) -> dict:
        return error_event(error, self._next_number())

    def response(self, choices: list[Choice]) -> dict:
        (choice,) = choices
        return self._response(choice)

    def chunks(self, index: int, delta: Delta, first: bool) -> list[dict]:
        out = []
        if first:
            pending = self._response(None)
            item = self._message("", "in_progress")
            out += [self._event("response.created", response=pending),
                    self._event("response.in_progress", response=pending),
                    self._event("response.output_item.added", output_index=0,
                                item={**item, "content": []}),
                    self._event("response.content_part.added", **self._where(),
                                part=item["content"][0])]
        self._streamed.add(delta)
        if delta.text:
            out.append(self._event("response.output_text.delta", **self._where(),
                                   delta=delta.text, logprobs=[]))
        if delta.finish_reason is not None:
            done = self._response(self._streamed)
            item = done["output"][0]
            out += [self._event("response.output_text.done", **self._where(),
                                text=self._streamed.text, logprobs=[]),
                    self._event("response.content_part.done", **self._where(),
                                part=item["content"][0]),
                    self._event("response.output_item.done", output_index=0, item=item),
                    self._event(f"response.{done['status']}", response=done)]
        return out

    def _event(self, type_: str, **fields) -> dict:
        return {"type": type_, "sequence_number": self._next_number(), **fields}

    def _next_number(self) -> int:
        """Each event of a stream, the error that may end it included, numbers itself in turn."""
        self._sequence += 1
        return self._sequence - 1

    def _where(self) -> dict:
        return {"item_id": self.message_id, "output_index": 0, "content_index": 0}

    def _message(self, text: str, status: str) -> dict:
        return {"id": self.message_id, "type": "message", "status": status,
                "role": "assistant", "content": [{"type": "output_text", "text": text,
                                                  "annotations": [], "logprobs": []}]}

    def _response(self, choice: Choice | None) -> dict:
        """The response object: in progress (no choice yet), completed or incomplete."""
        status, incomplete, output, usage = "in_progress", None, [], None
        if choice is not None:
            cut = choice.finish_reason == FINISH_LENGTH
            status = "incomplete" if cut else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut else None
            output = [self._message(choice.text, status)]
            usage = {"input_tokens": choice.prompt_tokens,
                     "input_tokens_details": {"cached_tokens": choice.cached_tokens},
                     "output_tokens": choice.completion_tokens,
                     "output_tokens_details": {"reasoning_tokens": 0},
                     "total_tokens": choice.prompt_tokens + choice.completion_tokens}
        s = self.settings
        return {"id": self.request_id, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": output, "usage": usage,
                "error": None, "incomplete_details": incomplete,
                "instructions": self.instructions, "max_output_tokens": s.max_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "parallel_tool_calls": False,
                "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}},
                "store": False}


async def create_response(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config)
    engine = await state.engine_for(request, body)
    req = parse_request(body, max_tokens_limit=engine.max_seq_len)
    prompt = await chat_prompt(request, engine, req.messages)
    fmt = new_format(ResponsesFormat, request, "resp", req.sampling, settings=req.sampling,
                     instructions=req.instructions)
    return await respond(request, fmt, prompt, req.sampling, 1, req.stream, False, True)
