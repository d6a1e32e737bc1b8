"""The disk tier under the host-RAM tier: copies of prefixes' KV in files of a folder
(--cache-dir), up to a byte budget (--cache-disk), oldest files removed first. The RAM tier
writes there what it drops for room, and the engine writes every cached prefix there on a clean
shutdown, so that a restarted server starts the next turn of a conversation from its history
(docs/design/kv-tiers.md).

A file holds a header (what produced it, its tokens' count, a SHA-256 of tokens and state),
the tokens and the state. A file whose header does not match this server (another model file,
KV layout, build of the core and so llama.cpp), or that is truncated or corrupt, is removed and
never loaded."""
from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import time
from array import array
from pathlib import Path

from cllm.engine.kv_tiers import HostEntry

log = logging.getLogger(__name__)

MAGIC = b"cllm-kv 1\n"
SUFFIX = ".kv"
_SAMPLE = 16 * 2**20  # bytes of a model file's head and tail that identify it


def file_fingerprint(path: str) -> str:
    """A SHA-256 of a file's size, first and last 16 MiB: it tells model files apart without
    reading gigabytes at every start."""
    digest = hashlib.sha256()
    size = os.path.getsize(path)
    digest.update(str(size).encode())
    with open(path, "rb") as f:
        digest.update(f.read(_SAMPLE))
        f.seek(max(0, size - _SAMPLE))
        digest.update(f.read(_SAMPLE))
    return digest.hexdigest()


def _checksum(tokens: bytes, data) -> str:
    digest = hashlib.sha256(tokens)
    digest.update(data)
    return digest.hexdigest()


class DiskTier:
    """Entry files in `directory`, bound to `identity` (a dict of what produced them)."""

    def __init__(self, directory: str, capacity: int, identity: dict) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.capacity = capacity
        self.identity = identity
        self.written = 0
        self.read = 0
        self.read_seconds = 0.0  # reading files back and checking them, on the engine thread
        self.removed = 0  # files refused: foreign, truncated or corrupt

    def scan(self) -> list[HostEntry]:
        """The entries of the folder's files that match this server, oldest first; every other
        file of ours is removed."""
        entries = []
        for path in sorted(self.directory.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime):
            entry = self._read_header(path)
            if entry is None:
                self._remove(path, "does not match this server or is damaged")
            else:
                entries.append(entry)
        return entries

    def load(self, entry: HostEntry) -> bool:
        """Read `entry`'s state into memory, checked against its checksum; False (and the file
        removed) when it is damaged or gone."""
        started = time.perf_counter()
        try:
            with open(entry.path, "rb") as f:
                f.seek(entry.offset)
                data = mmap.mmap(-1, entry.size)
                if f.readinto(data) != entry.size or _checksum(entry.packed, data) != entry.sha:
                    raise ValueError("the state does not match its checksum")
        except (OSError, ValueError) as exc:
            self._remove(Path(entry.path), str(exc))
            return False
        entry.data = data
        self.read += 1
        self.read_seconds += time.perf_counter() - started
        return True

    def write(self, entry: HostEntry) -> HostEntry | None:
        """Write `entry` (its state in memory) to a file of its own, then remove the oldest
        files beyond the budget; the entry as the file holds it (no state in memory), or None
        if it could not be written."""
        sha = _checksum(entry.packed, entry.data)
        header = dict(self.identity, tokens=len(entry.tokens), prompt_length=entry.prompt_length,
                      size=len(entry.data), sha256=sha)
        prefix = MAGIC + json.dumps(header).encode() + b"\n"
        name = hashlib.sha256(entry.packed).hexdigest()[:32] + SUFFIX
        path, temporary = self.directory / name, self.directory / (name + ".part")
        try:
            with open(temporary, "wb") as f:
                f.write(prefix)
                f.write(entry.packed)
                f.write(entry.data)
            os.replace(temporary, path)
        except OSError as exc:
            log.warning("KV cache file %s not written: %s", path, exc)
            temporary.unlink(missing_ok=True)
            return None
        self.written += 1
        self._fit()
        return HostEntry(entry.tokens, entry.packed, entry.prompt_length, path=str(path),
                         offset=len(prefix) + len(entry.packed), size=len(entry.data), sha=sha)

    def _read_header(self, path: Path) -> HostEntry | None:
        try:
            with open(path, "rb") as f:
                if f.read(len(MAGIC)) != MAGIC:
                    return None
                header = json.loads(f.readline(4096))
                if {k: header.get(k) for k in self.identity} != self.identity:
                    return None
                tokens = array("i")
                tokens.frombytes(f.read(header["tokens"] * tokens.itemsize))
                offset = f.tell()
            if (len(tokens) != header["tokens"]
                    or path.stat().st_size != offset + header["size"]):
                return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return HostEntry(tokens.tolist(), tokens.tobytes(), header["prompt_length"],
                         path=str(path), offset=offset, size=header["size"],
                         sha=header["sha256"])

    def _fit(self) -> None:
        files = sorted(self.directory.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for path in files:
            if total <= self.capacity:
                break
            total -= path.stat().st_size
            path.unlink(missing_ok=True)

    def _remove(self, path: Path, why: str) -> None:
        log.warning("KV cache file %s removed: %s", path, why)
        path.unlink(missing_ok=True)
        self.removed += 1
