"""Serving one HTTP request's n engine streams: merged, collected or streamed as SSE, with every
failure turned into a stated error and every stream aborted if the client goes away."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from cllm.engine.engine import Delta, RequestStream
from cllm.engine.sequence import (
    FINISH_ERROR,
    FINISH_GRAMMAR,
    FINISH_LENGTH,
    FINISH_SHUTDOWN,
    FINISH_STOP,
    FINISH_TIMEOUT,
)
from cllm.errors import APIError
from cllm.http.formats import Choice, Format

# Reasons a sequence ends without a usable result, as HTTP errors.
_FAILURES = {
    "queue_full": (429, "rate_limit_exceeded", "server_overloaded", {"Retry-After": "1"}),
    FINISH_TIMEOUT: (408, "timeout", "request_timeout", {}),
    FINISH_SHUTDOWN: (503, "server_error", "shutting_down", {}),
    FINISH_ERROR: (500, "server_error", "decode_failed", {}),
    # The request's own grammar went past the matcher's limits: the client's to change.
    FINISH_GRAMMAR: (400, "invalid_request_error", "grammar_failed", {}),
}


class SequenceFailure(APIError):
    """The error a sequence ended with. Its stream's `on_end` has counted it by the time it is
    raised: the route must not count it again."""


def failure(delta: Delta) -> SequenceFailure | None:
    """The error a final delta stands for, or None if it ended normally."""
    if delta.finish_reason in (FINISH_STOP, FINISH_LENGTH, None):
        return None
    return ended(delta.finish_reason, delta.error, SequenceFailure)


def ended(reason: str, message: str | None = None, error: type[APIError] = APIError) -> APIError:
    """The error of a request that ended for `reason` (a finish reason: timeout, shutdown, ...)
    without a usable result; requests served outside the engine (embeddings) end with it too."""
    status, type_, code, headers = _FAILURES.get(reason, (500, "server_error", reason, {}))
    return error(status, message or f"the request ended: {reason}", type=type_, code=code,
                 headers=headers)


async def merge(streams: list[RequestStream]) -> AsyncIterator[list[tuple[int, Delta]]]:
    """(choice index, delta) from all streams, in batches: each holds what had arrived when it
    was taken (a decode run delivers several deltas of a stream at once), so a streamed
    response writes them together. Aborts the rest when left early."""
    if len(streams) == 1:  # the common case: no pump task, no second queue on the way
        stream = streams[0]
        try:
            async for delta in stream:
                yield [(0, delta)] + [(0, later) for later in stream.ready()]
        finally:
            stream.abort()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        async for delta in stream:
            queue.put_nowait((index, delta))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(streams)
    try:
        while remaining:
            batch = [await queue.get()]
            while not queue.empty():
                batch.append(queue.get_nowait())
            remaining -= sum(delta.finish_reason is not None for _, delta in batch)
            yield batch
    finally:
        for stream in streams:
            stream.abort()
        for task in tasks:
            task.cancel()


class Generation:
    """n streams answering one request. Each stream reports its own end (metrics, logs)."""

    def __init__(self, streams: list[RequestStream], fmt: Format) -> None:
        self.streams = streams
        self.fmt = fmt
        self._merged = merge(streams)
        self._first: list[tuple[int, Delta]] | None = None

    async def first_event(self) -> None:
        """Wait for the first delta, so an early failure (queue full, timeout) can still be
        answered with its own status instead of a 200 stream."""
        self._first = await anext(self._merged)
        error = failure(self._first[0][1])
        if error is not None:
            await self.close()
            raise error

    async def collect(self) -> dict:
        choices = [Choice() for _ in self.streams]
        try:
            async for batch in self._batches():
                for index, delta in batch:
                    choices[index].add(delta)
                    error = failure(delta)
                    if error is not None:
                        raise error
        finally:
            await self.close()
        return self.fmt.response(choices)

    async def sse(self, include_usage: bool) -> AsyncIterator[bytes]:
        """The SSE body: chunks as they come, a usage chunk if asked, then the format's end
        ([DONE] in OpenAI's APIs). The events of deltas that arrived together go in one write:
        one event a token would otherwise cost a write each."""
        choices = [Choice() for _ in self.streams]
        started: set[int] = set()
        try:
            async for batch in self._batches():
                events, failed = self._sse_events(batch, choices, started)
                if events:
                    yield events
                if failed:
                    break
            else:
                usage_chunk = (self.fmt.usage_chunk(self.fmt.usage(choices)) if include_usage
                               else None)
                if usage_chunk is not None:
                    yield self.fmt.event(usage_chunk)
            done = self.fmt.done_event()
            if done is not None:
                yield done
        finally:
            await self.close()

    def _sse_events(self, batch: list[tuple[int, Delta]], choices: list[Choice],
                    started: set[int]) -> tuple[bytes, bool]:
        """One batch's events, and whether it ended the response with an error event."""
        events = []
        for index, delta in batch:
            choices[index].add(delta)
            error = failure(delta)
            if error is not None:
                events.append(self.fmt.event(self.fmt.error_body(error)))
                return b"".join(events), True
            events += map(self.fmt.event, self.fmt.chunks(index, delta, index not in started))
            started.add(index)
        return b"".join(events), False

    async def close(self) -> None:
        """Abort the sequences still running (the client left, or a sibling failed)."""
        await self._merged.aclose()

    async def _batches(self) -> AsyncIterator[list[tuple[int, Delta]]]:
        if self._first is not None:
            first, self._first = self._first, None
            yield first
        async for batch in self._merged:
            yield batch
