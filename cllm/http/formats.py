"""How each API turns engine deltas into response bodies: OpenAI's completions and chat and the
original /generate here; the other APIs' formats live beside their routes."""
from __future__ import annotations

import codecs
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from cllm.engine.engine import Delta, TokenLogprob
from cllm.engine.sequence import FINISH_STOP
from cllm.errors import APIError
from cllm.http import responses
from cllm.http.responses import Token
from cllm.http.tools import CallParser, split_reply


@dataclass(slots=True)
class Choice:
    """Everything one sequence produced, gathered for a non-streamed response."""
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs or ()
        self.token_ids += delta.token_ids
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.timings = delta.timings or {}
            self.prompt_tokens = delta.prompt_tokens
            self.cached_tokens = delta.cached_tokens
            self.completion_tokens = delta.completion_tokens


def usage(choices: list[Choice], per_prompt: int | None = None) -> dict:
    """Each prompt counted once for its choices, as OpenAI does (and its cache hits as its first
    choice found them): one prompt for all the choices, or a batch's prompts of `per_prompt`
    choices each, summed."""
    firsts = choices[::per_prompt] if per_prompt else choices[:1]
    return responses.usage_dict(sum(c.prompt_tokens for c in firsts),
                                sum(c.completion_tokens for c in choices),
                                sum(c.cached_tokens for c in firsts))


def matched_stop(text: str, stops: tuple[str, ...]) -> str | None:
    """Which stop string ended a generation whose tokens detokenize to `text` (the stop string
    included): the one found first."""
    found = [(text.find(s), i) for i, s in enumerate(stops) if s in text]
    return stops[min(found)[1]] if found else None


