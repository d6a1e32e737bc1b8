"""The host-RAM tier under the prefix cache: prefixes the KV pool evicts, kept as copies of their
sequence's KV state (llama.cpp's per-sequence state) in host memory, up to a byte budget, least
recently used dropped first. A later prompt that starts with more of an entry's tokens than any
slot holds has the copy loaded into its slot instead of computing that prefix again
(docs/design/kv-tiers.md). What it drops goes to the disk tier, when there is one
(cllm/engine/kv_disk.py).

Pure Python: the prefix cache decides what to save and what to load (as `KvOp`s carrying an
entry), the engine copies the bytes and reports them here."""
from __future__ import annotations

import itertools
import os
from collections import OrderedDict
from dataclasses import dataclass, replace

from cllm.engine.prefix_cache import common_packed_prefix, pack


@dataclass(slots=True, eq=False)
class HostEntry:
    """One evicted prefix: its tokens (positions 0..), how many of them were a prompt, and once
    the engine has copied it, the sequence state; for one in a file of the disk tier, where its
    state lies in the file and the state's checksum."""
    tokens: list[int]
    packed: bytes
    prompt_length: int
    data: object = None  # a buffer (Context.save_sequence: a memory map of its own)
    path: str | None = None
    offset: int = 0
    size: int = 0
    sha: str = ""


class HostTier:
    """Evicted prefixes in host RAM, at most `capacity` bytes of state (0: the tier is off),
    and with a disk tier attached, those in its files too. An entry whose tokens another entry
    starts with is redundant and dropped; an entry dropped for room while a load of it is
    pending stays alive in that load's `KvOp` until applied."""

    # Shorter prefixes cost less to compute than to look up and copy.
    MIN_TOKENS = 32

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[int, HostEntry] = OrderedDict()  # least recently used first
        self.bytes = 0
        self.cells = 0  # KV cells the stored entries hold
        self.saves = 0
        self.save_seconds = 0.0
        self.hits = 0  # prompts placed on an entry
        self.restores = 0  # entries loaded into a slot
        self.restore_seconds = 0.0
        self.restored_tokens = 0
        self.disk = None  # a kv_disk.DiskTier, where dropped entries go
        self._on_disk: list[HostEntry] = []  # its entries, state not read yet

    def attach_disk(self, disk) -> None:
        """Write what the tier drops to `disk`, and match prompts against its files too."""
        self.disk = disk
        self._on_disk = disk.scan()

    @property
    def disk_entries(self) -> int:
        return len(self._on_disk)

    @property
    def disk_cells(self) -> int:
        """KV cells the disk tier's files hold (those not read back into RAM)."""
        return sum(len(e.tokens) for e in self._on_disk)

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(self, tokens: list[int], prompt_length: int) -> HostEntry | None:
        """An entry for a prefix about to be evicted, for the engine to fill (`store`); None
        when the tier is off, the prefix is short or an entry holds it already."""
        if not (self.enabled or self.disk) or len(tokens) < self.MIN_TOKENS:
            return None
        packed = pack(tokens)
        for key, entry in self._entries.items():
            if entry.packed.startswith(packed):
                self._entries.move_to_end(key)  # in use again: as recent as a new copy
                return None
        for key in [k for k, e in self._entries.items() if packed.startswith(e.packed)]:
            self._drop(key)
        entry = HostEntry(tokens, packed, prompt_length)
        self._entries[id(entry)] = entry
        return entry

    def store(self, entry: HostEntry, data, seconds: float) -> None:
        """The engine copied `entry`'s state (in `seconds`)."""
        self.saves += 1
        self.save_seconds += seconds
        self._hold(entry, data)

    def _hold(self, entry: HostEntry, data) -> None:
        """`entry` holds `data` now; older entries go (to disk, if there is one) until the tier
        fits its budget, the new one too if alone it does not fit."""
        entry.data = data
        if id(entry) not in self._entries:
            return
        self.bytes += len(data)
        self.cells += len(entry.tokens)
        while self.bytes > self.capacity:
            self._drop(next(iter(self._entries)), to_disk=True)

    def match(self, packed_tokens: bytes) -> tuple[HostEntry | None, int]:
        """The entry sharing the longest prefix with a prompt, and how many tokens it shares."""
        best, best_len = None, 0
        for entry in (*self._entries.values(), *self._on_disk):
            n = common_packed_prefix(entry.packed, packed_tokens)
            if n > best_len:
                best, best_len = entry, n
        return best, best_len

    def hit(self, entry: HostEntry) -> bool:
        """A prompt will start from `entry`: it is the most recently used; one on disk is read
        into RAM first. False when its file is damaged or gone (then it is forgotten)."""
        if entry in self._on_disk:
            self._on_disk.remove(entry)
            if not self.disk.load(entry):
                return False
            self._entries[id(entry)] = entry
            self._hold(entry, entry.data)
        self.hits += 1
        if id(entry) in self._entries:
            self._entries.move_to_end(id(entry))
        return True

    def persist(self, entries) -> None:
        """A clean shutdown: write `entries` (the pool's prefixes) and every entry in RAM to
        the disk tier, oldest first, so that the newest survive its budget."""
        for entry in itertools.chain(list(self._entries.values()), entries):
            if entry.data is not None:
                self._to_disk(entry)

    def restored(self, tokens: int, seconds: float) -> None:
        self.restores += 1
        self.restored_tokens += tokens
        self.restore_seconds += seconds

    def _drop(self, key: int, to_disk: bool = False) -> None:
        entry = self._entries.pop(key)
        if entry.data is not None:
            self.bytes -= len(entry.data)
            self.cells -= len(entry.tokens)
            if to_disk:
                self._to_disk(entry)

    def _to_disk(self, entry: HostEntry) -> None:
        if self.disk is None:
            return
        # One read back from a file is there still (as long as the budget left it).
        on_file = entry.path is not None and os.path.exists(entry.path)
        written = replace(entry, data=None) if on_file else self.disk.write(entry)
        if written is not None:
            self._on_disk = [e for e in self._on_disk if e.path != written.path] + [written]


def default_cache_ram_mib() -> int:
    """--cache-ram when none is given: an eighth of the memory available now, at most 8 GiB
    (llama-server's default), so the tier never crowds out the pool or the rest of the machine."""
    try:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 0
    return min(8192, available // 8 // 2**20)
