"""Issuing requests and timing them: one RequestResult per request, at a fixed concurrency.

Every request ends either with tokens or with a recorded reason; nothing is dropped."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import aiohttp
from tqdm import tqdm

EMPTY_RESPONSE = "empty response"



@dataclass(frozen=True, slots=True)
class Sized:
    """A prompt with its own output length, as in ShareGPT-like workloads."""
    prompt: str | list[dict]
    max_tokens: int


# What a request sends: a prompt, or for the chat endpoint the whole list of messages; Sized
# when its output length is its own rather than --max-tokens.
Prompt = str | list[dict] | Sized


@dataclass(frozen=True, slots=True)
class Level:
    """How one level loads a server: a closed loop keeping `concurrency` requests in flight, or
    an open loop of Poisson arrivals at `rate` requests a second (inf: all at once), with at
    most `concurrency` in flight if set."""
    concurrency: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        if self.rate is None:
            return f"c={self.concurrency}"
        cap = f" c<={self.concurrency}" if self.concurrency else ""
        return f"rate={self.rate:g}{cap}"


@dataclass(slots=True)
class LoadSettings:
    """What each request asks for; the same for every server."""
    endpoint: str = "completions"  # or "chat"
    max_tokens: int = 50
    stream: bool = True
    ignore_eos: bool = True
    timeout: float = 600.0
    cache_prompt: bool | None = None  # None: the field is not sent, each server's default holds
    # A JSON Schema sent as response_format: the reply ends when its JSON does (no ignore_eos).
    json_schema: dict | None = None
    # The sampling fields each request sends (Sampling.fields); unsent ones keep each server's
    # default (llama-server's top-k 40, top-p 0.95, min-p 0.05).
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})


@dataclass(slots=True)
class RequestResult:
    """Times are time.perf_counter() seconds; ttft and itl are relative durations."""
    start: float = 0.0
    end: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)  # gaps between chunks that carried text
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None  # of prompt_tokens, those the server took from its cache
    text: str = ""  # the reply, which a conversation sends back as the assistant's turn
    streamed: bool = True
    finish_reason: str | None = None
    error: str | None = None
    last_arrival: float | None = None  # when the latest chunk with output came
    resent: bool = False  # the server closed the first connection before answering

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
    def events(self) -> int:
        """Streamed events that carried output."""
        return len(self.itl) + 1 if self.ttft is not None and self.streamed else 0

    @property
    def token_gaps(self) -> list[float]:
        """Inter-token latency per token: each gap between events over the tokens its event
        carried. A stream does not say how many each carries, so the tokens after the first
        event (usage's count less one) are spread evenly over the later events; their mean is
        then the TPOT up to the last event."""
        if not self.itl or self.output_tokens < 2:
            return []
        per_event = (self.output_tokens - 1) / len(self.itl)
        return [gap / per_event for gap in self.itl]

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
        self._tail: dict = {}  # the latest "usage" and "timings" the stream carried

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
        self._tail.update((key, chunk[key]) for key in ("usage", "timings") if chunk.get(key))
        for choice in chunk.get("choices") or ():
            self.result.finish_reason = choice.get("finish_reason") or self.result.finish_reason
        text = "".join(choice_text(c) for c in chunk.get("choices") or ())
        if text:
            self.chunks += 1
            self.result.text += text
            self.result.arrive(now)

    def finish(self, now: float) -> RequestResult:
        r = self.result
        r.end = now
        # The usage chunk (stream_options.include_usage) counts tokens exactly; a server
        # without it gets one token per text chunk.
        completion = (self._tail.get("usage") or {}).get("completion_tokens")
        r.output_tokens = completion if completion is not None else self.chunks
        read_prompt_usage(r, self._tail)
        if r.error is None and not self.done:
            r.error = "stream ended without [DONE]"
        return check_tokens(r)


def choice_text(choice: dict) -> str:
    """A completion's text, a streamed chat delta's or a whole chat message's content."""
    return (choice.get("text") or (choice.get("delta") or {}).get("content")
            or (choice.get("message") or {}).get("content") or "")


def read_prompt_usage(r: RequestResult, payload: dict) -> None:
    """The prompt's token count and how much of it came from the server's cache."""
    r.prompt_tokens = (payload.get("usage") or {}).get("prompt_tokens")
    r.cached_tokens = cached_tokens(payload)


def cached_tokens(payload: dict) -> int | None:
    """OpenAI's usage.prompt_tokens_details.cached_tokens; else llama-server's own
    timings.cache_n; None when the server tells neither."""
    details = (payload.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return details["cached_tokens"]
    return (payload.get("timings") or {}).get("cache_n")


def error_message(error: object) -> str:
    if isinstance(error, dict):
        return str(error.get("message") or error)
    return str(error)


def check_tokens(r: RequestResult) -> RequestResult:
    if r.error is None and r.output_tokens <= 0:
        r.error = EMPTY_RESPONSE
    return r


def bearer(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class Connections:
    """The benchmark's kept-alive connections: one aiohttp session with a connection for every
    request in flight. aiohttp rather than httpx: on a 2-core machine the client shares the
    cores with the server it measures, and at 32 streams httpx took ~0.2 ms of CPU a streamed
    token (5.5% of a core) and ~5 ms from a response's end to the next request reaching the
    server, aiohttp 0.05 ms and ~2.5 ms (2-core Intel Xeon). A closed loop's
    server idles through that turnaround, and a cllm engine waiting for successors with it."""

    CONNECT_TIMEOUT = 30.0  # seconds

    def __init__(self, connections: int, timeout: float, api_key: str | None = None) -> None:
        self._connections = connections
        self._headers = bearer(api_key)  # sent with every request unless it sends its own
        # Between bytes, not in all: a long generation streams for minutes.
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.CONNECT_TIMEOUT,
                                              sock_read=timeout)
        self.session: aiohttp.ClientSession | None = None
        self.unpooled: aiohttp.ClientSession | None = None  # a new connection each request

    async def __aenter__(self) -> Connections:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self._connections), timeout=self._timeout,
            headers=self._headers)
        self.unpooled = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(force_close=True), timeout=self._timeout,
            headers=self._headers)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.session.close()
        await self.unpooled.close()


