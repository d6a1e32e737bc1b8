"""Continuous batching: which sequences run this step and how many tokens each feeds.

Pure Python over token counts; it never calls llama.cpp. It owns every sequence's lifetime: a slot
(seq id) and KV cells are taken on admission and given back exactly once, when the sequence
finishes or is preempted. A given-back slot keeps its KV as a cached prefix (prefix_cache.py)
that later sequences start from. The engine learns of every change to llama.cpp's KV as `KvOp`s,
in order, from `take_kv_ops()` (a step's own are in its `SchedulerOutput`)."""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from cllm.engine.fair_share import FairShare
from cllm.engine.prefix_cache import KvOp, Placement, PrefixCache, Slot, common_packed_prefix, pack
from cllm.engine.sequence import (
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TIMEOUT,
    Sequence,
    SequenceStatus,
)

SAMPLED_NOTHING = "the step sampled no token"  # the error of a row that got no token


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
    released: list[tuple[int, Sequence]] = field(default_factory=list)  # (slot, sequence) that
    # left it: ended, or preempted (then its sampler moves with it)
    kv_ops: list[KvOp] = field(default_factory=list)       # KV changes to make before decoding
    expired: list[Sequence] = field(default_factory=list)  # timed out since the last step

    @property
    def num_tokens(self) -> int:
        return sum(chunk.length for chunk in self.chunks)


