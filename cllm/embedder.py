"""Embeddings for a loaded engine: one unit-length vector per token sequence.

They run in a llama.cpp context of their own (`_core.Embedder`, made through the engine on the
first request), not in the generating one: they need every token's hidden state pooled per
input rather than a sampled token, llama.cpp switches that per context, and a separate context
leaves the engine's KV cache and prefix cache untouched. It shares the model's weights. One
request at a time is decoded, several inputs per llama_decode, with the GIL released."""
from __future__ import annotations

import threading
from array import array

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


class Embeddings:
    """The embedding context of one server, made on first use; one request at a time."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self._embedder = None
        self._lock = threading.Lock()

    def embed(self, inputs: list[list[int]]) -> list[array]:
        """Blocking: call from a worker thread."""
        with self._lock:
            if self._embedder is None:
                self._embedder = self._engine.embedder(
                    CONTEXT_TOKENS, SEQUENCES_PER_DECODE, pooling_of(self._engine.model.metadata))
            return self._embedder.embed(inputs)

    @property
    def max_tokens(self) -> int:
        return min(CONTEXT_TOKENS, self._engine.model.n_ctx_train)