class TextOffsets:
    """Where each token starts in its choice's text, in characters, counted across chunks: the
    text is the tokens' bytes decoded as the engine decodes them."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._chars = 0

    def next(self, token: Token) -> int:
        at = self._chars
        self._chars += len(self._decoder.decode(token.raw or b""))
        return at


class Format:
    """How one API shapes a response: whole (`response`), streamed (`chunks`, framed by `event`
    and ended by `done_event`), and its errors. The defaults are OpenAI's. `token` shows a token
    id as logprobs name it. With `prompt_token_ids`, responses carry them and each choice's
    token ids (vLLM's return_token_ids)."""
    chat = False  # chunk objects are chat.completion.chunk rather than text_completion
    media_type = "text/event-stream"  # of a streamed response; event() frames its chunks

    def __init__(self, request_id: str, model: str, created: int, token: Callable[[int], Token],
                 want_logprobs: bool, *, prompt_token_ids: list[int] | None = None) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.token = token
        self.want_logprobs = want_logprobs
        self.prompt_token_ids = prompt_token_ids

    def error_body(self, error: APIError) -> dict:
        return error.body()

    def event(self, payload: dict) -> bytes:
        """One SSE event of a streamed response."""
        return responses.sse_event(payload)

    def done_event(self) -> bytes | None:
        """What ends a streamed response after its last chunk; OpenAI's APIs send [DONE]."""
        return responses.sse_event("[DONE]")

    def usage(self, choices: list[Choice]) -> dict:
        return usage(choices)

    def usage_chunk(self, usage_: dict) -> dict | None:
        return responses.usage_chunk(self.request_id, self.model, self.created, usage_,
                                     chat=self.chat)

    def chunks(self, index: int, delta: Delta, first: bool) -> list[dict]:
        raise NotImplementedError

    def response(self, choices: list[Choice]) -> dict:
        raise NotImplementedError


class TypedEventsFormat(Format):
    """A stream of typed events (Anthropic's Messages, OpenAI's Responses): each SSE event
    names its payload's type, nothing follows the last one, and usage rides in the events."""

    def event(self, payload: dict) -> bytes:
        return responses.typed_event(payload)

    def done_event(self) -> bytes | None:
        return None

    def usage_chunk(self, usage_: dict) -> dict | None:
        return None


class CompletionFormat(Format):
    """Its choices answer one prompt or a batch: `n` choices a prompt, choice prompt index * n
    + i, as OpenAI's; `prompt_token_ids` holds each prompt's ids."""

    def __init__(self, *args, n: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.n = n
        # Streamed: each choice's, chunk after chunk, made on its first (setdefault would make
        # an incremental decoder for every token: 3 of the event loop's 116 py-spy samples).
        self._offsets: defaultdict[int, TextOffsets] = defaultdict(TextOffsets)

    def _logprobs(self, entries: list[TokenLogprob], offsets: TextOffsets) -> dict | None:
        if not self.want_logprobs:
            return None
        tokens = [self.token(e.token_id) for e in entries]
        return responses.completion_logprobs(
            [t.text for t in tokens], [e.logprob for e in entries],
            [{self.token(t).text: lp for t, lp in e.top} for e in entries],
            [offsets.next(t) for t in tokens])

    def chunks(self, index: int, delta: Delta, first: bool) -> list[dict]:
        ids = self.prompt_token_ids is not None and delta.token_ids
        if not delta.text and delta.finish_reason is None and not delta.logprobs and not ids:
            return []  # a token that only started a multi-byte character or a stop string
        offsets = self._offsets[index]
        chunk = responses.completion_chunk(
            self.request_id, self.model, self.created, index, delta.text, delta.finish_reason,
            self._logprobs(delta.logprobs or [], offsets))
        if self.prompt_token_ids is not None:
            self._add_token_ids(chunk["choices"][0], delta.token_ids, first)
        return [chunk]

    def usage(self, choices: list[Choice]) -> dict:
        return usage(choices, self.n)

    def response(self, choices: list[Choice]) -> dict:
        body = responses.completion_response(
            self.request_id, self.model, self.created,
            [responses.completion_choice(i, c.text, c.finish_reason,
                                         self._logprobs(c.logprobs, TextOffsets()))
             for i, c in enumerate(choices)], self.usage(choices))
        if self.prompt_token_ids is not None:
            for out, choice in zip(body["choices"], choices):
                self._add_token_ids(out, choice.token_ids, True)
        return body

    def _add_token_ids(self, choice: dict, token_ids: list[int], with_prompt: bool) -> None:
        # vLLM puts a completion's prompt ids in each choice (in its first chunk when streamed).
        if with_prompt:
            choice["prompt_token_ids"] = self.prompt_token_ids[choice["index"] // self.n]
        choice["token_ids"] = token_ids


class ChatFormat(Format):
    """`tool_calls`: replies are parsed for tool calls (the request offered tools); `functions`:
    the request offered them as the deprecated functions, and a reply's call is its
    `function_call`."""
    chat = True

    def __init__(self, *args, tool_calls: bool = False, functions: bool = False,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_calls = tool_calls
        self.functions = functions
        self._parsers: defaultdict[int, CallParser] = defaultdict(CallParser)  # streamed

    def _logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        return responses.chat_logprobs(
            [(self.token(e.token_id), e.logprob, [(self.token(t), lp) for t, lp in e.top])
             for e in entries])

    def chunks(self, index: int, delta: Delta, first: bool) -> list[dict]:
        out = []
        chunk = lambda **kw: responses.chat_chunk(  # noqa: E731
            self.request_id, self.model, self.created, index, **kw)
        ids = self.prompt_token_ids is not None
        if first:
            out.append(chunk(role=True, text="", finish_reason=None, logprobs=None))
            if ids:  # vLLM: a chat's prompt ids at the top of its first chunk
                out[-1]["prompt_token_ids"] = self.prompt_token_ids
        text, calls, made_calls = delta.text, [], False
        if self.tool_calls:
            parser = self._parsers[index]
            text, calls = parser.feed(delta.text)
            if delta.finish_reason is not None:
                text += parser.close()
            first_call, made_calls = len(parser.calls) - len(calls), bool(parser.calls)
            calls = [{"index": first_call + k, **call} for k, call in enumerate(calls)]
        if text or delta.logprobs or (ids and delta.token_ids):
            out.append(chunk(role=False, text=text, finish_reason=None,
                             logprobs=self._logprobs(delta.logprobs or [])))
            if ids:
                out[-1]["choices"][0]["token_ids"] = delta.token_ids
        if calls and (not self.functions or calls[0]["index"] == 0):
            out.append(chunk(role=False, text=None, finish_reason=None, logprobs=None,
                             **self._calls(calls)))
        if delta.finish_reason is not None:
            out.append(chunk(role=False, text=None, logprobs=None,
                             finish_reason=_reason(delta.finish_reason, made_calls,
                                                   self.functions)))
        return out

    def response(self, choices: list[Choice]) -> dict:
        body = responses.chat_response(
            self.request_id, self.model, self.created,
            [self._choice(i, c) for i, c in enumerate(choices)], usage(choices))
        if self.prompt_token_ids is not None:
            body["prompt_token_ids"] = self.prompt_token_ids
            for out, choice in zip(body["choices"], choices):
                out["token_ids"] = choice.token_ids
        return body

    def _calls(self, calls: list[dict]) -> dict:
        """A chunk's calls: its tool_calls, or the reply's first call as its function_call."""
        return {"function_call": calls[0]["function"]} if self.functions else {
            "tool_calls": calls}

    def _choice(self, index: int, choice: Choice) -> dict:
        text, calls = split_reply(choice.text) if self.tool_calls else (choice.text, [])
        reason = _reason(choice.finish_reason, bool(calls), self.functions)
        return responses.chat_choice(index, text, reason, self._logprobs(choice.logprobs),
                                     calls, self.functions)


def _reason(finish_reason: str | None, made_calls: bool, functions: bool) -> str | None:
    """A reply that called tools and ended by itself ends with "tool_calls", as OpenAI's, or
    "function_call" where it offered them as the deprecated functions."""
    if made_calls and finish_reason == FINISH_STOP:
        return "function_call" if functions else "tool_calls"
    return finish_reason


class GenerateFormat(Format):
    """The original API: {"success", "data": {"text", "generated_tokens", "finish_reason"}}.
    Streamed, each event carries the new text and the count so far."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._generated = 0

    error_body_of = staticmethod(responses.generate_failure)

    def error_body(self, error: APIError) -> dict:
        return responses.generate_failure(error)

    def usage_chunk(self, usage_: dict) -> dict | None:
        return None

    def chunks(self, index: int, delta: Delta, first: bool) -> list[dict]:
        self._generated += len(delta.token_ids)
        if not delta.text and delta.finish_reason is None:
            return []
        return [responses.generate_success(delta.text, self._generated, delta.finish_reason)]

    def response(self, choices: list[Choice]) -> dict:
        (choice,) = choices
        return responses.generate_success(choice.text, choice.completion_tokens,
                                          choice.finish_reason)
