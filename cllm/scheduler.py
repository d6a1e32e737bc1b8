"""Continuous batching: which sequences run this step and how many tokens each feeds.

Pure Python over token counts; it never calls llama.cpp. It owns every sequence's lifetime: a seq
id and KV cells are taken on admission and given back exactly once, when the sequence finishes or
is preempted; the engine learns of both from the next `SchedulerOutput`."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from cllm.sequence import (FINISH_LENGTH, FINISH_STOP, FINISH_TIMEOUT, Sequence,
                           SequenceStatus)


class QueueFullError(Exception):
    """The waiting queue is at its limit; the client should retry later."""


@dataclass(slots=True)
class ScheduledChunk:
    """`length` tokens of `seq` from position `start`; it samples when it reaches the end."""
    seq: Sequence
    start: int
    length: int
    samples: bool


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    started: list[Sequence] = field(default_factory=list)  # took a seq id this step
    released: list[int] = field(default_factory=list)      # seq ids whose KV the engine must free
    expired: list[Sequence] = field(default_factory=list)  # timed out since the last step

    @property
    def num_tokens(self) -> int:
        return sum(chunk.length for chunk in self.chunks)


class Scheduler:
    """Each step fills a token budget: running decodes first, then prefill chunks of running and
    then waiting sequences (FIFO), so a long prompt never stalls the streams already running."""

    def __init__(self, *, max_seqs: int, token_budget: int, kv_capacity: int, max_queue: int,
                 max_seq_len: int | None = None, eog_tokens: frozenset[int] = frozenset()) -> None:
        self.token_budget = token_budget
        self.kv_capacity = kv_capacity
        self.max_seq_len = max_seq_len or kv_capacity  # cells one sequence may hold
        self.max_queue = max_queue
        self.eog_tokens = eog_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.free_seq_ids: list[int] = list(range(max_seqs - 1, -1, -1))
        self.kv_used = 0  # cells holding computed tokens of running sequences
        self._step_cells = 0  # cells the step being planned will fill
        self.num_preemptions = 0
        self._released: list[int] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._released)

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting")
        if seq.num_tokens >= self.max_seq_len:
            raise ValueError(f"{seq.num_tokens} prompt tokens do not fit a context of "
                             f"{self.max_seq_len} with room for one generated token")
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: str, now: float, error: str | None = None) -> bool:
        """End `seq` and give back what it holds. False if it had already finished."""
        if seq.is_finished:
            return False
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        else:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finished_time = now
        return True

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self._step_cells = 0
        out.expired = self._expire(now)
        budget = self._schedule_running(out, self.token_budget, now)
        self._admit_waiting(out, budget, now)
        out.released = self.take_released()
        return out

    def take_released(self) -> list[int]:
        """Seq ids given back since the last call, whose KV cells the engine must clear."""
        released, self._released = self._released, []
        return released

    def postprocess(self, out: SchedulerOutput, sampled, now: float) -> list[tuple[int, int]]:
        """Account for a decoded step: `sampled[i]` is chunk i's token (-1 if it sampled none).
        Returns (chunk index, 1) for each chunk whose sequence got a token; ends sequences that
        reached an end-of-generation token, max_tokens or the context's end."""
        got = []
        for i, (chunk, token) in enumerate(zip(out.chunks, sampled)):
            seq = chunk.seq
            if seq.is_finished:  # aborted while its batch was decoding
                continue
            self._computed(seq, chunk.length)
            if token >= 0:
                self._append(seq, token, now)
                got.append((i, 1))
        return got

    def postprocess_run(self, out: SchedulerOutput, tokens, counts, n_steps: int,
                        now: float) -> list[tuple[int, int]]:
        """Account for a decode run (Context.decode_run) over decode-only chunks: chunk i fed
        and got `counts[i]` tokens, at tokens[i * n_steps:]. Returns (chunk index, number kept),
        a sequence keeping the tokens up to the one that ended it."""
        got = []
        for i, chunk in enumerate(out.chunks):
            seq = chunk.seq
            if seq.is_finished or counts[i] == 0:
                continue
            self._computed(seq, counts[i])
            kept = 0
            for token in tokens[i * n_steps:i * n_steps + counts[i]]:
                self._append(seq, token, now)
                kept += 1
                if seq.is_finished:
                    break
            got.append((i, kept))
        return got

    def decode_budget(self, seq: Sequence) -> int:
        """Tokens `seq` may still generate before max_tokens or its context's end."""
        return min(seq.sampling.max_tokens - seq.num_output_tokens,
                   self.max_seq_len - seq.num_tokens)

    def _computed(self, seq: Sequence, n_tokens: int) -> None:
        seq.num_computed_tokens += n_tokens
        self.kv_used += n_tokens

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        self._check_end(seq, token, now)

    def preempt_newest(self, now: float) -> Sequence | None:
        """Free the KV of the most recently admitted running sequence and queue it first, to be
        recomputed. Returns it, or None if nothing runs."""
        if not self.running:
            return None
        seq = self.running.pop()
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        return seq

    def _check_end(self, seq: Sequence, token: int, now: float) -> None:
        params = seq.sampling
        if token in self.eog_tokens and not params.ignore_eos:
            self.finish(seq, FINISH_STOP, now)
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_seq_len:
            self.finish(seq, FINISH_LENGTH, now)

    def _release(self, seq: Sequence) -> None:
        self.kv_used -= seq.num_computed_tokens
        self.free_seq_ids.append(seq.seq_id)
        self._released.append(seq.seq_id)
        seq.seq_id = None

    def _expire(self, now: float) -> list[Sequence]:
        expired = [s for s in (*self.running, *self.waiting)
                   if s.deadline is not None and now >= s.deadline]
        for seq in expired:
            self.finish(seq, FINISH_TIMEOUT, now, error="request deadline passed")
        return expired

    def _schedule_running(self, out: SchedulerOutput, budget: int, now: float) -> int:
        # Decodes (one token each) before prefill chunks, for every running sequence.
        decoding = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefilling = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decoding:
            if budget == 0:
                break
            # Out of cells: the newest sequence gives its cells back, possibly this one.
            while self._kv_free() < 1 and seq.status is SequenceStatus.RUNNING:
                self.preempt_newest(now)
            if seq.status is SequenceStatus.RUNNING:
                budget -= self._add_chunk(out, seq, 1)
        for seq in prefilling:
            if seq.status is SequenceStatus.RUNNING and budget > 0:
                remaining = seq.num_tokens - seq.num_computed_tokens
                budget -= self._add_chunk(out, seq, min(budget, remaining, self._kv_free()))
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, now: float) -> None:
        while self.waiting and budget > 0 and self.free_seq_ids:
            seq = self.waiting[0]
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining + 1 > self._kv_free():  # room for its whole prompt and one token
                break
            self.waiting.popleft()
            seq.seq_id = self.free_seq_ids.pop()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            self.running.append(seq)
            out.started.append(seq)
            budget -= self._add_chunk(out, seq, min(budget, remaining))

    def _add_chunk(self, out: SchedulerOutput, seq: Sequence, length: int) -> int:
        if length <= 0:
            return 0
        start = seq.num_computed_tokens
        out.chunks.append(ScheduledChunk(seq, start, length, start + length == seq.num_tokens))
        self._step_cells += length
        return length

    def _kv_free(self) -> int:
        return self.kv_capacity - self.kv_used - self._step_cells
