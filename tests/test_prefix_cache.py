"""The prefix cache alone: matching, placement, cell counts of shared and copied prefixes."""
import random

import pytest

from cllm.prefix_cache import KvOp, PrefixCache, common_prefix


def no_live(slot):
    raise AssertionError("no slot is live in this test")


def run_sequence(cache, tokens, limit=None, computed=None):
    """Place a sequence, compute the rest of `tokens` and finish it; returns its placement."""
    placement = cache.place(tokens, len(tokens) - 1 if limit is None else limit, no_live)
    cache.start(placement)
    end = len(tokens) if computed is None else computed
    cache.extend(placement.dst, placement.length, end - placement.length)
    cache.finish(placement.dst, tokens[:end])
    return placement


@pytest.mark.parametrize("n", [0, 1, 7, 100, 4000])
def test_common_prefix_matches_a_plain_scan(n):
    rng = random.Random(n)
    a = [rng.randrange(5) for _ in range(n)]
    for cut in {0, n // 2, n}:
        b = a[:cut] + [9] + a[cut:]
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == expected == cut


def test_longest_prefix_wins_and_the_last_token_is_left_to_compute():
    cache = PrefixCache(4, shared_cells=True)
    doc = list(range(100, 200))
    run_sequence(cache, doc + [1, 2, 3])
    run_sequence(cache, [7] * 50)
    placement = cache.place(doc + [1, 2, 3], 102, no_live)
    assert placement.length == 102 and placement.src.tokens[:100] == doc
    assert cache.place([8, 8, 8], 2, no_live).length == 0


def test_a_shared_prefix_counts_its_cells_once():
    cache = PrefixCache(4, shared_cells=True)
    doc = list(range(1000))
    first = run_sequence(cache, doc + [1] * 10)
    assert cache.cells_used == 1010
    # Another slot starts from the document (the first keeps its own tail cached).
    second = cache.place(doc + [2] * 10, 1009, no_live)
    assert second.src is first.dst and second.length == 1000
    cache.REUSE_IN_PLACE = 1.0  # keep the first slot's content: take an empty slot
    second = cache.place(doc + [2] * 10, 1009, no_live)
    assert second.dst is not first.dst
    assert cache.start(second) == [KvOp("share", second.dst.id, first.dst.id, 1000)]
    cache.extend(second.dst, 1000, 10)
    assert cache.cells_used == 1020  # the document once, two tails
    cache.evict(first.dst)
    assert cache.cells_used == 1010  # the second slot still holds the document's cells
    cache.finish(second.dst, doc + [2] * 10)
    cache.evict(second.dst)
    assert cache.cells_used == 0


def test_split_streams_copy_a_shared_prefix():
    cache = PrefixCache(4, shared_cells=False)
    cache.REUSE_IN_PLACE = 1.0
    doc = list(range(500))
    run_sequence(cache, doc + [1])
    placement = cache.place(doc + [2], 500, no_live)
    cache.start(placement)
    assert placement.length == 500 and cache.cells_used == 1001  # a copy: its own cells


def test_reuse_in_place_trims_and_the_evicted_lru_goes_first():
    cache = PrefixCache(3, shared_cells=True)
    a, b, c = ([k] * 40 for k in (1, 2, 3))
    slots = [run_sequence(cache, t).dst for t in (a, b, c)]
    assert cache.eviction_order() == slots  # least recently used first
    again = cache.place(a[:30] + [9], 30, no_live)
    assert again.dst is again.src is slots[0]  # most of that slot is reused in place
    assert cache.start(again) == [KvOp("share", slots[0].id, slots[0].id, 30)]
    assert cache.cells_used == 30 + 40 + 40
    assert cache.eviction_order() == slots[1:]  # a live slot is never evicted


def test_no_idle_slot_means_no_placement():
    cache = PrefixCache(1, shared_cells=True)
    cache.start(cache.place([1, 2, 3], 2, no_live))
    assert cache.place([1, 2, 3], 2, lambda slot: ([1, 2, 3], 3)) is None


def test_live_slots_share_only_what_they_computed():
    cache = PrefixCache(2, shared_cells=True)
    first = cache.place(list(range(300)), 299, no_live)
    cache.start(first)
    cache.extend(first.dst, 0, 128)
    src, length = cache.best_match(list(range(300)), 299, lambda slot: (list(range(300)), 128))
    assert src is first.dst and length == 128


def test_cache_off_clears_what_a_sequence_leaves():
    cache = PrefixCache(2, shared_cells=True, enabled=False)
    placement = cache.place([5] * 20, 19, no_live)
    cache.start(placement)
    cache.extend(placement.dst, 0, 20)
    assert cache.finish(placement.dst, [5] * 20) == [KvOp("clear", placement.dst.id)]
    assert cache.cells_used == 0 and cache.place([5] * 20, 19, no_live).length == 0


def test_counts_stay_exact_under_churn():
    """Random sequences over a few shared prefixes: the count equals the cells a model of
    llama.cpp's cells (position -> set of holders, per group) holds."""
    rng = random.Random(1)
    cache = PrefixCache(6, shared_cells=True)
    prefixes = [[p] * 30 + list(range(p * 100, p * 100 + 20)) for p in range(3)]
    for i in range(300):
        tokens = rng.choice(prefixes)[:rng.randrange(1, 50)] + [rng.randrange(10) for _ in range(5)]
        placement = cache.place(tokens, len(tokens) - 1, no_live)
        cache.start(placement)
        cache.extend(placement.dst, placement.length, len(tokens) - placement.length)
        cache.finish(placement.dst, tokens)
        if rng.random() < 0.2 and cache.eviction_order():
            cache.evict(cache.eviction_order()[0])
        held = {(run.group, pos) for slot in cache.slots for run in slot.runs
                for pos in range(run.start, run.end)}
        assert cache.cells_used == len(held)
        assert all(slot.length == sum(r.end - r.start for r in slot.runs) for slot in cache.slots)


def test_with_blocks_a_prefix_ends_on_a_block_or_in_both_prompts_last_partial_block():
    cache = PrefixCache(4, shared_cells=False, block=64)
    doc = list(range(1000, 1140))
    held = doc + [1] * 10  # a 150-token prompt, then 10 generated tokens
    slot = cache.place(held, 149, no_live).dst
    cache.start(cache.place(held, 149, no_live))
    cache.extend(slot, 0, 160)
    cache.finish(slot, held + [7] * 10, prompt_length=150)
    same_last_block = doc + [2] * 10  # 150 tokens: its last partial block starts at 128 too
    assert cache.best_match(same_last_block, 149, no_live) == (slot, 140)
    longer = doc + [2] * 160  # 300 tokens: 128..140 would be part of a whole block of it
    assert cache.best_match(longer, 299, no_live) == (slot, 128)
    assert cache.best_match(doc[:100] + [3] * 50, 149, no_live) == (slot, 64)
