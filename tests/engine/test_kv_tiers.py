"""The host-RAM tier under the prefix cache, with the real default model: prefixes evicted from
the KV cache are saved to host memory and loaded back, replies stay the same, the budget holds."""
import asyncio
import os

import pytest
from engine_checks import assert_idle, run_tokens

from cllm.config import EngineConfig
from cllm.engine.engine import Engine
from cllm.engine.kv_tiers import HostTier, default_cache_ram_mib
from cllm.engine.prefix_cache import pack

STORY = ("Once upon a time, in a village between two rivers, there lived a clockmaker who "
         "repaired every clock in the valley except his own. ")


def document(model, i, repeats=8):
    """A prompt of a few hundred tokens, distinct from the first token on for each `i`."""
    return model.tokenize(f"{chr(ord('A') + i % 26)}{i}. " + STORY * repeats, add_special=False)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture(scope="module")
def split_engine(model_path):
    # One split stream: each new prompt evicts what the last one left.
    eng = Engine(EngineConfig(n_ctx=2048, n_parallel=1, n_threads=2, kv_unified=False,
                              cache_ram=64), model_path)
    yield eng
    eng.shutdown()


def test_an_evicted_prefix_comes_back_from_ram_with_the_reply_computed_from_scratch(split_engine):
    eng, tier = split_engine, split_engine.host_tier
    first = document(eng.model, 1)
    _, reply, _ = asyncio.run(run_tokens(eng, first, max_tokens=8, temperature=0))
    asyncio.run(run_tokens(eng, document(eng.model, 2), max_tokens=8, temperature=0))  # evicts the first
    assert tier.saves >= 1 and len(tier) >= 1
    restores = tier.restores
    follow_up = first + reply + eng.model.tokenize(" And then?", add_special=False)
    _, restored, final = asyncio.run(run_tokens(eng, follow_up, max_tokens=16, temperature=0))
    assert tier.restores == restores + 1
    assert final.cached_tokens >= len(first) - 64  # all but the last partial block, or so
    _, scratch, fresh = asyncio.run(run_tokens(eng, follow_up, cache_prompt=False, max_tokens=16, temperature=0))
    assert fresh.cached_tokens == 0
    assert restored == scratch
    assert_idle(eng)


def test_ram_stays_within_cache_ram_under_churn(model_path):
    cap_mib = 16  # two of these prompts' KV
    eng = Engine(EngineConfig(n_ctx=2048, n_parallel=1, n_threads=2, kv_unified=False,
                              cache_ram=cap_mib), model_path)
    try:
        churn = [document(eng.model, i) for i in range(16)]
        asyncio.run(run_tokens(eng, document(eng.model, 100), max_tokens=2, temperature=0))
        start = rss_bytes()
        for tokens in churn[:4]:  # the tier fills
            asyncio.run(run_tokens(eng, tokens, max_tokens=2, temperature=0))
        full = rss_bytes()
        for tokens in churn[4:]:  # and churns: every prompt evicts the one before
            asyncio.run(run_tokens(eng, tokens, max_tokens=2, temperature=0))
            assert eng.host_tier.bytes <= cap_mib * 2**20
        assert len(eng.host_tier) >= 1 and eng.host_tier.saves >= len(churn)
        print(f"RSS: +{(full - start) / 2**20:.1f} MiB filling, "
              f"+{(rss_bytes() - full) / 2**20:.1f} MiB churning")
        assert rss_bytes() - start <= 1.05 * cap_mib * 2**20
    finally:
        eng.shutdown()


def test_one_pool_saves_what_it_evicts_for_room_and_loads_it_back(model_path):
    eng = Engine(EngineConfig(n_ctx=1024, n_parallel=2, n_threads=2, kv_unified=True,
                              cache_ram=64), model_path)
    try:
        first = document(eng.model, 1, repeats=12)
        asyncio.run(run_tokens(eng, first, max_tokens=4, temperature=0))
        for i in (2, 3, 4):  # each takes a third of the pool: the first is evicted for room
            later = document(eng.model, i, repeats=12)
            asyncio.run(run_tokens(eng, later, max_tokens=4, temperature=0))
        assert eng.host_tier.saves >= 1
        _, _, final = asyncio.run(run_tokens(eng, first + first[:8], max_tokens=4, temperature=0))
        assert eng.host_tier.restores == 1
        assert final.cached_tokens >= len(first) - 1 - 32
        assert_idle(eng)
    finally:
        eng.shutdown()


def test_the_tier_keeps_no_copy_of_a_prefix_it_holds_and_drops_those_a_longer_one_covers():
    tier = HostTier(2**20)
    short = tier.reserve(list(range(40)), 40)
    tier.store(short, b"x" * 1000, 0.0)
    assert tier.reserve(list(range(40)), 40) is None  # held already
    longer = tier.reserve(list(range(80)), 40)
    tier.store(longer, b"y" * 2000, 0.0)
    assert len(tier) == 1 and tier.bytes == 2000 and tier.cells == 80
    entry, n = tier.match(pack(list(range(50)) + [999]))
    assert entry is longer and n == 50


def test_the_budget_drops_the_least_recently_used_and_a_short_prefix_is_not_kept():
    tier = HostTier(2500)
    assert tier.reserve(list(range(HostTier.MIN_TOKENS - 1)), 10) is None
    entries = [tier.reserve([i] + list(range(40)), 40) for i in range(3)]
    for entry in entries:
        tier.store(entry, b"z" * 1000, 0.0)
    assert len(tier) == 2 and tier.bytes == 2000
    assert entries[0].data is not None  # a pending load keeps its copy though it was dropped
    assert tier.match(entries[0].packed)[0] is not entries[0]


def test_default_cache_ram_is_a_share_of_free_memory():
    assert 0 < default_cache_ram_mib() <= 8192
    assert HostTier(0).reserve(list(range(100)), 100) is None
