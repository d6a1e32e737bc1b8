"""Per-request state: tokens, progress through them, sampling, status, timings. No C here."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cllm.config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"    # queued, or preempted and waiting to be recomputed
    RUNNING = "running"    # holds a seq id and KV cells
    FINISHED = "finished"  # ended for a stated reason; holds nothing


# Why a sequence ended. "stop" and "length" are OpenAI's; the rest are failures.
FINISH_STOP = "stop"          # an end-of-generation token or a stop string
FINISH_LENGTH = "length"      # max_tokens, or the context is full
FINISH_ABORT = "abort"        # the client went away or asked to cancel
FINISH_TIMEOUT = "timeout"    # the request deadline passed
FINISH_ERROR = "error"        # llama.cpp failed on a batch holding this sequence
FINISH_SHUTDOWN = "shutdown"  # the server stopped before the sequence could finish
FINISH_GRAMMAR = "grammar"    # the request's grammar failed mid-reply (past the matcher's limits)


@dataclass(slots=True, eq=False)
class Sequence:
    """One generation. `num_computed_tokens` counts the tokens already in the KV cache; it catches
    up with `num_tokens` by prefill chunks and then one decode token per step. Preemption resets it
    to 0 and the sequence is recomputed from its prompt and the output it already has."""
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float
    deadline: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when first admitted
    cache_prompt: bool = True   # may start from a cached prefix (llama-server's cache_prompt)
    seq_id: int | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens whose KV is not computed yet: 1 while it decodes (the token just sampled, or a
        cached prompt's last), more while a prompt (or a preempted sequence's recompute) waits."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_ids(self, start: int, count: int) -> list[int]:
        """Tokens [start, start + count) of prompt followed by output."""
        n_prompt = len(self.prompt_token_ids)
        if start + count <= n_prompt:
            return self.prompt_token_ids[start:start + count]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:start - n_prompt + count]
        return (self.prompt_token_ids + self.output_token_ids)[start:start + count]

    def timings(self) -> dict[str, float]:
        """Seconds: queued (arrival → first scheduled), ttft (arrival → first token), total, and
        tpot (mean gap between output tokens)."""
        end = self.finished_time or time.monotonic()
        timings = {"total": end - self.arrival_time}
        if self.first_scheduled_time is not None:
            timings["queued"] = self.first_scheduled_time - self.arrival_time
        if self.first_token_time is not None:
            timings["ttft"] = self.first_token_time - self.arrival_time
            if self.num_output_tokens > 1:
                timings["tpot"] = ((self.last_token_time - self.first_token_time)
                                   / (self.num_output_tokens - 1))
        return timings
