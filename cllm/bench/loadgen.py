"""Issuing requests and timing them: one RequestResult per request, at a fixed concurrency.

Every request ends either with tokens or with a recorded reason; nothing is dropped."""
from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

EMPTY_RESPONSE = "empty response"


@dataclass(slots=True)
class LoadSettings:
    """What each request asks for; the same for every server."""
    endpoint: str = "completions"  # or "chat"
    max_tokens: int = 50
    stream: bool = True
    ignore_eos: bool = True
    timeout: float = 600.0


@dataclass(slots=True)
class RequestResult:
    """Times are time.perf_counter() seconds; ttft and itl are relative durations."""
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between chunks that carried text
    output_tokens: int = 0
    prompt_tokens: int | None = None
    streamed: bool = True
    finish_reason: str | None = None
    error: str | None = None
    last_arrival: float | None = None  # when the latest chunk with output came

    def arrive(self, now: float) -> None:
        """A chunk carrying output came at `now`: the first sets ttft, each later one a gap."""
        if self.last_arrival is None:
            self.ttft = now - self.start
        else:
            self.itl.append(now - self.last_arrival)
        self.last_arrival = now

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; only a streamed response shows the first."""
        if not self.streamed or self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class StreamParser:
    """Server-sent events of a streamed completion, fed line by line with arrival times."""

    def __init__(self, start: float) -> None:
        self.result = RequestResult(start=start)
        self.chunks = 0
        self.done = False
        self._usage_tokens: int | None = None

    def feed(self, line: str, now: float) -> None:
        if not line.startswith("data:"):
            return  # blank separators, comments, event: lines
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        chunk = json.loads(data)
        if "error" in chunk:
            self.result.error = "stream error: " + error_message(chunk["error"])
            return
        usage = chunk.get("usage")
        if usage:
            self._usage_tokens = usage.get("completion_tokens")
            self.result.prompt_tokens = usage.get("prompt_tokens")
        for choice in chunk.get("choices") or ():
            self.result.finish_reason = choice.get("finish_reason") or self.result.finish_reason
        if any(choice_text(c) for c in chunk.get("choices") or ()):
            self.chunks += 1
            self.result.arrive(now)

    def finish(self, now: float) -> RequestResult:
        r = self.result
        r.end = now
        # The usage chunk (stream_options.include_usage) counts tokens exactly; a server
        # without it gets one token per text chunk.
        r.output_tokens = self._usage_tokens if self._usage_tokens is not None else self.chunks
        if r.error is None and not self.done:
            r.error = "stream ended without [DONE]"
        return check_tokens(r)


def choice_text(choice: dict) -> str:
    return choice.get("text") or (choice.get("delta") or {}).get("content") or ""


def error_message(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def check_tokens(r: RequestResult) -> RequestResult:
    if r.error is None and r.output_tokens <= 0:
        r.error = EMPTY_RESPONSE
    return r


class HttpTarget:
    """One OpenAI-compatible server: sends a prompt, returns its RequestResult, never raises."""

    def __init__(self, url: str, model: str, load: LoadSettings, client: httpx.AsyncClient):
        self.url = url.rstrip("/")
        self.model = model
        self.load = load
        self.client = client
        path = "/v1/chat/completions" if load.endpoint == "chat" else "/v1/completions"
        self.endpoint_url = self.url + path

    def body(self, prompt: str) -> dict:
        body: dict = {"model": self.model, "max_tokens": self.load.max_tokens,
                      "temperature": 0.0, "stream": self.load.stream}
        if self.load.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        if self.load.ignore_eos:
            body["ignore_eos"] = True
        if self.load.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def send(self, prompt: str) -> RequestResult:
        start = time.perf_counter()
        try:
            if self.load.stream:
                return await self._send_streaming(prompt, start)
            return await self._send_whole(prompt, start)
        except Exception as e:  # any failure is a result with its reason, never a lost request
            return RequestResult(start=start, end=time.perf_counter(),
                                 error=f"{type(e).__name__}: {e}".rstrip(": "))

    async def _send_streaming(self, prompt: str, start: float) -> RequestResult:
        async with self.client.stream("POST", self.endpoint_url, json=self.body(prompt)) as resp:
            if resp.status_code != 200:
                return await _http_failure(resp, start)
            parser = StreamParser(start)
            async for line in resp.aiter_lines():
                parser.feed(line, time.perf_counter())
            return parser.finish(time.perf_counter())

    async def _send_whole(self, prompt: str, start: float) -> RequestResult:
        resp = await self.client.post(self.endpoint_url, json=self.body(prompt))
        if resp.status_code != 200:
            return await _http_failure(resp, start)
        end = time.perf_counter()
        payload = resp.json()
        usage = payload.get("usage") or {}
        choices = payload.get("choices") or [{}]
        # Without streaming the client sees the first token when it sees the whole answer.
        r = RequestResult(start=start, end=end, ttft=end - start, streamed=False,
                          output_tokens=usage.get("completion_tokens", 0),
                          prompt_tokens=usage.get("prompt_tokens"),
                          finish_reason=choices[0].get("finish_reason"))
        if not usage:
            r.error = "response has no usage"
        return check_tokens(r)


async def _http_failure(resp: httpx.Response, start: float) -> RequestResult:
    text = (await resp.aread()).decode(errors="replace")
    try:
        message = error_message(json.loads(text).get("error", text))
    except (json.JSONDecodeError, AttributeError):
        message = text.strip()[:200]
    return RequestResult(start=start, end=time.perf_counter(),
                         error=f"HTTP {resp.status_code}: {message}".rstrip(": "))


async def first_model(client: httpx.AsyncClient, url: str) -> str:
    """The id of the first model GET /v1/models lists."""
    try:
        resp = await client.get(url.rstrip("/") + "/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, LookupError, TypeError) as e:
        raise SystemExit(f"cannot learn the model name from {url}/v1/models ({e}); pass --model")


Sender = Callable[[str], Awaitable[RequestResult]]


async def run_level(send: Sender, prompts: Sequence[str], concurrency: int,
                    desc: str = "") -> tuple[list[RequestResult], float]:
    """Sends every prompt, at most `concurrency` at a time; returns results and the wall time."""
    results: list[RequestResult | None] = [None] * len(prompts)
    pending = iter(enumerate(prompts))  # shared by the workers: each takes the next request
    with tqdm(total=len(prompts), desc=desc, file=sys.stderr, leave=False,
              disable=not desc) as bar:
        async def worker() -> None:
            for i, prompt in pending:
                results[i] = await send(prompt)
                bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(prompts))))))
        duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration
