"""The engine: one thread runs schedule → decode-and-sample → postprocess, step after step, and
hands each step's new text to the requests' asyncio streams in one call per event loop.

It and the embedder (embedder.py) are the only modules that import cllm.llama._core: the HTTP layer
reaches llama.cpp through them. Scheduler state is touched by the engine thread alone; other
threads talk to it through the inbox."""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from array import array
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from cllm.config import EngineConfig, SamplingParams
from cllm.engine import structured
from cllm.engine.batch import RunRows, StepRows
from cllm.engine.kv_disk import DiskTier, file_fingerprint
from cllm.engine.kv_tiers import HostEntry, HostTier, default_cache_ram_mib
from cllm.engine.pending import PendingTokens
from cllm.engine.prefix_cache import pack
from cllm.engine.scheduler import SAMPLED_NOTHING, QueueFullError, Scheduler, SchedulerOutput
from cllm.engine.sequence import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_GRAMMAR,
    FINISH_SHUTDOWN,
    FINISH_STOP,
    Sequence,
)
from cllm.engine.steptimer import StepTimer
from cllm.engine.successor_wait import SuccessorWait
from cllm.engine.textstream import TextStream
from cllm.llama import _core

log = logging.getLogger(__name__)

ModelLoadError = _core.ModelLoadError


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the context for a generated token."""


class EngineStoppedError(RuntimeError):
    """The engine takes no more requests: it is shutting down, or its thread failed."""


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, log-probability), most likely first


@dataclass(slots=True)
class Delta:
    """What one step added to a request. The last one has `finish_reason` and the usage."""
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    error: str | None = None
    # The prompt's tokens and those of them that came from the prefix cache, on every delta
    # (known once the request is admitted); the final delta's also carry the generated count.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    timings: dict[str, float] | None = None


class StepTokens(NamedTuple):
    """What one step gave a request, as the engine thread hands it to the request's stream:
    one item a sequence a step, however many tokens a decode run made (the stream interval
    splits them on the stream's event loop, off the engine thread)."""
    token_ids: list[int]
    texts: list[str]  # each token's text, after the stop-string hold-back
    # Each token's logprobs: of the tokens its text reached (TextStream.take_reached), so a
    # stop string's tokens have none and held-back text keeps its tokens' logprobs with it.
    logprobs: list[list[TokenLogprob]] | None
    # At the end: reason, usage and timings; its text is the text held back till the end.
    final: Delta | None = None


class RequestStream:
    """An async iterator of Deltas for one sequence, each of at most `stream_interval` tokens
    (cllm/engine/pending.py). Leaving it early aborts the sequence."""

    def __init__(self, engine: Engine, seq: Sequence,
                 on_end: Callable[[Delta], None] | None = None,
                 stream_interval: int | None = None) -> None:
        self.seq = seq
        self._engine = engine
        self._on_end = on_end
        self._pending = PendingTokens(stream_interval, logprobs=seq.sampling.logprobs is not None)
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self._loop = asyncio.get_running_loop()
        self._done = False

    @property
    def request_id(self) -> str:
        return self.seq.request_id

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        return self._taken(await self._queue.get())

    def ready(self) -> list[Delta]:
        """The deltas already delivered after the one just taken, taken without waiting (a
        decode run delivers several at once)."""
        deltas = []
        while not self._done and not self._queue.empty():
            deltas.append(self._taken(self._queue.get_nowait()))
        return deltas

    def _taken(self, delta: Delta) -> Delta:
        self._done = delta.finish_reason is not None
        if not self._done:  # known from admission on; a stream's first event may report it
            delta.prompt_tokens = self.seq.num_prompt_tokens
            delta.cached_tokens = self.seq.num_cached_tokens
        return delta

    def abort(self) -> None:
        """Cancel the sequence; a no-op once it has finished."""
        if not self._done:
            self._engine.abort(self.seq)

    def _deliver(self, step: StepTokens) -> None:
        """On the stream's event loop: queue the deltas the step's tokens make due, and at the
        end the rest, the final one also handed to `on_end`, read or not (a client that left
        still ends its sequence, with reason 'abort')."""
        pending = self._pending
        if step.final is None:
            for group in pending.push(step.token_ids, step.texts, step.logprobs):
                self._queue.put_nowait(Delta(*group))
            return
        pending.add(step.token_ids, step.texts, step.logprobs)
        *groups, last = pending.rest(step.final.text, step.final.logprobs)
        for group in groups:
            self._queue.put_nowait(Delta(*group))
        final = step.final
        final.text, final.token_ids, final.logprobs = last
        self._queue.put_nowait(final)
        if self._on_end is not None:
            self._on_end(final)


# The model an engine runs, for the layers above it, which reach llama.cpp only through the
# engine.
Model = _core.Model

# Prompt tokens a step may compute on a CPU while several users share the server: a request
# arriving mid-step waits for the step in flight, and on a CPU a step's time is its tokens'
# (docs/design/fair-shares.md).
SHARED_PROMPT_TOKENS = 128


class Engine:
    def __init__(self, config: EngineConfig, model_path: str,
                 on_model: Callable[[Model], None] | None = None) -> None:
        """`on_model` gets the model as soon as its weights are loaded, before the context is
        made (what only reads the vocabulary can start meanwhile)."""
        self.config = config
        self.model = _core.Model(model_path, n_gpu_layers=config.n_gpu_layers)
        if on_model is not None:
            on_model(self.model)
        gpu = _core.supports_gpu_offload()
        self.kv_unified = (default_kv_unified() if config.kv_unified is None
                           else config.kv_unified)
        # Prompts in aligned blocks make CPU results independent of batches and of the prefix
        # cache; a GPU's kernels are not batch-invariant anyway, so there it would only cost.
        aligned = not (self.kv_unified or gpu)
        lanes = _lanes(config.n_parallel)
        self.ctx = _core.Context(self.model, n_ctx=_cells(config, lanes, self.kv_unified),
                                 n_seq_max=_slots(config.n_parallel, lanes, self.kv_unified),
                                 n_batch=config.n_batch, n_ubatch=config.n_ubatch,
                                 n_threads=config.n_threads, flash_attn=config.flash_attn,
                                 kv_unified=self.kv_unified, aligned_prefill=aligned,
                                 backend_sampling=(
                                     default_backend_sampling() if config.backend_sampling is None
                                     else config.backend_sampling))
        # On a GPU a decode run keeps the rows that stop in its batch, so llama.cpp reuses the
        # step's graph (docs/design/decode-runs.md); on a CPU a held row
        # would cost as much as a live one.
        self.weights_on_gpu = gpu and config.n_gpu_layers != 0
        self.ctx.hold_run_shape = self.weights_on_gpu
        # A sequence may not outgrow its share of the cache, nor what the model was trained on.
        self.max_seq_len = min(self.ctx.n_ctx_seq, self.model.n_ctx_train)
        cache_ram = default_cache_ram_mib() if config.cache_ram is None else config.cache_ram
        self.host_tier = HostTier(cache_ram * 2**20)  # evicted prefixes (kv_tiers.py)
        if config.cache_dir:
            self.host_tier.attach_disk(DiskTier(config.cache_dir, config.cache_disk * 2**20,
                                                self._cache_identity(model_path)))
        self.scheduler = Scheduler(max_seqs=config.n_parallel, token_budget=self.ctx.n_batch,
                                   kv_capacity=self.ctx.n_ctx, max_seq_len=self.max_seq_len,
                                   max_queue=config.max_queue,
                                   eog_tokens=frozenset(self.model.eog_tokens),
                                   n_slots=self.ctx.n_seq_max, shared_kv=self.kv_unified,
                                   prefix_cache=config.prefix_cache,
                                   cache_replies=config.cache_replies,
                                   cache_prompts=config.cache_prompts,
                                   prefill_block=_core.PREFILL_BLOCK if aligned else 1,
                                   prefill_stagger=config.prefill_stagger or (None if gpu else 16),
                                   first_tokens_apart=aligned, lanes=lanes,
                                   shared_prompt_tokens=None if gpu else SHARED_PROMPT_TOKENS,
                                   host_tier=self.host_tier)
        self.grammars = structured.Grammars(self.model)  # compiles for the API, any thread
        # On a GPU the CPU idles while a step decodes: fill the bitmasks then, on threads of
        # their own. On a CPU every core is llama.cpp's: one thread, before the step.
        self._masks = structured.MaskFiller(self.ctx.mask_words, overlap=gpu,
                                            threads=_mask_threads() if gpu else 1)
        self.timer = StepTimer()
        self._graphs_reused = self.ctx.graphs_reused  # the core's count when the timer last read it
        # Decode steps per call into C when only decodes run: many on a GPU, where Python's
        # share of a step is large; one on a CPU, where runs of 8 lost 9-14% at 32 streams and
        # were no sure gain at one (docs/design/decode-runs.md).
        self.decode_steps = config.decode_steps or (8 if gpu else 1)
        self._successors = SuccessorWait(default_successor_wait()
                                         if config.successor_wait is None
                                         else config.successor_wait)
        self._run_ahead = True
        self._live: dict[Sequence, _Live] = {}
        self._inbox: deque = deque()
        self._inbox_lock = threading.Lock()  # no message gets in once the engine has closed
        self._closed = False
        self._wake = threading.Event()
        self._stopping = False
        self.failure: str | None = None  # why the engine thread died, if it did
        self.tokens_generated = 0  # since start, counted as each step's tokens go out
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._run, name="cllm-engine", daemon=True)
        self._thread.start()

    # ---- called from any thread ----

    def submit(self, prompt_token_ids: list[int], sampling: SamplingParams,
               request_id: str | None = None,
               on_end: Callable[[Delta], None] | None = None,
               cache_prompt: bool = True, stream_interval: int | None = None) -> RequestStream:
        """Queue a generation; must be called from a running event loop, on which `on_end` gets
        the final delta. `cache_prompt=False` computes the whole prompt, whatever is cached.
        `stream_interval` N: each delta carries at most N tokens, the first token at once, then
        N at a time (cllm/engine/pending.py); None: each step's tokens in one delta.
        Raises PromptTooLongError (the prompt does not fit the context) and EngineStoppedError
        (shutting down, or the engine failed)."""
        if self._stopping or self.failure:
            raise EngineStoppedError(self.failure or "the engine is shutting down")
        if not prompt_token_ids:
            raise ValueError("the prompt has no tokens")
        if len(prompt_token_ids) >= self.max_seq_len:
            raise PromptTooLongError(f"the prompt has {len(prompt_token_ids)} tokens; a sequence's "
                                     f"context holds {self.max_seq_len}")
        now = time.monotonic()
        seq = Sequence(request_id or f"req-{next(self._ids)}", list(prompt_token_ids), sampling,
                       arrival_time=now, deadline=now + self.config.request_timeout,
                       cache_prompt=cache_prompt)
        stream = RequestStream(self, seq, on_end, stream_interval)
        self._post(("add", stream))
        return stream

    def abort(self, seq: Sequence) -> None:
        try:
            self._post(("abort", seq))
        except EngineStoppedError:  # every sequence has ended already
            pass

    def embedder(self, n_ctx: int, n_seq_max: int, pooling: str) -> _core.Embedder:
        """A context of its own over this engine's model, for embeddings
        (cllm/protocols/embeddings.py): it shares the weights, not the KV cache, and runs beside
        the engine thread."""
        return _core.Embedder(self.model, n_ctx=min(n_ctx, self.model.n_ctx_train),
                              n_seq_max=n_seq_max, n_threads=self.config.n_threads,
                              pooling=pooling)

    def shutdown(self) -> None:
        """Finish every sequence with reason 'shutdown' and stop the engine thread."""
        self._stopping = True
        self._wake.set()
        self._thread.join()
        if self.host_tier.disk is not None and not self.failure:
            self.host_tier.persist(self._pool_prefixes())

    def _cache_identity(self, model_path: str) -> dict:
        """What the disk tier's files are bound to: a file another model, KV layout or build of
        the core (llama.cpp's state format) wrote is never loaded."""
        return {"model": file_fingerprint(model_path), "core": file_fingerprint(_core.__file__),
                "kv_type": "f16", "kv_unified": self.kv_unified,
                "cells_per_sequence": self.ctx.n_ctx_seq}

    def _pool_prefixes(self):
        """The idle slots' prefixes as host-tier entries, each copied as it is asked for."""
        for slot in self.scheduler.cache.idle_slots():
            if slot.cached >= HostTier.MIN_TOKENS:
                tokens = slot.tokens[:slot.cached]
                yield HostEntry(tokens, pack(tokens), min(slot.prompt_length, slot.cached),
                                data=self.ctx.save_sequence(slot.id))

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self._inbox_adds()

    @property
    def kv_usage(self) -> float:
        """Share of the KV cells that running sequences hold (cached prefixes are evictable,
        so they count as free here; `cached_cells` counts them)."""
        return (self.scheduler.kv_used - self.cached_cells) / self.scheduler.kv_capacity

    @property
    def cached_cells(self) -> int:
        """KV cells that hold cached prefixes no running sequence uses."""
        return self.scheduler.cache.cached_cells

    def _inbox_adds(self) -> int:
        return sum(1 for m in list(self._inbox) if m[0] == "add")

    def _post(self, message) -> None:
        with self._inbox_lock:
            if self._closed:
                raise EngineStoppedError(self.failure or "the engine is shutting down")
            self._inbox.append(message)
        self._wake.set()
        self.ctx.interrupt()  # a decode run in C makes way at its next step

    # ---- the engine thread ----

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                self.ctx.clear_interrupt()  # what is posted from here on interrupts a run
                self.timer.start()
                self._drain_inbox()
                if self.scheduler.has_work:
                    self.timer.lap("inbox")
                    self._step()
                else:
                    self._wake.wait()
        except BaseException as exc:  # a bug here must not leave requests hanging forever
            log.exception("engine loop failed")
            self.failure = f"the engine failed: {type(exc).__name__}: {exc}"
        with self._inbox_lock:
            self._closed = True
        self._masks.close()
        if self.failure:
            self._fail_all(self.failure)
        else:
            self._drain_inbox()
            self._finish_all(FINISH_SHUTDOWN, "the server is shutting down")

    def _drain_inbox(self) -> None:
        looked = time.monotonic()  # what was posted before this is taken now
        with _Outbox() as outbox:
            while self._inbox:
                kind, item = self._inbox.popleft()
                if kind == "add":
                    self._admit(item, outbox)
                elif item in self._live:
                    self._end(item, FINISH_ABORT, None, outbox)
            self._free_released()
        self._successors.settle(looked)

    def _admit(self, stream: RequestStream, outbox: _Outbox) -> None:
        seq = stream.seq
        self._successors.arrived(seq.arrival_time)
        try:
            self.scheduler.add(seq)
        except (QueueFullError, ValueError) as exc:
            seq.finish_reason = "queue_full" if isinstance(exc, QueueFullError) else FINISH_ERROR
            outbox.add(stream, _ending(Delta("", [], finish_reason=seq.finish_reason,
                                             error=str(exc))))
            return
        grammar = seq.sampling.grammar
        logprobs = seq.sampling.logprobs is not None
        self._live[seq] = _Live(stream, TextStream(seq.sampling.stop, count_tokens=logprobs),
                                logprobs=[] if logprobs else None,
                                matcher=grammar.matcher() if grammar is not None else None)

    def _step(self) -> None:
        with _Outbox() as outbox:
            self._step_into(outbox)

    def _step_into(self, outbox: _Outbox) -> None:
        """One step of the loop: plan, decode, account; what it gives each request goes into
        `outbox`."""
        timer = self.timer
        now = started = time.monotonic()
        live = len(self._live)
        out = self.scheduler.schedule(now)
        for seq in out.expired:
            self._send_final(seq, outbox)
        timer.lap("schedule")
        self._prepare_sequences(out)
        if not out.chunks:
            return
        n_steps = self._run_length(out)
        self._apply_kv_ops(self.scheduler.take_kv_ops())  # evictions that make room for a run
        if n_steps > 1:
            rows = RunRows.build(out, self.scheduler)
            timer.lap("prepare")
            result = self._decode_run(out, rows, n_steps)
            timer.add_run(self.ctx.run_timing(), timer.lap("decode"))
            now = time.monotonic()  # the tokens exist from here on: TTFT and ITL count to it
            got, forward_steps = [], 0
            if result is not None:
                tokens, counts, grammar_ends = result
                forward_steps = max(counts)
                got = self.scheduler.postprocess_run(out, tokens, counts, n_steps, now)
                for r, (reason, error) in grammar_ends.items():
                    self.scheduler.finish(out.chunks[r].seq, reason, now, error)
            self._run_ahead = bool(got)  # a run that made no token (KV full) is not retried
        else:
            rows = StepRows.build(out)
            timer.lap("prepare")
            result = self._decode(out, rows, outbox)
            timer.lap("decode")
            now = time.monotonic()
            got = self._account_step(out, rows, result, now) if result is not None else []
            self._advance_matchers(out, got, now)
            self._run_ahead = True
            forward_steps = 1
        self._report_grammar_failures(out)
        self._emit(out, got, now, outbox)
        self._send_unheard_ends(out, outbox)
        self._free_released()  # before the clients hear that their sequences ended
        timer.lap("postprocess")
        outbox.deliver()
        timer.lap("handoff")
        self._await_successors(started, live - len(self._live))
        timer.lap("successors")
        timer.end(len(out.chunks), forward_steps, self._graphs_reused_since())

    def _await_successors(self, started: float, ended: int) -> None:
        """After a step that ended requests, wait until as many new ones have arrived, or the
        SuccessorWait's bound has passed, so that a client's next request starts in the next
        step rather than the one after (cllm/engine/successor_wait.py)."""
        now = time.monotonic()
        self._successors.step_done(now - started, ended, now)
        seconds = self._successors.seconds(ended)
        # A request waiting for a slot takes the freed one; with nothing running, the thread
        # waits for the inbox anyway.
        if not seconds or self.scheduler.waiting or not self.scheduler.running:
            return
        deadline = now + seconds
        while not self._stopping:
            self._wake.clear()  # before the look: a request posted after it sets it again
            left = deadline - time.monotonic()
            if self._inbox_adds() >= ended or left <= 0:
                return
            self._wake.wait(left)

    def _graphs_reused_since(self) -> int:
        """The steps llama.cpp ran on the graph of the step before since the last call."""
        total = self.ctx.graphs_reused
        new, self._graphs_reused = total - self._graphs_reused, total
        return new

    def _run_length(self, out: SchedulerOutput) -> int:
        """How many decode steps to run in C at once: several only while nobody waits for a
        free slot (one who waits for a slot to free runs with the others: the run ends at the
        step where a row stops, _decode_run), no running sequence still waits for its first
        token (a prompt the step left out, or one the cache holds but its last token, which
        looks like a decode: either would wait for the whole run), every chunk is a decode, and
        no one asked for logprobs (each new request interrupts a run). Constrained rows run
        too: their matchers advance between the run's steps (structured.RunMatchers)."""
        steps = self.decode_steps
        scheduler = self.scheduler
        if (steps <= 1 or not self._run_ahead or self._inbox or scheduler.prompts_pending
                or (scheduler.waiting and not scheduler.slots_full)):
            return 1
        for chunk in out.chunks:
            p = chunk.seq.sampling
            if chunk.length != 1 or not chunk.samples or p.logprobs is not None:
                return 1
        return self.scheduler.room_for_run(len(out.chunks), steps)  # the pool holds every row's run

    def _free_released(self) -> None:
        # Samplers first, as _prepare_sequences does: a "clear" op frees its slot's sampler,
        # which a sequence preempted with nothing cached still has to take with it.
        self._settle_released(self.scheduler.take_released())
        self._apply_kv_ops(self.scheduler.take_kv_ops())

    def _settle_released(self, released) -> None:
        """Samplers of sequences that left their slots: an ended one's goes, a preempted one's
        is kept, so that its random stream goes on where it stopped when it resumes."""
        for slot, seq in released:
            live = self._live.get(seq)
            if live is not None and not seq.is_finished:
                live.sampler = self.ctx.park_sampler(slot)
            else:
                self.ctx.end_sequence(slot)

    def _apply_kv_ops(self, ops) -> None:
        for op in ops:
            if op.kind == "clear":
                self.ctx.remove_sequence(op.dst)
            elif op.kind == "share":
                self.ctx.share_prefix(op.dst, op.src, op.length)
            else:
                self._copy_kv(op)

    def _copy_kv(self, op) -> None:
        """A save to the host tier or a load from it: a copy of a slot's cells on this thread,
        between steps (llama.cpp's context takes one caller at a time), timed apart in the step
        timer as "kv_tiers"."""
        started = time.perf_counter()
        if op.kind == "save":
            data = self.ctx.save_sequence(op.dst)
            self.host_tier.store(op.entry, data, time.perf_counter() - started)
        else:
            self.ctx.load_sequence(op.dst, op.entry.data)
            self.ctx.share_prefix(op.dst, op.dst, op.length)
            self.host_tier.restored(op.length, time.perf_counter() - started)
        self.timer.aside("kv_tiers", time.perf_counter() - started)

    def _prepare_sequences(self, out: SchedulerOutput) -> None:
        self._settle_released(out.released)  # timed out or preempted while planning this step
        self._apply_kv_ops(out.kv_ops)  # cache evictions and the started sequences' prefixes
        for seq in out.started:
            live = self._live[seq]
            if live.sampler is not None:  # resuming after preemption
                self.ctx.restore_sampler(seq.seq_id, live.sampler)
                live.sampler = None
                continue
            p = seq.sampling
            self.ctx.set_sampler(
                seq.seq_id, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                min_p=p.min_p, repeat_penalty=p.repeat_penalty,
                presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                seed=p.seed, history=seq.prompt_token_ids + seq.output_token_ids,
                ban_eog=p.ignore_eos, host_logits=p.logprobs is not None)

    def _decode(self, out: SchedulerOutput, rows: StepRows, outbox: _Outbox):
        try:
            return self._step_with_masks(out, rows)
        except _core.KVCacheFullError:
            # Nothing was written: give the cells of the lowest-priority sequence (the newest
            # among equals) back and plan again.
            victim = self.scheduler.preempt(time.monotonic())
            log.info("KV cache full: preempted %s", victim.request_id if victim else None)
        except _core.DecodeError as exc:
            self._rewind(out)
            if len(out.chunks) == 1:
                self._fail(out, exc, outbox)
            else:
                self._step_each_alone(out, exc, outbox)
        return None

    def _step_with_masks(self, out: SchedulerOutput, rows: StepRows):
        mask_rows, masks = self._step_masks(out)
        try:
            return self.ctx.step(rows.seq_ids, rows.positions, rows.n_tokens, rows.sample,
                                 rows.tokens, rows.top_logprobs, mask_rows,
                                 masks.data if masks else None, masks.ready if masks else None)
        finally:
            if masks is not None:
                masks.wait()  # the buffer is the next step's

    def _step_each_alone(self, out: SchedulerOutput, exc: Exception, outbox: _Outbox) -> None:
        """After a batch failed, decode its rows one by one, so that only the rows that fail on
        their own (say, a prefill the GPU has no memory for) end with the error. Rare: a row
        that sampled before its batch failed has advanced its sampler's random stream."""
        log.warning("llama_decode failed for %d sequences (%s): decoding each alone",
                    len(out.chunks), exc)
        for chunk in out.chunks:
            if chunk.seq not in self._live or chunk.seq.seq_id is None:  # ended or preempted
                continue
            single = SchedulerOutput(chunks=[chunk])
            rows = StepRows.build(single)
            result = self._decode(single, rows, outbox)
            if result is not None:
                now = time.monotonic()
                got = self._account_step(single, rows, result, now)
                self._advance_matchers(single, got, now)
                self._report_grammar_failures(single)
                self._emit(single, got, now, outbox)

    def _rewind(self, out: SchedulerOutput) -> None:
        """Drop whatever a failed batch wrote (llama.cpp rolls back only its last micro-batch,
        and a step may make several llama_decode calls), so each sequence's KV ends where the
        scheduler's count of computed tokens does."""
        for chunk in out.chunks:
            if chunk.seq.seq_id is not None:
                self.ctx.share_prefix(chunk.seq.seq_id, chunk.seq.seq_id, chunk.start)

    def _decode_run(self, out: SchedulerOutput, rows: RunRows, n_steps: int):
        """(tokens, counts, {chunk index: (finish reason, error)} of the rows whose grammar
        ended them), or None when the run made nothing."""
        mask_rows, matchers = self._constrained_rows(out)
        constrained = (structured.RunMatchers(self._masks, mask_rows, matchers) if matchers
                       else None)
        masks = constrained.masks if constrained else None
        try:
            tokens, counts = self.ctx.decode_run(
                rows.seq_ids, rows.positions, rows.last_tokens, rows.budgets, n_steps,
                mask_rows, masks.data if masks else None, masks.ready if masks else None,
                constrained.after_step if constrained else None,
                end_at_stop=bool(self.scheduler.waiting))  # a stop frees a slot for them
            return tokens, counts, constrained.ends if constrained else {}
        except _core.DecodeError as exc:
            # Nobody fails here: the next step decodes one token each (a run that made no token
            # is not retried), where _decode pins a failure on the rows that cause it.
            log.warning("decode run failed for %d sequences: %s", len(out.chunks), exc)
        finally:
            if constrained is not None:
                constrained.masks.wait()  # the buffer is the next step's
        return None

    def _step_masks(self, out: SchedulerOutput):
        """(mask_rows, Masks) for Context.step: the allowed tokens of each constrained row that
        samples this step, into one buffer; (None, None) when no row is constrained."""
        mask_rows, matchers = self._constrained_rows(out)
        return (mask_rows, self._masks.fill(matchers)) if matchers else (None, None)

    def _constrained_rows(self, out: SchedulerOutput):
        """(mask_rows, matchers): row r samples with bitmask mask_rows[r] (-1: none), that of
        matchers[mask_rows[r]]; (None, []) when no row that samples is constrained."""
        matchers = []
        mask_rows = None
        for r, chunk in enumerate(out.chunks):
            matcher = self._live[chunk.seq].matcher
            if matcher is not None and chunk.samples:
                if mask_rows is None:
                    mask_rows = array("i", [-1]) * len(out.chunks)
                mask_rows[r] = len(matchers)
                matchers.append(matcher)
        return mask_rows, matchers

    def _advance_matchers(self, out: SchedulerOutput, got, now: float) -> None:
        """Feed each constrained sequence's new token to its matcher; the sequence ends (stop)
        when its grammar is complete, so the output always matches unless it ran out of
        tokens."""
        # in turn: llguidance's consume_token_par was slower (docs/design/grammar.md)
        for i, _ in got:
            seq = out.chunks[i].seq
            matcher = self._live[seq].matcher
            if matcher is None or seq.is_finished:  # an end token or max_tokens ended it
                continue
            end = structured.grammar_end(matcher, seq.output_token_ids[-1])
            if end is not None:
                self.scheduler.finish(seq, end[0], now, end[1])

    def _report_grammar_failures(self, out: SchedulerOutput) -> None:
        """A sequence that ended this step while its matcher had failed ended on the only token
        the failed matcher let through (an end token), on one it refused, or with no token
        (none let through, end tokens banned): its reply is cut short, so it ends with the
        grammar's error, never as a complete "stop"."""
        for chunk in out.chunks:
            seq = chunk.seq
            if not seq.is_finished or (seq.finish_reason == FINISH_ERROR
                                       and seq.error != SAMPLED_NOTHING):
                continue  # most rows, every step: the cheap test first
            live = self._live.get(seq)
            if live is None or live.matcher is None:
                continue
            error = structured.matcher_failure(live.matcher)
            if error is not None:
                self.scheduler.restate_end(seq, FINISH_GRAMMAR, error)

    def _fail(self, out: SchedulerOutput, exc: Exception, outbox: _Outbox) -> None:
        log.error("llama_decode failed for %d sequences: %s", len(out.chunks), exc)
        for chunk in out.chunks:
            if chunk.seq in self._live:
                self._end(chunk.seq, FINISH_ERROR, str(exc), outbox)

    def _account_step(self, out: SchedulerOutput, rows: StepRows, result, now: float):
        sampled, logprobs = result if rows.top_logprobs is not None else (result, None)
        got = self.scheduler.postprocess(out, sampled, now)
        if logprobs is not None:
            for i, _ in got:
                seq = out.chunks[i].seq
                if seq.sampling.logprobs is not None:
                    chosen, top = logprobs.row(i)
                    self._live[seq].logprobs.append(
                        TokenLogprob(seq.output_token_ids[-1], chosen, top))
        return got

    def _emit(self, out: SchedulerOutput, got, now: float, outbox: _Outbox) -> None:
        """The tokens each sequence got and their text (held back at a stop string), one item
        a sequence for its stream."""
        for i, kept in got:
            seq = out.chunks[i].seq
            live = self._live[seq]
            new_tokens = seq.output_token_ids[-kept:]
            texts, reached = self._texts_of(live.text, new_tokens, live.logprobs is not None)
            if len(texts) < len(new_tokens):  # a stop string ended it inside a decode run
                self.scheduler.drop_last_tokens(seq, len(new_tokens) - len(texts))
                new_tokens = new_tokens[:len(texts)]
            self.tokens_generated += len(new_tokens)
            step = StepTokens(new_tokens, texts,
                              reached and [live.take_logprobs(n) for n in reached])
            if live.text.stopped and not self.scheduler.finish(seq, FINISH_STOP, now):
                # a decode run went past the stop string to max_tokens or an end token, which
                # ended it first: it ended at the stop string
                self.scheduler.restate_end(seq, FINISH_STOP)
            if seq.is_finished:
                self._send_final(seq, outbox, step)
            else:
                outbox.add(live.stream, step)

    def _send_unheard_ends(self, out: SchedulerOutput, outbox: _Outbox) -> None:
        """The end of each sequence the step ended without a token for it to carry (one that
        was to sample and got none): _emit sends only the ends that come with tokens."""
        for chunk in out.chunks:
            if chunk.seq.is_finished and chunk.seq in self._live:
                self._send_final(chunk.seq, outbox)

    def _texts_of(self, text: TextStream, tokens: list[int],
                  count_reached: bool) -> tuple[list[str], list[int] | None]:
        """The text each of `tokens` adds, up to the one that completes a stop string, if one
        does: the tokens after it do not count. And if `count_reached`, how many tokens' text
        each token's text reached."""
        texts, reached = [], [] if count_reached else None
        for token in tokens:
            texts.append(text.feed(self.model.token_to_piece(token)))
            if count_reached:
                reached.append(text.take_reached())
            if text.stopped:
                break
        return texts, reached

    def _end(self, seq: Sequence, reason: str, error: str | None, outbox: _Outbox) -> None:
        self.scheduler.finish(seq, reason, time.monotonic(), error)
        self._send_final(seq, outbox)

    def _send_final(self, seq: Sequence, outbox: _Outbox, step: StepTokens | None = None) -> None:
        """The sequence's end, with its last step's tokens (if any) and the text held back."""
        live = self._live.pop(seq)
        final = Delta(live.text.flush(), [], finish_reason=seq.finish_reason, error=seq.error,
                      prompt_tokens=seq.num_prompt_tokens, cached_tokens=seq.num_cached_tokens,
                      completion_tokens=seq.num_output_tokens, timings=seq.timings())
        if live.logprobs is not None:  # those of the text held back till now; at a stop, none
            final.logprobs = live.take_logprobs(live.text.take_reached())
        outbox.add(live.stream, _ending(final) if step is None else step._replace(final=final))

    def _fail_all(self, error: str) -> None:
        """After a failure, the scheduler's state cannot be trusted: every request, running or
        still in the inbox, just hears how it ended."""
        outbox = _Outbox()
        streams = [live.stream for live in self._live.values()]
        streams += [item for kind, item in self._inbox if kind == "add"]
        self._inbox.clear()
        self._live.clear()
        for stream in streams:
            stream.seq.finish_reason, stream.seq.error = FINISH_ERROR, error
            outbox.add(stream, _ending(Delta("", [], finish_reason=FINISH_ERROR, error=error,
                                             prompt_tokens=stream.seq.num_prompt_tokens)))
        outbox.deliver()

    def _finish_all(self, reason: str, error: str) -> None:
        outbox = _Outbox()
        for seq in list(self._live):
            self._end(seq, reason, error, outbox)
        self._free_released()
        outbox.deliver()


def default_kv_unified() -> bool:
    """The KV layout when none is asked for: one pool on a GPU, split streams on a CPU
    (docs/design/kv-layout.md has the measurements)."""
    return _core.supports_gpu_offload()


def default_backend_sampling() -> bool:
    """Whether greedy rows are sampled inside the graph when none is asked: on a GPU, where
    the logits would otherwise travel to the host. docs/design/sampling.md has the measurements."""
    return _core.supports_gpu_offload()


def default_successor_wait() -> float:
    """The longest wait for a finished request's successor, as a share of a step's time, when
    none is asked: half a step on a CPU; none on a GPU, where a step takes a few milliseconds,
    less than a successor needs to come over HTTP (docs/design/cpu-waits.md)."""
    return 0.0 if _core.supports_gpu_offload() else 0.5


def _mask_threads() -> int:
    """llguidance's threads for a GPU step's bitmasks, which the host fills while the GPU
    decodes: half the cores, at most 8."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _lanes(n_parallel: int) -> int:
    """Sequences that may run beyond n_parallel for a user holding none while another holds
    two or more (Scheduler's `lanes`): one, where a user can hold two and llama.cpp's 256
    sequences leave room."""
    return 1 if 2 <= n_parallel < 256 else 0


def _slots(n_parallel: int, lanes: int, kv_unified: bool) -> int:
    """Seq ids to create. In one pool, twice the running sequences (up to llama.cpp's 256), so
    finished sequences' prefixes stay cached while every running slot is taken; split, each id
    is a stream with its own share of the cells, and idle streams are the cache."""
    if kv_unified:
        return min(256, max(2 * n_parallel, n_parallel + lanes + 8))
    return n_parallel + lanes


def _cells(config: EngineConfig, lanes: int, kv_unified: bool) -> int:
    """KV cells to create: n_ctx, and split, a stream's share more for each lane, so that every
    stream holds n_ctx / n_parallel cells."""
    return config.n_ctx + (0 if kv_unified else lanes * (config.n_ctx // config.n_parallel))


@dataclass(slots=True)
class _Live:
    """Engine-thread state of one admitted request."""
    stream: RequestStream
    text: TextStream
    # When the request asked for them: those of the tokens whose text was not emitted yet.
    logprobs: list[TokenLogprob] | None
    sampler: object | None = None  # its parked sampler while it is preempted
    # Its grammar's state (llguidance.LLMatcher), at the tokens generated so far; it lives here,
    # not in the core, so preemption leaves it as it is.
    matcher: object | None = None

    def take_logprobs(self, count: int) -> list[TokenLogprob]:
        """The logprobs of the next `count` tokens, which the emitted text has reached."""
        taken = self.logprobs[:count]
        del self.logprobs[:count]
        return taken


def _ending(final: Delta) -> StepTokens:
    """The end of a request, with no token of its last step (refused, aborted, timed out, or
    the engine failed)."""
    return StepTokens([], [], None, final)


class _Outbox:
    """What one step gave each request, handed to each event loop in one call."""
    __slots__ = ("_by_loop",)

    def __init__(self) -> None:
        self._by_loop: dict = defaultdict(list)

    def add(self, stream: RequestStream, step: StepTokens) -> None:
        self._by_loop[stream._loop].append((stream, step))

    def __enter__(self) -> "_Outbox":
        return self

    def __exit__(self, *exc_info) -> None:
        # Also when the step failed: the requests it ended have left _live, where the engine's
        # failure handling (_fail_all) looks, so their ends must go out here.
        self.deliver()

    def deliver(self) -> None:
        for loop, items in self._by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop has closed: nobody is listening
                pass
        self._by_loop.clear()


def _put_all(items) -> None:
    for stream, step in items:
        stream._deliver(step)
