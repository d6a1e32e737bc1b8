"""Which token prefixes the KV cache holds, slot by slot, and how many cells they take.

A slot is one llama.cpp seq id. A running sequence writes its slot; when it ends, the slot keeps
its KV as a cached prefix until another sequence takes the slot or room is needed. A new
sequence starts from the longest prefix any slot holds — its own slot reused in place, or
another slot's prefix shared into it — and computes only the rest.

Cells are counted exactly even when slots share them. A *group* is the run of cells one
computation wrote, from its first position on; a slot holds, group by group, a prefix of each
(`Run`). llama.cpp frees a cell when no seq id holds it, so a group takes as many cells as its
longest claim. With split KV streams, sharing copies the cells, so every slot has groups of its
own. Pure Python: no llama.cpp here; the scheduler turns decisions into `KvOp`s for the engine.

In one pool every row of a step attends over every cell held, so whatever a finished sequence
leaves cached costs every later step; two `Retention` rules decide whether its reply and its
prompt stay cached (docs/design/prefix-cache.md).

Under the slots, an optional host-RAM tier (cllm/engine/kv_tiers.py): an evicted prefix is saved
there, and a prompt that shares more with a saved prefix than with any slot has it loaded into
its slot (docs/design/kv-tiers.md)."""
from __future__ import annotations

import itertools
from array import array
from collections import deque
from dataclasses import dataclass, field, replace

from cllm.config import RETENTION_MODES


@dataclass(slots=True)
class Run:
    """Positions [start, end) of group `group` (whose first cell is at `start`)."""
    group: int
    start: int
    end: int


@dataclass(slots=True, eq=False)
class Slot:
    id: int
    # Idle: the tokens its last sequence computed, at positions 0..; its KV may hold only the
    # first `cached` of them (a dropped reply is remembered, to notice when replies come back).
    tokens: list[int] = field(default_factory=list)
    prompt_length: int = 0  # how many of them were its sequence's prompt
    started_from: int = 0  # how many of them its sequence found cached: a prefix others share
    runs: list[Run] = field(default_factory=list)     # the cell groups behind positions 0..
    live: bool = False      # a running sequence writes it
    last_used: int = 0      # a clock tick, for least-recently-used eviction
    own_group: int | None = None  # the group it is extending, if its last run is its own
    # Idle: the preempted sequence (any key the caller chooses) that will resume from all it
    # holds.
    resuming: object = None

    @property
    def cached(self) -> int:
        """Positions 0.. whose cells the slot holds."""
        return self.runs[-1].end if self.runs else 0


@dataclass(slots=True, frozen=True)
class KvOp:
    """What the engine does to llama.cpp's KV before the next decode: `clear` a slot, make
    slot `dst` hold exactly the first `length` positions of slot `src` (src == dst: trim),
    `save` slot `dst`'s KV into the host tier's `entry`, or `load` the entry's KV into slot
    `dst`, keeping its first `length` positions."""
    kind: str  # "clear", "share", "save" or "load"
    dst: int
    src: int = -1
    length: int = 0
    entry: object = None  # a kv_tiers.HostEntry, for "save" and "load"


@dataclass(slots=True, frozen=True)
class Placement:
    """Where a new sequence goes: slot `dst`, starting from `src`'s first `length` tokens.
    `continues_reply`: its prompt goes on past an idle slot's prompt into that slot's reply.
    `reuses_idle_prompt`: an idle slot's prompt (kept or not) gives it a longer prefix than any
    running sequence's, by at least PrefixCache.IDLE_PROMPT_GAIN tokens. `restore`: the host
    tier's entry (kv_tiers.HostEntry) whose first `length` tokens it starts from (src is None)."""
    dst: Slot
    src: Slot | None
    length: int
    continues_reply: bool = False
    reuses_idle_prompt: bool = False
    restore: object = None


class Retention:
    """Whether finished sequences keep one kind of cells (their replies', or their prompts') in
    one pool. Kept cells save a later request's prefill, but every step attends over them, and
    requests that never come back to them (one-shot requests with distinct prompts) gain
    nothing. `auto` keeps them while at least `SHARE` of the last `WINDOW` admissions would
    have reused such cells (a slot remembers its tokens after dropping their cells, so the
    signal survives dropping), and always before `min_admissions` were seen; `keep` and `drop`
    decide once for all."""

    MODES = RETENTION_MODES
    WINDOW = 32
    SHARE = 0.25

    def __init__(self, mode: str = "auto", min_admissions: int = 1) -> None:
        self.mode = mode
        self.min_admissions = min_admissions
        self._recent: deque[bool] = deque(maxlen=self.WINDOW)

    def admitted(self, reuses: bool) -> None:
        self._recent.append(reuses)

    @property
    def keeps(self) -> bool:
        """Whether such cells stay cached now (the class says how `auto` decides)."""
        if self.mode != "auto":
            return self.mode == "keep"
        if len(self._recent) < self.min_admissions:
            return True
        return sum(self._recent) >= self.SHARE * len(self._recent)


_TOKEN_SIZE = array("i").itemsize


def pack(tokens: list[int]) -> bytes:
    """Tokens as bytes, for common_packed_prefix."""
    return array("i", tokens).tobytes()


def common_packed_prefix(a: bytes, b: bytes) -> int:
    """How many leading tokens two packed token lists share: a binary search over slices, which
    bytes compare with memcmp (a list's slices compare element by element: 1,446 tokens took
    ~42 us a pair against ~7 us packed, which over 128 slots was a third of an H200's engine
    thread at 64 streams of a shared document)."""
    lo, hi = 0, min(len(a), len(b)) // _TOKEN_SIZE
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo * _TOKEN_SIZE:mid * _TOKEN_SIZE] == b[lo * _TOKEN_SIZE:mid * _TOKEN_SIZE]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefixCache:
    """Slots, what each holds, and the cells used. `shared_cells`: slots can share cells (one
    unified KV pool); otherwise sharing a prefix copies it (split streams). With a `block` > 1
    the core decodes prompts in aligned blocks (_core.PREFILL_BLOCK), and a reused prefix ends
    where the new prompt, computed alone, would have the same cells: on a block boundary, or
    inside the last partial block of both prompts, which are computed row by row."""

    # A slot's own prefix is reused in place when it covers at least this share of the slot;
    # below, the new sequence takes an empty or stale slot and the old content stays cached.
    REUSE_IN_PLACE = 0.5
    # An idle prompt that gives fewer extra tokens than this over every running sequence's (a
    # chat template's first lines) is no reason to keep idle prompts: computing them is cheap.
    IDLE_PROMPT_GAIN = 32

    def __init__(self, n_slots: int, *, shared_cells: bool, enabled: bool = True,
                 block: int = 1, replies: str = "auto", prompts: str = "auto",
                 host=None) -> None:
        self.slots = [Slot(i) for i in range(n_slots)]
        self.shared_cells = shared_cells
        # Split streams: an idle stream is outside every other row's attention, so it costs
        # nothing to keep; only one pool needs rules. Prompts are dropped only on the evidence
        # of a whole window (a fresh server keeps them, as llama-server's slots do); a chat's
        # next turn needs its prompt as well as its reply, so kept replies keep their prompts.
        self.replies = Retention(replies if shared_cells else "keep")
        self.prompts = Retention(prompts if shared_cells else "keep",
                                 min_admissions=Retention.WINDOW)
        self.block = block
        self.enabled = enabled
        self.host = host  # a kv_tiers.HostTier, or None
        self.cells_used = 0
        # Each slot's held tokens (its idle tokens or its running sequence's prompt) packed
        # once: those lists are replaced, never changed in place, so the list itself is the key.
        self._packed: dict[int, tuple[list[int], bytes]] = {}
        self._group_start: dict[int, int] = {}
        self._groups = itertools.count()
        self._clock = itertools.count(1)

    # ---- queries ----

    @property
    def cached_cells(self) -> int:
        """Cells that only idle slots hold: what eviction could give back."""
        return self.cells_used - self._cells_of([s for s in self.slots if s.live])

    def idle_slots(self) -> list[Slot]:
        return [s for s in self.slots if not s.live]

    def best_match(self, tokens: list[int], limit: int, live_prefix) -> tuple[Slot | None, int]:
        """The slot holding the longest prefix of `tokens`, at most `limit` long. A live slot is
        read through `live_prefix(slot)`: (tokens, how many of them are computed)."""
        placement = self._match(tokens, pack(tokens), limit, live_prefix)
        return placement.src, placement.length

    def _match(self, tokens: list[int], packed_tokens: bytes, limit: int,
               live_prefix) -> Placement:
        """best_match as a placement in the source slot, with what the retention rules learn
        from it: idle slots are read as they were before their cells were dropped."""
        best, best_len, continues_reply = None, 0, False
        idle_prompt, live_prompt = 0, 0  # the longest prefix each kind of slot gives, or gave
        if not self.enabled or limit <= 0:
            return Placement(None, None, 0)
        for slot in self.slots:
            if slot.live:
                held, usable = live_prefix(slot)
                prompt_length = len(held)
            else:
                held, usable, prompt_length = slot.tokens, slot.cached, slot.prompt_length
            if not held or held[0] != tokens[0]:
                continue
            common = common_packed_prefix(self.packed_held(slot, held), packed_tokens)
            if slot.live:
                live_prompt = max(live_prompt, min(common, limit))
            else:
                idle_prompt = max(idle_prompt, min(common, prompt_length, limit))
                continues_reply |= common > prompt_length
            n = self._reusable(min(common, usable, limit), prompt_length, len(tokens))
            # Ties go to an idle slot, which can be taken over without a copy.
            if n > best_len or (n == best_len and n and best.live and not slot.live):
                best, best_len = slot, n
        reuses_idle_prompt = idle_prompt - live_prompt >= self.IDLE_PROMPT_GAIN
        return Placement(best, best, best_len, continues_reply, reuses_idle_prompt)

    def _reusable(self, n: int, held_prompt: int, new_length: int) -> int:
        """How much of a common prefix of `n` tokens to reuse, so that every reused cell is the
        one the new sequence would compute (see the class)."""
        whole = n // self.block * self.block
        last_block = new_length // self.block * self.block  # where its last partial block starts
        if whole == last_block and held_prompt // self.block * self.block == last_block:
            return min(n, held_prompt)  # both prompts' row-by-row tail: cells alike
        return whole

    def place(self, tokens: list[int], limit: int, live_prefix) -> Placement | None:
        """Choose a slot for a sequence of `tokens` that may reuse at most `limit` of them.
        None when every slot is live."""
        idle = self.idle_slots()
        if not idle:
            return None
        packed_tokens = pack(tokens)
        match = self._match(tokens, packed_tokens, limit, live_prefix)
        src = match.src
        restore = self._host_match(tokens, packed_tokens, limit, match.length)
        if restore is not None:
            return replace(restore, dst=min(idle, key=self._preference),
                           continues_reply=match.continues_reply,
                           reuses_idle_prompt=match.reuses_idle_prompt)
        if self._takes_over(match, tokens, packed_tokens):
            return match
        dst = min((s for s in idle if s is not src), key=self._preference, default=None)
        if dst is None:  # the source is the only idle slot: reuse it in place after all
            return match
        return replace(match, dst=dst)

    def _host_match(self, tokens: list[int], packed_tokens: bytes, limit: int,
                    in_slots: int) -> Placement | None:
        """A placement (its dst still to choose) starting from the host tier's entry that gives
        at least HostTier.MIN_TOKENS more than the `in_slots` tokens a slot gives; else None."""
        if self.host is None or not self.enabled or limit <= 0:
            return None
        entry, common = self.host.match(packed_tokens)
        if entry is None:
            return None
        n = self._reusable(min(common, limit), entry.prompt_length, len(tokens))
        if n - in_slots < self.host.MIN_TOKENS or not self.host.hit(entry):
            return None
        return Placement(None, None, n, restore=entry)

    def _takes_over(self, match: Placement, tokens: list[int], packed_tokens: bytes) -> bool:
        """Whether a new sequence of `tokens` reuses its match's idle slot in place, dropping
        the rest of it: when the match covers REUSE_IN_PLACE of the slot, or when the new prompt
        starts with the slot's whole prompt (the same prompt again: keeping its old reply
        aside, for a chat that might go on from it, took a second slot for every repeat, and
        24 prompts repeating over 32 split streams then missed half their hits)."""
        src = match.src
        if src is None or src.live or not match.length:
            return False
        if match.length >= self.REUSE_IN_PLACE * src.cached:
            return True
        return (src.resuming is None and len(tokens) >= src.prompt_length > 0
                and common_packed_prefix(self.packed_held(src, src.tokens), packed_tokens)
                >= src.prompt_length)

    @staticmethod
    def _preference(slot: Slot) -> tuple:
        """Which idle slot a sequence that does not take over its match goes to, lowest first:
        an empty one, then the least recently used (the source itself is never a candidate).
        Where a split stream lies costs nothing: llama.cpp decodes the streams of a step in one
        forward pass whatever idle streams lie between them
        (vendor/patches/llama-kv-split-stream-gaps.patch)."""
        return slot.cached > 0, slot.last_used

    def packed_held(self, slot: Slot, held: list[int]) -> bytes:
        """`held` (the tokens `slot` holds, or its running sequence's prompt), packed once."""
        entry = self._packed.get(slot.id)
        if entry is None or entry[0] is not held:
            entry = self._packed[slot.id] = (held, pack(held))
        return entry[1]

    # ---- changes ----

    def start(self, placement: Placement, resuming: object = None) -> list[KvOp]:
        """A sequence starts in `placement.dst` (`resuming`: the preempted sequence starting
        again, as finish() was told); returns the KV operations that set it up."""
        dst, src, length = placement.dst, placement.src, placement.length
        # What the retention rules learn from: an admission that an idle slot could have served.
        # Before any sequence has finished there is none (a fresh server's first requests, a
        # benchmark's first wave): those admissions say nothing either way. A resumed sequence
        # continues its own output, not a finished one.
        if resuming is None and any(s.tokens for s in self.idle_slots()):
            self.replies.admitted(placement.continues_reply)
            self.prompts.admitted(placement.reuses_idle_prompt)
        ops = self._save(dst) if dst is not src and dst.runs else []
        if placement.restore is not None:
            op = KvOp("load", dst.id, length=length, entry=placement.restore)
            dst.runs = [self._new_run(0, length)]
        elif src is None or length == 0:
            op = KvOp("clear", dst.id)
            dst.runs = []
        elif src is dst:
            op = KvOp("share", dst.id, dst.id, length)
            dst.runs = _clip(dst.runs, length)
        else:
            op = KvOp("share", dst.id, src.id, length)
            dst.runs = (_clip(src.runs, length) if self.shared_cells
                        else [self._new_run(0, length)])
            src.last_used = next(self._clock)  # a prefix others start from is in use
        dst.tokens = []  # a live slot's tokens are its sequence's
        dst.started_from = self._found_prefix(placement, resuming)
        dst.live = True
        dst.resuming = None
        dst.own_group = None
        dst.last_used = next(self._clock)
        ops.append(op)
        if resuming is not None:  # its old slot, if it resumed elsewhere, goes to the rules
            ops += self.abandon(resuming)
        self._recount()
        return ops

    def _found_prefix(self, placement: Placement, resuming: object) -> int:
        """How much of a starting sequence's prefix others' cells gave it. A sequence resuming
        after preemption starts from its own cells: only what it found when it first started
        counts."""
        if placement.restore is not None and resuming is None:
            return placement.length
        if placement.src is None:
            return 0
        if resuming is None:
            return placement.length
        before = next((s for s in self.slots if s.resuming is resuming), None)
        return min(placement.length, before.started_from) if before is not None else 0

    def extend(self, slot: Slot, start: int, n: int) -> None:
        """`slot`'s sequence computed `n` new tokens from position `start`: new cells."""
        if slot.own_group is not None and slot.runs and slot.runs[-1].end == start:
            slot.runs[-1].end += n
        else:
            run = self._new_run(start, start + n)
            slot.runs.append(run)
            slot.own_group = run.group
        self.cells_used += n

    def finish(self, slot: Slot, computed_tokens: list[int], keep: bool = True,
               prompt_length: int | None = None, resuming: object = None) -> list[KvOp]:
        """The slot's sequence ended (or was preempted, to resume as `resuming`: any key, given
        again to start() or abandon()) having computed `computed_tokens`, the
        first `prompt_length` of them its prompt (default: all). They stay cached as far as the
        retention rules keep replies and prompts (all of them when the sequence will resume
        from them); the slot remembers them all either way. Cells a decode wrote past them, for
        a sequence aborted meanwhile, are dropped. Everything is forgotten at once when the
        cache is off or `keep` is false. Other idle slots give up what the rules no longer keep:
        what they kept before the rules learned otherwise would cost every step for good, since
        new sequences take emptied slots first."""
        slot.live = False
        slot.last_used = next(self._clock)
        slot.tokens = computed_tokens
        slot.prompt_length = min(len(computed_tokens) if prompt_length is None else prompt_length,
                                 len(computed_tokens))
        if not (self.enabled and keep):
            return self._forget(slot)
        slot.resuming = resuming
        # Its own trim always goes out: it also drops cells a decode wrote past what it computed.
        ops = [self._trim(slot, self._kept_length(slot))]
        ops += self._trim_to_rules(s for s in self.idle_slots() if s is not slot)
        self._recount()
        return ops

    def _trim_to_rules(self, slots) -> list[KvOp]:
        """Idle `slots` give up the cells the retention rules no longer keep."""
        ops = []
        for slot in slots:
            kept = self._kept_length(slot)
            if slot.cached > kept:
                ops.append(self._trim(slot, kept))
        return ops

    def _kept_length(self, slot: Slot) -> int:
        """How much of an idle slot's tokens the retention rules keep cached now."""
        if slot.resuming is not None or self.replies.keeps:
            return len(slot.tokens)
        if self.prompts.keeps:
            return slot.prompt_length
        # A prompt dropped by the evidence keeps the prefix it found cached, when long: cells
        # that requests share (a document, a system prompt). Sequences that start from a
        # running one's prefix never count as reusing an idle prompt, and once all that held
        # it ended at once, the shared document was computed again: once every 8 requests at
        # 8 streams (docs/design/prefix-cache.md).
        shared = min(slot.started_from, slot.prompt_length)
        auto = self.prompts.mode == "auto"
        return shared if auto and shared >= self.IDLE_PROMPT_GAIN else 0

    def _trim(self, slot: Slot, length: int) -> KvOp:
        """Keep the cells of an idle slot's first `length` positions; the KvOp that does it."""
        slot.runs = _clip(slot.runs, length)
        return KvOp("share", slot.id, slot.id, length) if slot.runs else KvOp("clear", slot.id)

    def evict(self, slot: Slot) -> list[KvOp]:
        """Forget what an idle slot holds, saved to the host tier first if there is one."""
        return self._save(slot) + self._forget(slot)

    def _save(self, slot: Slot) -> list[KvOp]:
        """The op that copies an idle slot's cells to the host tier, if it takes them."""
        if self.host is None or not self.enabled:
            return []
        held = slot.cached
        entry = self.host.reserve(slot.tokens[:held], min(slot.prompt_length, held))
        return [KvOp("save", slot.id, length=held, entry=entry)] if entry is not None else []

    def _forget(self, slot: Slot) -> list[KvOp]:
        slot.tokens, slot.runs, slot.own_group, slot.prompt_length = [], [], None, 0
        slot.started_from = 0
        slot.resuming = None
        self._recount()
        return [KvOp("clear", slot.id)]

    def abandon(self, resuming: object) -> list[KvOp]:
        """The preempted sequence `resuming` will not resume from its slot (it ended while it
        waited, or resumed elsewhere): the slot keeps only what the retention rules keep."""
        slots = [s for s in self.idle_slots() if s.resuming is resuming]
        for slot in slots:
            slot.resuming = None
        ops = self._trim_to_rules(slots)
        self._recount()
        return ops

    def eviction_order(self, keep: Slot | None = None) -> list[Slot]:
        """Idle slots holding something, least recently used first."""
        return sorted((s for s in self.slots if not s.live and s.runs and s is not keep),
                      key=lambda s: s.last_used)

    # ---- cell accounting ----

    def _new_run(self, start: int, end: int) -> Run:
        group = next(self._groups)
        self._group_start[group] = start
        return Run(group, start, end)

    def _cells_of(self, slots: list[Slot]) -> int:
        longest: dict[int, int] = {}
        for slot in slots:
            for run in slot.runs:
                if run.end > longest.get(run.group, -1):
                    longest[run.group] = run.end
        return sum(end - self._group_start[g] for g, end in longest.items())

    def _recount(self) -> None:
        self.cells_used = self._cells_of(self.slots)
        live_groups = {run.group for s in self.slots for run in s.runs}
        for group in [g for g in self._group_start if g not in live_groups]:
            del self._group_start[group]


def _clip(runs: list[Run], length: int) -> list[Run]:
    """The runs covering positions [0, length), copied so the source's runs stay as they are."""
    return [Run(r.group, r.start, min(r.end, length)) for r in runs if r.start < length]
