"""Embeddings for a loaded engine: one unit-length vector per token sequence.

They run in a llama.cpp context of their own (`_core.Embedder`, made through the engine on the
first request), not in the generating one: they need every token's hidden state pooled per
input rather than a sampled token, llama.cpp switches that per context, and a separate context
leaves the engine's KV cache and prefix cache untouched. It shares the model's weights. One
decode at a time, several inputs per llama_decode, with the GIL released; requests take turns
decode by decode, so a small request is not held behind a large one, and a request told to stop
(its client left, the server is stopping) stops at once, its decode in progress aborted."""
from __future__ import annotations

import threading
from array import array
from collections import deque

from cllm.llama._core import DecodeAborted

CONTEXT_TOKENS = 2048  # tokens per input at most (the embedding context's size)
SEQUENCES_PER_DECODE = 16
# GGUF's {arch}.pooling_type values that pool a sequence into one vector. NONE (0) and RANK (4,
# rerankers) do not give one: those models get mean pooling.
_POOLING = {1: "mean", 2: "cls", 3: "last"}


def pooling_of(metadata: dict[str, str]) -> str:
    """The pooling the GGUF asks for, mean when it asks for none (generative models)."""
    arch = metadata.get("general.architecture", "")
    value = metadata.get(f"{arch}.pooling_type", "")
    return _POOLING.get(int(value), "mean") if value.isdigit() else "mean"


class Stopped(Exception):
    """An embedding request was stopped: before its next decode, or in one (aborted)."""


class Turns:
    """The embedding context, lent in the order it was asked for. A lock would mostly go back to
    the thread that just released it, so a long request's decodes would shut others out."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._queue: deque[object] = deque()

    def wait(self) -> object:
        """Blocks until it is the caller's turn; returns the ticket to give back to done()."""
        ticket = object()
        with self._changed:
            self._queue.append(ticket)
            self._changed.wait_for(lambda: self._queue[0] is ticket)
        return ticket

    def done(self, ticket: object) -> None:
        with self._changed:
            self._queue.remove(ticket)
            self._changed.notify_all()


class Embeddings:
    """The embedding context of one server, made on first use; requests take turns decode by
    decode. Each request brings a threading.Event; stop() with it ends the request now if its
    decode is running, else before its next."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._embedder = None
        self._turns = Turns()
        self._closed = False
        self._decoding: threading.Event | None = None  # the stop of the request decoding now
        self.running = 0  # requests computing or waiting for their turn (/metrics)
        # Guards both; a stop aborts a decode only while it is its request's.
        self._lock = threading.Lock()

    def stop(self, stop: threading.Event) -> None:
        """Stop the request that brought `stop` (its client left); any thread."""
        with self._lock:
            stop.set()
            if self._decoding is stop:
                # Before its decode began this stops nothing, and the decode runs; the request
                # stops before its next one.
                self._embedder.abort()

    def close(self) -> None:
        """Stop every request, the decoding one at once: the server is stopping."""
        self._closed = True
        if self._embedder is not None:
            self._embedder.abort()

    def embed(self, inputs: list[list[int]], stop: threading.Event) -> list[array]:
        """Blocking: call from a worker thread. Raises Stopped once stopped or closed."""
        ticket = None

        def next_decode() -> None:  # the others' turns come between this request's decodes
            nonlocal ticket
            self._decode_of(None)
            self._turns.done(ticket)
            ticket = None
            ticket = self._turns.wait()
            self._decode_of(stop)
            if stop.is_set() or self._closed:
                raise Stopped

        self._count(1)
        try:
            ticket = self._turns.wait()
            if self._embedder is None:
                self._embedder = self._engine.embedder(
                    CONTEXT_TOKENS, SEQUENCES_PER_DECODE, pooling_of(self._engine.model.metadata))
            return self._embedder.embed(inputs, next_decode)
        except DecodeAborted:
            raise Stopped from None
        finally:
            self._decode_of(None)
            if ticket is not None:
                self._turns.done(ticket)
            self._count(-1)

    def _decode_of(self, stop: threading.Event | None) -> None:
        with self._lock:
            self._decoding = stop

    def _count(self, change: int) -> None:
        with self._lock:
            self.running += change

    @property
    def max_tokens(self) -> int:
        return min(CONTEXT_TOKENS, self._engine.model.n_ctx_train)
