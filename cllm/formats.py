"""How each API (completions, chat, /generate) turns engine deltas into response bodies."""
from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field

from cllm import responses
from cllm.api import APIError
from cllm.engine import Delta, TokenLogprob
from cllm.responses import Token
from cllm.sequence import FINISH_STOP
from cllm.tools import CallParser, split_reply


@dataclass(slots=True)
class Choice:
    """Everything one sequence produced, gathered for a non-streamed response."""
    text: str = ""
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.logprobs += delta.logprobs or ()
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
            self.prompt_tokens = delta.prompt_tokens
            self.cached_tokens = delta.cached_tokens
            self.completion_tokens = delta.completion_tokens


def usage(choices: list[Choice]) -> dict:
    """One prompt for all n choices, counted once, as OpenAI does (and its cache hits as the
    first choice found them)."""
    return responses.usage_dict(choices[0].prompt_tokens,
                                sum(c.completion_tokens for c in choices),
                                choices[0].cached_tokens)


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
    """Shared shape of the OpenAI formats; `token` shows a token id as logprobs name it."""
    chat = False  # chunk objects are chat.completion.chunk rather than text_completion

    def __init__(self, request_id: str, model: str, created: int, token: Callable[[int], Token],
                 want_logprobs: bool) -> None:
        self.request_id = request_id
        self.model = model
        self.created = created
        self.token = token
        self.want_logprobs = want_logprobs

    def error_body(self, error: APIError) -> dict:
        return error.body()

    def usage_chunk(self, usage_: dict) -> dict | None:
        return responses.usage_chunk(self.request_id, self.model, self.created, usage_,
                                     chat=self.chat)

    def chunks(self, index: int, delta: Delta, first: bool) -> list[dict]:
        raise NotImplementedError

    def response(self, choices: list[Choice]) -> dict:
        raise NotImplementedError


class CompletionFormat(Format):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._offsets: dict[int, TextOffsets] = {}  # streamed: each choice's, chunk after chunk

    def _logprobs(self, entries: list[TokenLogprob], offsets: TextOffsets) -> dict | None:
        if not self.want_logprobs:
            return None
        tokens = [self.token(e.token_id) for e in entries]
        return responses.completion_logprobs(
            [t.text for t in tokens], [e.logprob for e in entries],
            [{self.token(t).text: lp for t, lp in e.top} for e in entries],
            [offsets.next(t) for t in tokens])

    def chunks(self, index: int, delta: Delta, first: bool) -> list[dict]:
        if not delta.text and delta.finish_reason is None and not delta.logprobs:
            return []  # a token that only started a multi-byte character or a stop string
        offsets = self._offsets.setdefault(index, TextOffsets())
        return [responses.completion_chunk(
            self.request_id, self.model, self.created, index, delta.text, delta.finish_reason,
            self._logprobs(delta.logprobs or [], offsets))]

    def response(self, choices: list[Choice]) -> dict:
        return responses.completion_response(
            self.request_id, self.model, self.created,
            [responses.completion_choice(i, c.text, c.finish_reason,
                                         self._logprobs(c.logprobs, TextOffsets()))
             for i, c in enumerate(choices)], usage(choices))


class ChatFormat(Format):
    """`tool_calls`: replies are parsed for tool calls (the request offered tools)."""
    chat = True

    def __init__(self, *args, tool_calls: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.tool_calls = tool_calls
        self._parsers: dict[int, CallParser] = {}  # streamed: each choice's

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
        if first:
            out.append(chunk(role=True, text="", finish_reason=None, logprobs=None))
        text, calls, made_calls = delta.text, [], False
        if self.tool_calls:
            parser = self._parsers.setdefault(index, CallParser())
            text, calls = parser.feed(delta.text)
            if delta.finish_reason is not None:
                text += parser.close()
            first_call, made_calls = len(parser.calls) - len(calls), bool(parser.calls)
            calls = [{"index": first_call + k, **call} for k, call in enumerate(calls)]
        if text or delta.logprobs:
            out.append(chunk(role=False, text=text, finish_reason=None,
                             logprobs=self._logprobs(delta.logprobs or [])))
        if calls:
            out.append(chunk(role=False, text=None, finish_reason=None, logprobs=None,
                             tool_calls=calls))
        if delta.finish_reason is not None:
            out.append(chunk(role=False, text=None, logprobs=None,
                             finish_reason=_reason(delta.finish_reason, made_calls)))
        return out

    def response(self, choices: list[Choice]) -> dict:
        return responses.chat_response(
            self.request_id, self.model, self.created,
            [self._choice(i, c) for i, c in enumerate(choices)], usage(choices))

    def _choice(self, index: int, choice: Choice) -> dict:
        text, calls = split_reply(choice.text) if self.tool_calls else (choice.text, [])
        return responses.chat_choice(index, text, _reason(choice.finish_reason, bool(calls)),
                                     self._logprobs(choice.logprobs), calls)


def _reason(finish_reason: str | None, made_calls: bool) -> str | None:
    """A reply that called tools and ended by itself ends with "tool_calls", as OpenAI's."""
    return "tool_calls" if made_calls and finish_reason == FINISH_STOP else finish_reason


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
