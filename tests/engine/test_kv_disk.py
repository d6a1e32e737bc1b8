"""The disk tier with the real default model: cached prefixes written on a clean shutdown and
loaded by the next server, files that are foreign, truncated or corrupt removed, never loaded."""
import asyncio
import json

import pytest
from engine_checks import assert_idle, run_tokens

from cllm.config import EngineConfig
from cllm.engine.engine import Engine
from cllm.engine.kv_disk import MAGIC, SUFFIX

HISTORY = ("Once upon a time, in a village between two rivers, there lived a clockmaker who "
           "repaired every clock in the valley except his own. ") * 8


def engine(model_path, folder, cache_ram=64):
    return Engine(EngineConfig(n_ctx=2048, n_parallel=1, n_threads=2, kv_unified=False,
                               cache_ram=cache_ram, cache_dir=str(folder)), model_path)


def files(folder):
    return sorted(folder.glob("*" + SUFFIX))


def copy_of(conversation, tmp_path):
    """The conversation's files in a folder of the test's own (a server adds its own at
    shutdown)."""
    for path in files(conversation[0]):
        (tmp_path / path.name).write_bytes(path.read_bytes())
    return tmp_path


@pytest.fixture(scope="module")
def conversation(model_path, tmp_path_factory):
    """A first turn computed by a server that then shut down: (folder, its tokens, the reply
    greedy decoding gives the next turn from scratch)."""
    folder = tmp_path_factory.mktemp("kv")
    first = engine(model_path, folder)
    try:
        turn = first.model.tokenize(HISTORY, add_special=False)
        _, reply, _ = asyncio.run(run_tokens(first, turn, max_tokens=8, temperature=0))
        follow_up = turn + reply + first.model.tokenize(" And then?", add_special=False)
        # Computed from scratch in the only slot: the first turn goes to RAM, and the slot is
        # left empty (cache_prompt=False); the shutdown writes the RAM entry.
        _, scratch, _ = asyncio.run(run_tokens(first, follow_up, cache_prompt=False,
                                               max_tokens=12, temperature=0))
    finally:
        first.shutdown()
    return folder, follow_up, scratch


def test_a_restarted_server_goes_on_from_the_history_it_wrote_at_shutdown(model_path,
                                                                          conversation, tmp_path):
    _, follow_up, scratch = conversation
    folder = copy_of(conversation, tmp_path)
    assert len(files(folder)) == 1
    second = engine(model_path, folder)
    try:
        assert second.host_tier.disk_entries == 1
        _, reply, final = asyncio.run(run_tokens(second, follow_up, max_tokens=12,
                                                 temperature=0))
        assert second.host_tier.restores == 1 and second.host_tier.disk.read == 1
        assert final.cached_tokens >= len(follow_up) - 64
        assert reply == scratch
        assert_idle(second)
    finally:
        second.shutdown()


def rewrite_header(path, **changes):
    data = path.read_bytes()
    header_end = data.index(b"\n", len(MAGIC)) + 1
    header = json.loads(data[len(MAGIC):header_end])
    header.update(changes)
    path.write_bytes(MAGIC + json.dumps(header).encode() + b"\n" + data[header_end:])


def damage(folder, how):
    [path] = files(folder)
    if how == "foreign model":
        rewrite_header(path, model="0" * 64)
    elif how == "other layout":
        rewrite_header(path, kv_unified=True)
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:-1000])
    elif how == "not ours":
        path.write_bytes(b"GGUF" + bytes(5000))
    return path


@pytest.mark.parametrize("how", ["foreign model", "other layout", "truncated", "not ours"])
def test_a_file_that_does_not_match_or_is_damaged_is_removed_at_start(model_path, conversation,
                                                                      tmp_path, how):
    _, follow_up, scratch = conversation
    path = damage(copy_of(conversation, tmp_path), how)
    server = engine(model_path, tmp_path)
    try:
        assert server.host_tier.disk_entries == 0 and server.host_tier.disk.removed == 1
        assert not path.exists()
        _, reply, final = asyncio.run(run_tokens(server, follow_up, max_tokens=12,
                                                 temperature=0))
        assert server.host_tier.restores == 0 and final.cached_tokens == 0
        assert reply == scratch
    finally:
        server.shutdown()


def test_a_corrupt_state_is_found_by_its_checksum_and_never_loaded(model_path, conversation,
                                                                  tmp_path):
    _, follow_up, scratch = conversation
    [path] = files(copy_of(conversation, tmp_path))
    data = bytearray(path.read_bytes())
    data[-5000] ^= 0xFF  # inside one layer's K or V rows: only the checksum can tell
    path.write_bytes(bytes(data))
    server = engine(model_path, tmp_path)
    try:
        assert server.host_tier.disk_entries == 1  # its header is sound
        _, reply, final = asyncio.run(run_tokens(server, follow_up, max_tokens=12,
                                                 temperature=0))
        assert server.host_tier.restores == 0 and server.host_tier.disk.removed == 1
        assert not path.exists() and final.cached_tokens == 0
        assert reply == scratch
    finally:
        server.shutdown()


def test_the_files_stay_within_cache_disk_and_ram_drops_go_to_disk(model_path, tmp_path):
    # No RAM: every evicted prefix goes straight to a file; 12 MiB hold two of them (~5 MiB).
    server = Engine(EngineConfig(n_ctx=2048, n_parallel=1, n_threads=2, kv_unified=False,
                                 cache_ram=0, cache_dir=str(tmp_path), cache_disk=12),
                    model_path)
    try:
        for name in ("Ann", "Bob", "Cyd", "Dee"):
            tokens = server.model.tokenize(name + HISTORY, add_special=False)
            asyncio.run(run_tokens(server, tokens, max_tokens=2, temperature=0))
        assert server.host_tier.bytes == 0 and server.host_tier.disk.written == 3
        assert len(files(tmp_path)) == 2  # the oldest went
        assert sum(p.stat().st_size for p in tmp_path.iterdir()) <= 12 * 2**20
    finally:
        server.shutdown()