class HttpTarget:
    """One OpenAI-compatible server: sends a prompt, returns its RequestResult, never raises.
    With `api_key`, each request sends it as its user's (a server without keys ignores it)."""

    def __init__(self, url: str, model: str, load: LoadSettings, connections: Connections,
                 api_key: str | None = None):
        self.url = url.rstrip("/")
        self.model = model
        self.load = load
        self.connections = connections
        self.headers = bearer(api_key)
        path = "/v1/chat/completions" if load.endpoint == "chat" else "/v1/completions"
        self.endpoint_url = self.url + path

    def body(self, prompt: Prompt) -> dict:
        max_tokens = self.load.max_tokens
        if isinstance(prompt, Sized):
            prompt, max_tokens = prompt.prompt, prompt.max_tokens
        body: dict = {"model": self.model, "max_tokens": max_tokens,
                      "stream": self.load.stream, **self.load.sampling}
        if self.load.endpoint == "chat":
            body["messages"] = (prompt if isinstance(prompt, list)
                                else [{"role": "user", "content": prompt}])
        else:
            body["prompt"] = prompt
        if self.load.json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "reply", "schema": self.load.json_schema}}
        elif self.load.ignore_eos:
            body["ignore_eos"] = True
        if self.load.stream:
            body["stream_options"] = {"include_usage": True}
        if self.load.cache_prompt is not None:
            body["cache_prompt"] = self.load.cache_prompt
        return body

    async def send(self, prompt: Prompt) -> RequestResult:
        start = time.perf_counter()
        try:
            if self.load.stream:
                return await self._send_streaming(prompt, start)
            return await self._send_whole(prompt, start)
        except Exception as e:  # any failure is a result with its reason, never a lost request
            return RequestResult(start=start, end=time.perf_counter(),
                                 error=f"{type(e).__name__}: {e}".rstrip(": "))

    @contextlib.asynccontextmanager
    async def _response(self, prompt: Prompt
                        ) -> AsyncIterator[tuple[aiohttp.ClientResponse, bool]]:
        """The response, once its head has come, and whether the request was sent twice: a
        server may close a kept-alive connection as the request goes out on it (llama-server
        closes each after its stream, without saying so), and clients such as the openai SDK
        send it again on a new connection; so does this one, once, and the result says so."""
        body = self.body(prompt)
        connections = self.connections
        try:
            resp = await connections.session.post(self.endpoint_url, json=body,
                                                  headers=self.headers)
            resent = False
        except aiohttp.ClientConnectorError:  # no connection at all: nothing to send again
            raise
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
            resp = await connections.unpooled.post(self.endpoint_url, json=body,
                                                   headers=self.headers)
            resent = True
        async with resp:
            yield resp, resent
            # One pass of the event loop before the caller's next request: where the server
            # closed the connection right after the response, the session sees it closed and
            # opens a new one for the next request rather than fail on the dead one.
            await asyncio.sleep(0)

    async def _send_streaming(self, prompt: Prompt, start: float) -> RequestResult:
        async with self._response(prompt) as (resp, resent):
            if resp.status != 200:
                return await _http_failure(resp, start)
            parser = StreamParser(start)
            async for line in resp.content:
                parser.feed(line.decode(), time.perf_counter())
            result = parser.finish(time.perf_counter())
        result.resent = resent
        return result

    async def _send_whole(self, prompt: Prompt, start: float) -> RequestResult:
        async with self._response(prompt) as (resp, resent):
            if resp.status != 200:
                return await _http_failure(resp, start)
            content = await resp.read()
            end = time.perf_counter()
        payload = json.loads(content)
        usage = payload.get("usage") or {}
        choices = payload.get("choices") or [{}]
        # Without streaming the client sees the first token when it sees the whole answer.
        r = RequestResult(start=start, end=end, ttft=end - start, streamed=False,
                          output_tokens=usage.get("completion_tokens", 0),
                          text=choice_text(choices[0]),
                          finish_reason=choices[0].get("finish_reason"), resent=resent)
        read_prompt_usage(r, payload)
        if not usage:
            r.error = "response has no usage"
        return check_tokens(r)


