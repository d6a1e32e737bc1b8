"""Per-key quotas: sequences in flight and tokens a minute. Past either, a request is refused
at once with a 429 naming the limit and a Retry-After, never queued behind a delay the client
cannot see. Tokens (prompt and generated) count when their sequence ends, over a sliding
window of 60 seconds; a request that starts under the limit runs to its end."""
from __future__ import annotations

import math
import time
from collections import deque

from cllm.config import ApiKey
from cllm.errors import APIError

WINDOW = 60.0  # seconds of tokens_per_minute's window


class Quotas:
    def __init__(self, clock=time.monotonic) -> None:
        self.clock = clock
        self._in_flight: dict[str, int] = {}
        self._tokens: dict[str, deque[tuple[float, int]]] = {}  # (when, tokens) by key name

    def admit(self, key: ApiKey | None, sequences: int) -> None:
        """Count `sequences` in flight for `key`, or raise the 429 of the limit it passes."""
        if key is None or not key.name:
            return
        in_flight = self._in_flight.get(key.name, 0)
        if key.max_requests is not None and in_flight + sequences > key.max_requests:
            raise _limited(f"{key.max_requests} sequences in flight", 1)
        if key.tokens_per_minute is not None:
            used, free_in = self._window(key.name, key.tokens_per_minute)
            if used >= key.tokens_per_minute:
                raise _limited(f"{key.tokens_per_minute} tokens a minute", free_in)
        self._in_flight[key.name] = in_flight + sequences

    def ended(self, key: ApiKey | None, tokens: int) -> None:
        """One of `key`'s sequences ended, having computed `tokens` (prompt and generated)."""
        if key is None or not key.name:
            return
        self._in_flight[key.name] -= 1
        if not self._in_flight[key.name]:
            del self._in_flight[key.name]
        if key.tokens_per_minute is not None:
            self._tokens.setdefault(key.name, deque()).append((self.clock(), tokens))

    def _window(self, name: str, limit: int) -> tuple[int, float]:
        """Tokens counted in the last minute, and in how many seconds the window will hold
        fewer than `limit` (as entries leave it)."""
        entries = self._tokens.get(name, deque())
        now = self.clock()
        while entries and entries[0][0] <= now - WINDOW:
            entries.popleft()
        used, free_in = sum(tokens for _, tokens in entries), 0.0
        left = used
        for when, tokens in entries:
            if left < limit:
                break
            left -= tokens
            free_in = when + WINDOW - now
        return used, free_in


def _limited(limit: str, retry_after: float) -> APIError:
    return APIError(429, f"this API key's limit of {limit} is reached", type="rate_limit_error",
                    code="rate_limit_exceeded",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after)))})