class Scheduler:
    """Each step fills a token budget: running decodes first, then prefill chunks of running and
    then waiting sequences (FIFO), so a long prompt never stalls the streams already running.

    `max_seqs` sequences run at once in `n_slots` slots (more slots keep more cached prefixes).
    `shared_kv`: one pool of `kv_capacity` cells for all slots, where cached prefixes are evicted
    (least recently used) and then running sequences preempted when cells run out; otherwise each
    slot is a stream of `max_seq_len` cells that its sequence can never outgrow.
    `prefill_block`: a prompt chunk that stops short of the prompt's end stops at a multiple of
    it, and cached prefixes are reused in whole blocks (see _core.PREFILL_BLOCK).
    `prefill_stagger`: prompt tokens a step may spend bringing prompts to their end besides the
    first one it ends (earlier chunks of a long prompt still take what the budget leaves). On a
    CPU every token of a step costs about the same, so requests that arrive together then get
    their first tokens a step apart instead of all after one long step, and stop finishing
    together (docs/design/prompt-scheduling.md).
    `first_tokens_apart` (split KV streams on a CPU): a step that ends prompts leaves the decodes
    to the next step, which ends none: the two steps cost what one would, and the first tokens
    come out before the decodes are computed instead of after
    (docs/design/prompt-scheduling.md).
    Between users (docs/design/fair-shares.md): `lanes` sequences may run beyond `max_seqs`, each
    for a user holding none while another holds two or more, so a person's request beside a
    batch starts at once without taking the batch's place; while several users share the server,
    a step's prompt tokens stop at `shared_prompt_tokens` (None: no limit), so the step in
    flight when such a request arrives is short."""

    # A sequence whose prompt shares at least this many more tokens with one still being
    # prefilled waits for them rather than computing them a second time; a shorter common
    # prefix (a chat template's first line) is cheaper to compute than to wait for.
    MIN_SHARED_WAIT = 32

    def __init__(self, *, max_seqs: int, token_budget: int, kv_capacity: int, max_queue: int,
                 max_seq_len: int | None = None, eog_tokens: frozenset[int] = frozenset(),
                 n_slots: int | None = None, shared_kv: bool = True,
                 prefix_cache: bool = True, cache_replies: str = "auto",
                 cache_prompts: str = "auto", prefill_block: int = 1,
                 prefill_stagger: int | None = None, first_tokens_apart: bool = False,
                 lanes: int = 0, shared_prompt_tokens: int | None = None,
                 host_tier=None) -> None:
        self.max_seqs = max_seqs
        self.lanes = lanes
        self.shared_prompt_tokens = shared_prompt_tokens
        self.first_tokens_apart = first_tokens_apart
        self._decodes_held = False  # the last step ended prompts and left its decodes to this one
        self.token_budget = token_budget
        self.prefill_stagger = prefill_stagger or token_budget
        self.kv_capacity = kv_capacity
        self.max_seq_len = max_seq_len or kv_capacity  # cells one sequence may hold
        self.max_queue = max_queue
        self.eog_tokens = eog_tokens
        self.cache = PrefixCache(n_slots or max_seqs + lanes, shared_cells=shared_kv,
                                 enabled=prefix_cache, block=prefill_block, replies=cache_replies,
                                 prompts=cache_prompts, host=host_tier)
        self.waiting: deque[Sequence] = deque()
        self.fair_share = FairShare()
        self.running: list[Sequence] = []
        self._laned: set[int] = set()  # ids of the running sequences admitted to a lane
        self._slot_seq: dict[int, Sequence] = {}  # slot id -> the running sequence writing it
        self._step_cells = 0  # cells the step being planned will fill
        self._step_end_tokens = 0  # tokens of the last chunks of prompts the step ends
        self.num_preemptions = 0
        self._released: list[tuple[int, Sequence]] = []
        self._kv_ops: list[KvOp] = []

    @property
    def kv_used(self) -> int:
        """KV cells held, each counted once however many slots share it."""
        return self.cache.cells_used

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._released or self._kv_ops)

    @property
    def slots_full(self) -> bool:
        """Whether no waiting request can start now: every slot is taken and no lane is open to
        one of them; then a waiting request starts only when a running sequence ends."""
        if self._slot_free():
            return False
        held = self._held()
        return not any(self._lane_open(seq, held) for seq in self.waiting)

    def _slot_free(self) -> bool:
        return len(self.running) - len(self._laned) < self.max_seqs

    def _held(self) -> Counter[str]:
        """Running sequences by user."""
        return Counter(seq.sampling.user for seq in self.running)

    def _lane_open(self, seq: Sequence, held: Counter[str]) -> bool:
        """Whether `seq` may run in a lane: one is free, its user holds no running sequence and
        another user holds two or more."""
        return (len(self._laned) < self.lanes and not held[seq.sampling.user]
                and max(held.values(), default=0) >= 2)

    @property
    def prompts_pending(self) -> bool:
        """Whether a running sequence has not had its first token yet (its prompt, or part of
        it, waits for a later step: the token budget, the stagger or held decodes left it out)."""
        return any(seq.num_output_tokens == 0 or seq.num_uncomputed_tokens > 1
                   for seq in self.running)

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"{len(self.waiting)} requests are waiting")
        if seq.num_tokens >= self.max_seq_len:
            raise ValueError(f"{seq.num_tokens} prompt tokens do not fit a context of "
                             f"{self.max_seq_len} with room for one generated token")
        self.waiting.append(seq)
        self.fair_share.arrive(seq.sampling.user)

    def finish(self, seq: Sequence, reason: str, now: float, error: str | None = None) -> bool:
        """End `seq` and give back what it holds. False if it had already finished."""
        if seq.is_finished:
            return False
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq, ending=True)
        else:
            self.waiting.remove(seq)
            self._kv_ops += self.cache.abandon(seq)  # if preempted: it will not resume
        seq.status = SequenceStatus.FINISHED
        self.fair_share.leave(seq.sampling.user, now)
        seq.finish_reason = reason
        seq.error = error
        seq.finished_time = now
        return True

    def restate_end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        """Say why an ended sequence ended, where the engine learns more than the token that
        ended it told (a stop string before it, a grammar that had failed): what it holds is
        given back already; only what it reports changes."""
        assert seq.is_finished, "restate_end is for ended sequences; finish ends one"
        seq.finish_reason, seq.error = reason, error

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self._step_cells = 0
        self._step_end_tokens = 0
        out.expired = self._expire(now)
        self._preempt_for_waiting(now)
        budget = self._schedule_decodes(out, self.token_budget, now)
        n_decodes = len(out.chunks)
        self._schedule_prompts(out, budget, now)
        self._decodes_held = self._hold_decodes(out, n_decodes)
        # In slot order: llama.cpp splits a batch over split KV streams into micro-batches of
        # increasing seq ids in batch order (adjacent ones for prompt pieces), so any other
        # order costs extra forward passes.
        out.chunks.sort(key=lambda chunk: chunk.seq.seq_id)
        out.released = self.take_released()
        out.kv_ops = self.take_kv_ops()
        return out

    def take_released(self) -> list[tuple[int, Sequence]]:
        """(slot, sequence) for each sequence that left its slot since the last call: ended
        (its sampler can go) or preempted (its sampler waits for it)."""
        released, self._released = self._released, []
        return released

    def take_kv_ops(self) -> list[KvOp]:
        """Changes to llama.cpp's KV decided since the last call, to be made in this order."""
        ops, self._kv_ops = self._kv_ops, []
        return ops

    def postprocess(self, out: SchedulerOutput, sampled, now: float) -> list[tuple[int, int]]:
        """Account for a decoded step: `sampled[i]` is chunk i's token (-1 if it sampled none).
        Returns (chunk index, 1) for each chunk whose sequence got a token; ends sequences that
        reached an end-of-generation token, max_tokens or the context's end, and with an error
        one that was to sample and got no token (_sampled_nothing)."""
        got = []
        for i, (chunk, token) in enumerate(zip(out.chunks, sampled)):
            seq = chunk.seq
            if seq.is_finished:  # aborted while its batch was decoding
                continue
            self._computed(seq, chunk.length)
            if token >= 0:
                self._append(seq, token, now)
                got.append((i, 1))
            elif chunk.samples:
                self._sampled_nothing(seq, now)
        return got

    def postprocess_run(self, out: SchedulerOutput, tokens, counts, n_steps: int,
                        now: float) -> list[tuple[int, int]]:
        """Account for a decode run (Context.decode_run) over decode-only chunks: chunk i fed
        and got `counts[i]` tokens, at tokens[i * n_steps:]. Returns (chunk index, number
        kept). The core ends a row only at its budget (`decode_budget` when the run was
        planned) or after an end-of-generation token, so only a row's last token can end its
        sequence: the others are appended without a check. A row whose last token is negative
        sampled none there (the run cannot feed it on): it ends with an error."""
        got = []
        for i, chunk in enumerate(out.chunks):
            seq, count = chunk.seq, counts[i]
            if seq.is_finished or count == 0:
                continue
            self._computed(seq, count)
            self._charge(seq, count - chunk.length)  # the run's steps after the planned one
            start = i * n_steps
            seq.output_token_ids += tokens[start:start + count - 1]
            if tokens[start + count - 1] < 0:  # sampled no token: the run stopped it there
                self._sampled_nothing(seq, now)
                if count > 1:
                    got.append((i, count - 1))
                continue
            self._append(seq, tokens[start + count - 1], now)
            got.append((i, count))
        return got

    def _sampled_nothing(self, seq: Sequence, now: float) -> None:
        """End a sequence whose row was to sample and got no token: nothing is left for it to
        compute, so it would otherwise wait for a token forever."""
        self.finish(seq, FINISH_ERROR, now, SAMPLED_NOTHING)

    def drop_last_tokens(self, seq: Sequence, n: int) -> None:
        """Forget `seq`'s last `n` output tokens: a decode run made them after a stop string
        had ended the sequence. Their cells go when the sequence ends."""
        del seq.output_token_ids[len(seq.output_token_ids) - n:]
        seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)

    def decode_budget(self, seq: Sequence) -> int:
        """Tokens `seq` may still generate before max_tokens or its context's end."""
        return min(seq.sampling.max_tokens - seq.num_output_tokens,
                   self.max_seq_len - seq.num_tokens)

    def _computed(self, seq: Sequence, n_tokens: int) -> None:
        self.cache.extend(self.cache.slots[seq.seq_id], seq.num_computed_tokens, n_tokens)
        seq.num_computed_tokens += n_tokens

    def _append(self, seq: Sequence, token: int, now: float) -> None:
        seq.output_token_ids.append(token)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        self._check_end(seq, token, now)

    def preempt(self, now: float, index: int | None = None) -> Sequence | None:
        """Free the KV of running sequence `index`, by default the lowest-priority one (the
        most recently admitted among equals), and queue it first among its priority, to be
        recomputed. Returns it, or None if nothing runs."""
        if not self.running:
            return None
        seq = self.running.pop(self._victim_index() if index is None else index)
        self._release(seq, ending=False)  # its computed tokens stay cached to resume from
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)  # first in the queue: _next_waiting orders by priority
        return seq

    def _victim_index(self) -> int:
        """The running sequence a preemption takes: the highest priority value, the latest
        admitted (last in `running`) among equals."""
        worst = max(seq.sampling.priority for seq in self.running)
        return max(i for i, seq in enumerate(self.running) if seq.sampling.priority == worst)

    def _next_waiting(self, skip: set[int], held: Counter[str]) -> int | None:
        """Where the waiting sequence to admit next is in the queue: the first by _fair_key,
        then the first in the queue (arrival order, preempted ones first); None when every
        waiting sequence is in `skip` (ids)."""
        best, best_key = None, None
        for i, seq in enumerate(self.waiting):
            if id(seq) in skip:
                continue
            key = self._fair_key(seq, held)
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def _fair_key(self, seq: Sequence, held: Counter[str]) -> tuple[int, float, int]:
        """Who goes first: the lowest priority value, then the user whose fair-share clock is
        lowest, then the user holding fewer slots (a newcomer's clock starts level with the
        lowest)."""
        user = seq.sampling.user
        return seq.sampling.priority, self.fair_share.clock(user), held[user]

    def _preempt_for_waiting(self, now: float) -> None:
        """With every slot taken and no lane open to it, the waiting sequence next in line
        takes a running one's place before this step plans its rows (one exchange a step; this
        step's admission starts it):
        - one of a lower priority value than the worst running sequence takes that one's;
        - one of the same priority whose user holds fewer slots than its weight's share takes
          one from the user most over its own share, if that user holds two or more."""
        if self._slot_free() or not self.waiting or not self.running:
            return
        held = self._held()
        best = self.waiting[self._next_waiting(set(), held)]
        if self._lane_open(best, held):
            return
        victim = self._victim_index()
        if best.sampling.priority < self.running[victim].sampling.priority:
            self.preempt(now, victim)
        elif best.sampling.priority == self.running[victim].sampling.priority:
            victim = self._fair_victim_index(best.sampling.priority, best.sampling.user)
            if victim is not None:
                self.preempt(now, victim)

    def _slot_shares(self, priority: int) -> dict[str, int]:
        """Each user with work of `priority`: the slots its weight's share of those users'
        weights is worth, at least one."""
        weights = {seq.sampling.user: seq.sampling.user_weight
                   for seq in (*self.running, *self.waiting) if seq.sampling.priority == priority}
        total = sum(weights.values())
        return {user: max(1, int(self.max_seqs * weight / total))
                for user, weight in weights.items()}

    def _fair_victim_index(self, priority: int, user: str) -> int | None:
        """For a waiting `user` holding fewer slots of `priority` than its share: a running
        sequence of the user most over its own share, if that user holds two or more."""
        held = Counter(seq.sampling.user for seq in self.running
                       if seq.sampling.priority == priority)
        shares = self._slot_shares(priority)
        if held[user] >= shares[user]:
            return None
        hog, over = max(((u, n - shares[u]) for u, n in held.items() if u != user),
                        key=lambda item: (item[1], self.fair_share.clock(item[0])),
                        default=(None, 0))
        if over <= 0 or held[hog] < 2:
            return None
        # The one whose place costs least to give back: fewest tokens computed (a prompt
        # still filling, or a request just begun), the newest among equals.
        return min((i for i, seq in enumerate(self.running)
                    if seq.sampling.user == hog and seq.sampling.priority == priority),
                   key=lambda i: (self.running[i].num_computed_tokens, -i))

    def _check_end(self, seq: Sequence, token: int, now: float) -> None:
        params = seq.sampling
        if token in self.eog_tokens and not params.ignore_eos:
            self.finish(seq, FINISH_STOP, now)
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_seq_len:
            self.finish(seq, FINISH_LENGTH, now)

    def _release(self, seq: Sequence, ending: bool) -> None:
        slot = self.cache.slots[seq.seq_id]
        del self._slot_seq[slot.id]
        self._laned.discard(id(seq))
        # A request that asked not to use the cache (cache_prompt: false) leaves nothing in it
        # either, once it ends.
        keep = seq.cache_prompt or not ending
        self._kv_ops += self.cache.finish(slot, seq.token_ids(0, seq.num_computed_tokens), keep,
                                          seq.num_prompt_tokens,
                                          resuming=None if ending else seq)
        self._released.append((seq.seq_id, seq))
        seq.seq_id = None

    def room_for_run(self, n_rows: int, n_steps: int) -> int:
        """Decode steps (at most `n_steps`) that `n_rows` sequences can run in C before the KV
        pool fills, after evicting cached prefixes to make room."""
        if not self.cache.shared_cells:
            return n_steps
        self._reclaim(n_rows * n_steps)
        return min(n_steps, self._kv_free() // n_rows)

    def _reclaim(self, cells: int, keep: Slot | None = None) -> bool:
        """Evict cached prefixes, least recently used first, until `cells` are free."""
        if self._kv_free() >= cells:
            return True
        for slot in self.cache.eviction_order(keep):
            self._kv_ops += self.cache.evict(slot)
            if self._kv_free() >= cells:
                return True
        return False

    def _expire(self, now: float) -> list[Sequence]:
        expired = [s for s in (*self.running, *self.waiting)
                   if s.deadline is not None and now >= s.deadline]
        for seq in expired:
            self.finish(seq, FINISH_TIMEOUT, now, error="request deadline passed")
        return expired

    def _schedule_decodes(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """One token for every running sequence that decodes, before any prompt chunk."""
        decoding = [s for s in self.running if s.num_uncomputed_tokens == 1]
        for seq in decoding:
            if budget == 0:
                break
            # Out of cells: cached prefixes go first, then the newest sequence gives its cells
            # back, possibly this one.
            while not self._reclaim(1) and seq.status is SequenceStatus.RUNNING:
                self.preempt(now)
            if seq.status is SequenceStatus.RUNNING:
                budget -= self._add_chunk(out, seq, 1)
        return budget

    def _hold_decodes(self, out: SchedulerOutput, n_decodes: int) -> bool:
        """With `first_tokens_apart`, when this step gives sequences their first tokens, its
        decodes (its first `n_decodes` chunks) wait for the next step. Not after a step that held
        them, and not for a one-token prompt end: alone in a step, that could be a micro-batch of
        one row of one stream, which ggml computes with another kernel
        (docs/design/batch-invariance.md). Returns whether the decodes wait."""
        if not (self.first_tokens_apart and n_decodes) or self._decodes_held:
            return False
        firsts = [chunk.length for chunk in out.chunks[n_decodes:]
                  if chunk.samples and chunk.seq.num_output_tokens == 0]
        if not firsts or min(firsts) < 2:
            return False
        self._step_cells -= sum(chunk.length for chunk in out.chunks[:n_decodes])
        del out.chunks[:n_decodes]
        return True

    def _add_prompt_chunk(self, out: SchedulerOutput, seq: Sequence, budget: int) -> int:
        """`seq`'s next prompt chunk, as much as the budget leaves; none if it would end the
        prompt and the step has already spent its stagger on ending others, or computes the
        decodes the last step held. Returns its tokens."""
        remaining = seq.num_uncomputed_tokens
        if remaining <= budget and self._decodes_held:
            return 0
        if (remaining <= budget and self._step_end_tokens
                and self._step_end_tokens + remaining > self.prefill_stagger):
            return 0  # its first token waits a step
        length = min(budget, remaining)
        self._reclaim(length)
        added = self._add_chunk(out, seq, min(length, self._kv_free()))
        if added == remaining:
            self._step_end_tokens += added
        return added

    def _schedule_prompts(self, out: SchedulerOutput, budget: int, now: float) -> None:
        """Prompt chunks, of running sequences and of waiting ones started here, first by
        _fair_key, then running ones in the order they were admitted before waiting ones. While
        several users share the server (fair_share.FairShare.sharing), the step's prompt tokens stop
        at `shared_prompt_tokens`."""
        if self.shared_prompt_tokens and self.fair_share.sharing(now) > 1:
            budget = min(budget, self.shared_prompt_tokens)
        held = self._held()
        prompts = [s for s in self.running if s.num_uncomputed_tokens > 1]
        held_back: set[int] = set()  # ids of the sequences left waiting for a shared prefix
        admitting = self._may_admit(held)
        while budget > 0:
            first = min(range(len(prompts)), default=None,
                        key=lambda i: (self._fair_key(prompts[i], held), i))
            index = self._next_waiting(held_back, held) if admitting else None
            if index is not None and (first is None or self._fair_key(self.waiting[index], held)
                                      < self._fair_key(prompts[first], held)):
                seq = self.waiting[index]
                if self._awaits_shared_prefix(seq):
                    held_back.add(id(seq))
                    continue
                if not self._admit(out, index, held, now):
                    admitting = False
                    continue
                budget -= self._add_prompt_chunk(out, seq, budget)
                admitting = self._may_admit(held)
            elif first is not None:
                seq = prompts.pop(first)
                if seq.status is SequenceStatus.RUNNING:
                    budget -= self._add_prompt_chunk(out, seq, budget)
            else:
                break

    def _may_admit(self, held: Counter[str]) -> bool:
        """Whether a waiting sequence could start now: a slot is free, or a lane is, beside a
        user holding two or more (then it depends on whose the sequence is)."""
        return bool(self.waiting) and (self._slot_free() or (
            len(self._laned) < self.lanes and max(held.values(), default=0) >= 2))

    def _admit(self, out: SchedulerOutput, index: int, held: Counter[str], now: float) -> bool:
        """Start the waiting sequence at `index` in a free slot or an open lane. False when it
        cannot start: no slot, no lane, no room."""
        seq = self.waiting[index]
        lane = not self._slot_free()
        if (lane and not self._lane_open(seq, held)) or not self._start(seq, now):
            return False
        del self.waiting[index]
        out.started.append(seq)
        held[seq.sampling.user] += 1
        if lane:
            self._laned.add(id(seq))
        return True

    def _start(self, seq: Sequence, now: float) -> bool:
        """Give `seq` a slot, starting from the longest cached prefix of its tokens (all but the
        last, whose logits it needs). False when no slot or no room is free."""
        tokens = seq.token_ids(0, seq.num_tokens)
        limit = seq.num_tokens - 1 if seq.cache_prompt else 0
        placement = self.cache.place(tokens, limit, self._live_prefix)
        if placement is None or not self._room_to_start(seq, placement):
            return False
        first_start = seq.first_scheduled_time is None  # not resuming after a preemption
        self._kv_ops += self.cache.start(placement, resuming=None if first_start else seq)
        seq.seq_id = placement.dst.id
        self._slot_seq[seq.seq_id] = seq
        seq.num_computed_tokens = placement.length
        seq.status = SequenceStatus.RUNNING
        if first_start:
            seq.first_scheduled_time = now
            seq.num_cached_tokens = placement.length
        self.running.append(seq)
        return True

    def _room_to_start(self, seq: Sequence, placement: Placement) -> bool:
        """Cells for the rest of the prompt and one generated token; in a shared pool the slot
        taken over is emptied and cached prefixes evicted to make them."""
        if not self.cache.shared_cells:
            return True
        if placement.dst is not placement.src and placement.dst.runs:
            self._kv_ops += self.cache.evict(placement.dst)
        # A load from the host tier puts all of its entry's cells back, then trims them.
        loaded = len(placement.restore.tokens) if placement.restore is not None else 0
        return self._reclaim(seq.num_tokens - placement.length + 1 + loaded, keep=placement.src)

    def _live_prefix(self, slot: Slot) -> tuple[list[int], int]:
        """What a running sequence's slot can share: its prompt, as far as it is computed."""
        seq = self._slot_seq[slot.id]
        return seq.prompt_token_ids, min(seq.num_computed_tokens, seq.num_prompt_tokens)

    def _awaits_shared_prefix(self, seq: Sequence) -> bool:
        """Whether a running sequence is still prefilling a long prefix `seq` shares: then `seq`
        waits and starts from it once computed, so no prefix is computed twice at once."""
        if not (seq.cache_prompt and self.cache.enabled):
            return False
        packed = None
        for other in self.running:
            computed = other.num_computed_tokens
            if computed >= other.num_prompt_tokens:
                continue
            packed = packed or pack(seq.prompt_token_ids)
            held = self.cache.packed_held(self.cache.slots[other.seq_id], other.prompt_token_ids)
            shared = min(common_packed_prefix(held, packed), seq.num_tokens - 1)
            if shared - computed >= self.MIN_SHARED_WAIT:
                return True
        return False

    def _add_chunk(self, out: SchedulerOutput, seq: Sequence, length: int) -> int:
        start = seq.num_computed_tokens
        if start + length < seq.num_tokens:  # a chunk short of the end ends at a block's end
            length = (start + length) // self.cache.block * self.cache.block - start
        if length <= 0:
            return 0
        out.chunks.append(ScheduledChunk(seq, start, length, start + length == seq.num_tokens))
        self._step_cells += length
        self._charge(seq, length)
        return length

    def _charge(self, seq: Sequence, tokens: int) -> None:
        """Count tokens toward `seq`'s user's share when they are planned, so that the next
        admission in the same step already sees them."""
        self.fair_share.charge(seq.sampling.user, seq.sampling.user_weight, tokens)

    def _kv_free(self) -> int:
        if not self.cache.shared_cells:  # a stream per slot, as long as a sequence may grow
            return self.max_seq_len
        return self.kv_capacity - self.cache.cells_used - self._step_cells