async def _http_failure(resp: aiohttp.ClientResponse, start: float) -> RequestResult:
    text = (await resp.read()).decode(errors="replace")
    try:
        message = error_message(json.loads(text).get("error", text))
    except (json.JSONDecodeError, AttributeError):
        message = text.strip()[:200]
    return RequestResult(start=start, end=time.perf_counter(),
                         error=f"HTTP {resp.status}: {message}".rstrip(": "))


async def first_model(connections: Connections, url: str) -> str:
    """The id of the first model GET /v1/models lists."""
    try:
        async with connections.session.get(url.rstrip("/") + "/v1/models") as resp:
            resp.raise_for_status()
            return json.loads(await resp.read())["data"][0]["id"]
    except (aiohttp.ClientError, TimeoutError, ValueError, LookupError, TypeError) as e:
        raise SystemExit(f"cannot learn the model name from {url}/v1/models ({e}); pass --model")


Sender = Callable[[Prompt], Awaitable[RequestResult]]
T = TypeVar("T")


class ReplyLengths:
    """Each prompt's reply length as one sender produced it, to ask another sender for replies
    of the same lengths: a constrained reply ends when its JSON closes, so the free run it is
    compared with should end there too, or the two differ in output length (and so in how
    often requests arrive and prefill) as well as in the constraint."""

    def __init__(self, default: int) -> None:
        self.tokens: dict[str, int] = {}
        self.default = default  # for a prompt the recording sender never answered

    def recording(self, send: Sender) -> Sender:
        async def send_and_record(prompt: Prompt) -> RequestResult:
            result = await send(prompt)
            if result.error is None and result.output_tokens:
                self.tokens[_prompt_key(prompt)] = result.output_tokens
            return result
        return send_and_record

    def sized(self, send: Sender) -> Sender:
        async def send_sized(prompt: Prompt) -> RequestResult:
            return await send(Sized(prompt, self.tokens.get(_prompt_key(prompt), self.default)))
        return send_sized


def _prompt_key(prompt: Prompt) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


async def run_level(send: Sender, prompts: Sequence[Prompt], concurrency: int,
                    desc: str = "") -> tuple[list[RequestResult], float]:
    """Sends every prompt, at most `concurrency` at a time; returns results and the wall time."""
    return await run_jobs([partial(send, p) for p in prompts], concurrency, desc)


async def run_open_loop(send: Sender, prompts: Sequence[Prompt], rate: float,
                        max_concurrency: int | None, seed: int,
                        desc: str = "") -> tuple[list[RequestResult], float]:
    """Sends the prompts at Poisson arrival times, `rate` a second (exponential gaps, seeded),
    whether or not earlier ones have finished; at most `max_concurrency` in flight if set
    (later arrivals then wait). Returns results in order and the wall time."""
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    with tqdm(total=len(prompts), desc=desc, file=sys.stderr, leave=False,
              disable=not desc) as bar:
        async def one(prompt: Prompt) -> RequestResult:
            if limit is None:
                result = await send(prompt)
            else:
                async with limit:
                    result = await send(prompt)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(one(prompt)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return list(results), duration


async def run_jobs(jobs: Sequence[Callable[[], Awaitable[T]]], concurrency: int,
                   desc: str = "") -> tuple[list[T], float]:
    """Runs every job (a request, or a conversation of several), at most `concurrency` at a
    time and in the list's order; returns their results in that order and the wall time."""
    results: list = [None] * len(jobs)
    pending = iter(enumerate(jobs))  # shared by the workers: each takes the next job
    with tqdm(total=len(jobs), desc=desc, file=sys.stderr, leave=False,
              disable=not desc) as bar:
        async def worker() -> None:
            for i, job in pending:
                results[i] = await job()
                bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(max(1, min(concurrency, len(jobs))))))
        duration = time.perf_counter() - start
    return results, duration
