"""The prefix cache alone: matching, placement, cell counts of shared and copied prefixes, what
goes to and comes from the host tier."""
import random
from dataclasses import replace

import pytest

from cllm.engine.kv_tiers import HostTier
from cllm.engine.prefix_cache import (
    KvOp,
    Placement,
    PrefixCache,
    Retention,
    common_packed_prefix,
    pack,
)


def no_live(slot):
    raise AssertionError("no slot is live in this test")


def run_sequence(cache, tokens, limit=None, computed=None, reply=()):
    """Place a sequence of prompt `tokens`, compute the rest of them and the `reply`, and finish
    it; returns its placement."""
    placement = cache.place(tokens, len(tokens) - 1 if limit is None else limit, no_live)
    cache.start(placement)
    end = len(tokens) if computed is None else computed
    computed_tokens = tokens[:end] + list(reply)
    cache.extend(placement.dst, placement.length, len(computed_tokens) - placement.length)
    cache.finish(placement.dst, computed_tokens, prompt_length=end)
    return placement


@pytest.mark.parametrize("n", [0, 1, 7, 100, 4000])
def test_common_packed_prefix_matches_a_plain_scan(n):
    rng = random.Random(n)
    a = [rng.randrange(5) for _ in range(n)]
    for cut in {0, n // 2, n}:
        b = a[:cut] + [9] + a[cut:]
        expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_packed_prefix(pack(a), pack(b)) == expected == cut


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


def nothing_computed(slot):
    return [], 0


@pytest.mark.parametrize("shared_cells", [False, True])
def test_a_new_sequence_takes_an_empty_slot_and_keeps_what_a_finished_one_left(shared_cells):
    """With split streams too: llama.cpp decodes a step's streams in one pass whatever idle
    streams lie between them (vendor/patches/llama-kv-split-stream-gaps.patch), so where a
    slot lies costs nothing."""
    cache = PrefixCache(6, shared_cells=shared_cells)
    live = []
    for k in range(3):
        placement = cache.place([k] * 8, 7, nothing_computed)
        cache.start(placement)
        live.append(placement.dst)
    assert [slot.id for slot in live] == [0, 1, 2]
    cache.extend(live[1], 0, 8)
    cache.finish(live[1], [1] * 8)
    assert cache.place([9] * 8, 7, nothing_computed).dst.id == 3


@pytest.mark.parametrize("shared_cells", [False, True])
def test_the_same_prompt_again_takes_its_slot_in_place_though_its_reply_is_longer(shared_cells):
    cache = PrefixCache(4, shared_cells=shared_cells)
    first = run_sequence(cache, [5] * 10, reply=[7] * 50).dst
    again = cache.place([5] * 10, 9, no_live)
    assert again.dst is again.src is first and again.length == 9
    # A prompt that has only part of it goes to another slot, which keeps the reply.
    other = cache.place([5] * 8 + [6, 6], 9, no_live)
    assert other.src is first and other.dst is not first and other.length == 8


@pytest.mark.parametrize("shared_cells", [False, True])
def test_a_prompt_cached_apart_from_the_running_ones_is_taken_over_where_it_lies(shared_cells):
    cache = PrefixCache(8, shared_cells=shared_cells)
    prompts = [[k] * 10 for k in range(1, 6)]
    for prompt in prompts:  # idle slots 0..4, each holding its prompt
        run_sequence(cache, prompt, computed=10, reply=[7] * 20)
    cache.evict(cache.slots[1])
    cache.start(cache.place(prompts[0], 9, nothing_computed))
    again = cache.place(prompts[3], 9, nothing_computed)
    assert again.src is again.dst and again.dst.id == 3 and again.length == 9


def test_split_streams_continue_a_conversation_in_its_slot_and_keep_the_others():
    """A conversation continues in its own slot; the idle slots between running ones keep
    theirs (64 conversations over 64 streams once kept evicting each other when placement
    copied conversations to join the running streams)."""
    cache = PrefixCache(8, shared_cells=False)
    chats = [[k] * 10 for k in range(1, 7)]
    for chat in chats:  # idle slots 0..5, each holding its conversation
        run_sequence(cache, chat, computed=10, reply=[7] * 20)
    for slot_id in (0, 1, 3):  # other sequences run in slots 0, 1 and 3
        cache.start(Placement(cache.slots[slot_id], None, 0))
    turn = cache.place(chats[4] + [7] * 20 + [8] * 5, 30, nothing_computed)
    assert turn.dst is turn.src and turn.dst.id == 4 and turn.length == 30
    assert cache.slots[2].tokens[:10] == chats[2]  # the gap keeps its conversation


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


def test_a_prefix_shared_into_another_slot_counts_as_used_for_eviction():
    cache = PrefixCache(4, shared_cells=True)
    cache.REUSE_IN_PLACE = 1.0  # every request takes a slot of its own
    doc, other = list(range(100, 200)), [7] * 40
    source = run_sequence(cache, doc + [1]).dst
    older_than_use = run_sequence(cache, other).dst
    asker = run_sequence(cache, doc + [2])
    assert asker.src is source
    assert cache.eviction_order() == [older_than_use, source, asker.dst]


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
        assert all(slot.cached == sum(r.end - r.start for r in slot.runs) <= len(slot.tokens)
                   for slot in cache.slots)


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


def one_shot(cache, n, reply_token=7, first=0):
    """`n` requests with prompts of their own, each with a 50-token reply."""
    for i in range(first, first + n):
        run_sequence(cache, [1000 + i] * 20, reply=[reply_token] * 50)


def test_in_one_pool_one_shot_requests_leave_only_their_prompts_cells():
    cache = PrefixCache(8, shared_cells=True)
    one_shot(cache, 1)
    # It finished before any admission could have continued a reply: no evidence, so it keeps
    # its reply ...
    assert [(s.cached, len(s.tokens)) for s in cache.slots if s.tokens] == [(70, 70)]
    one_shot(cache, 3, first=1)
    # ... until the next ones continue none: then every slot holds its 20 prompt cells only, and
    # remembers its reply's tokens.
    assert cache.cells_used == 4 * 20
    assert [(s.cached, len(s.tokens)) for s in cache.slots if s.tokens] == [(20, 70)] * 4


def test_replies_that_come_back_are_noticed_though_dropped_and_kept_again():
    cache = PrefixCache(8, shared_cells=True)
    one_shot(cache, 6)
    turn_1 = next(s for s in cache.slots if s.tokens and s.cached < len(s.tokens)).tokens
    # A chat's next turn (the whole first one, and more) finds only the prompt's cells ...
    turn_2 = turn_1 + [5] * 10
    assert run_sequence(cache, turn_2, reply=[6] * 50).length == 20
    # ... but counts: two continuations in the seven admissions that had a finished sequence
    # to continue (more than a quarter) keep replies again,
    # and the turn after the next one starts from the whole of it.
    turn_3 = turn_2 + [6] * 50 + [4] * 10
    run_sequence(cache, turn_3, reply=[3] * 5)
    turn_4 = turn_3 + [3] * 5 + [2] * 10
    assert run_sequence(cache, turn_4).length == len(turn_3) + 5


def test_split_streams_keep_replies_and_prompts_whatever_comes_back():
    cache = PrefixCache(64, shared_cells=False)
    one_shot(cache, 40)  # in one pool the last of them would leave nothing cached
    assert all(s.cached == len(s.tokens) for s in cache.slots)


def distinct_prompts(cache, n, first=0):
    """`n` requests, each with a 40-token prompt of its own and a 10-token reply."""
    for i in range(first, first + n):
        run_sequence(cache, [2000 + i] * 40, reply=[7] * 10)


def held_prompts(cache):
    return [s.cached for s in sorted(cache.slots, key=lambda s: s.last_used) if s.tokens]


def test_in_one_pool_distinct_prompts_leave_no_cells_once_a_window_of_them_reused_none():
    cache = PrefixCache(64, shared_cells=True, replies="drop")
    distinct_prompts(cache, 32)
    # The first admission had nothing finished to reuse, so only the next 31 count: fewer than
    # the window of 32, so every prompt stays, as on a fresh server ...
    assert held_prompts(cache) == [40] * 32
    distinct_prompts(cache, 8, first=32)
    # ... and once the window is full of requests that reused none, the prompts kept before go
    # too; every slot still remembers its tokens.
    assert held_prompts(cache) == [0] * 40 and cache.cells_used == 0
    assert all(len(s.tokens) == 50 for s in cache.slots if s.tokens)


@pytest.mark.parametrize("shared, kept", [(100, 100), (20, 0)])
def test_a_dropped_prompt_keeps_a_long_prefix_it_found_cached(shared, kept):
    """Prompts dropped on the evidence (distinct ones): a document that the next request took
    from a running one stays cached after both ended, a short shared prefix does not."""
    cache = PrefixCache(64, shared_cells=True, replies="drop")
    distinct_prompts(cache, 40)
    assert not cache.prompts.keeps
    doc = list(range(5000, 5000 + shared))
    first = cache.place(doc + [1] * 30, shared + 29, no_live)
    cache.start(first)
    cache.extend(first.dst, 0, shared + 30)
    second = cache.place(doc + [2] * 30, shared + 29,
                         lambda slot: (doc + [1] * 30, shared + 30))
    assert second.src is first.dst and second.length == shared
    cache.start(second)
    cache.extend(second.dst, shared, 30)
    cache.finish(first.dst, doc + [1] * 30)
    cache.finish(second.dst, doc + [2] * 30)
    assert cache.place(doc + [3] * 30, shared + 29, no_live).length == kept
    assert cache.cells_used == kept


def test_a_prompt_resumed_from_its_own_cells_is_no_prefix_found_cached():
    """A sequence with a prompt of its own, preempted and resumed from its slot, then ended
    while prompts are dropped: nothing it computed itself stays cached."""
    cache = PrefixCache(64, shared_cells=True, replies="drop")
    distinct_prompts(cache, 40)
    prompt = [9] * 40
    first = cache.place(prompt, 39, no_live)
    cache.start(first)
    cache.extend(first.dst, 0, 45)
    cache.finish(first.dst, prompt + [7] * 5, prompt_length=40, resuming="seq")
    resumed = cache.place(prompt + [7] * 5, 44, no_live)
    assert resumed.src is first.dst and resumed.length == 44
    cache.start(resumed, resuming="seq")
    cache.extend(resumed.dst, 44, 6)
    cache.finish(resumed.dst, prompt + [7] * 10, prompt_length=40)
    assert resumed.dst.cached == 0 and cache.cells_used == 0


def test_idle_prompts_that_come_back_are_noticed_though_dropped_and_kept_again():
    cache = PrefixCache(64, shared_cells=True, replies="drop")
    distinct_prompts(cache, 40)
    dropped = [s.tokens[:40] for s in cache.slots if s.tokens and not s.cached]
    for prompt in dropped[:7]:  # each finds nothing cached, but would have: counted ...
        assert run_sequence(cache, prompt + [1, 2]).length == 0
    assert not cache.prompts.keeps
    run_sequence(cache, dropped[7] + [1, 2])  # ... eight in the last 32 keep prompts again
    assert cache.prompts.keeps and held_prompts(cache)[-1] == 42
    assert run_sequence(cache, dropped[7] + [1, 2, 3]).length == 42


def test_a_prompt_a_running_sequence_holds_is_no_reason_to_keep_idle_ones():
    cache = PrefixCache(4, shared_cells=True)
    doc = list(range(100, 200))
    run_sequence(cache, doc + [1])  # idle now, holding the document
    question = doc + [2, 3]
    assert cache.place(question, 101, no_live).reuses_idle_prompt
    cache.REUSE_IN_PLACE = 1.0  # the next one starts in another slot: the first stays idle
    cache.start(cache.place(doc + [4], 100, no_live))
    running = lambda slot: (doc + [4], 101)  # ... beside a live one holding the document too
    placement = cache.place(question, 101, running)
    assert placement.length == 100 and not placement.reuses_idle_prompt
    # Only a gain of IDLE_PROMPT_GAIN tokens or more over the running ones counts.
    running = lambda slot: (doc[:100 - cache.IDLE_PROMPT_GAIN] + [4], 101)
    assert cache.place(question, 101, running).reuses_idle_prompt
    running = lambda slot: (doc[:101 - cache.IDLE_PROMPT_GAIN] + [4], 101)
    assert not cache.place(question, 101, running).reuses_idle_prompt


def preempted_in_one_pool(cache):
    """A sequence preempted after 20 prompt tokens and 10 of output while replies are dropped
    (its admission continued nothing); its slot."""
    one_shot(cache, 1)  # something finished: the next admission counts
    placement = cache.place([1] * 20, 19, no_live)
    cache.start(placement)
    cache.extend(placement.dst, 0, 30)
    cache.finish(placement.dst, [1] * 20 + [2] * 10, prompt_length=20, resuming="seq")
    assert not cache.replies.keeps and placement.dst.cached == 30
    return placement.dst


def test_a_preempted_sequence_keeps_its_output_and_resuming_is_no_reply_coming_back():
    cache = PrefixCache(4, shared_cells=True)
    slot = preempted_in_one_pool(cache)
    one_shot(cache, 1, first=1)  # another ends while replies are dropped: nothing to resume from
    assert slot.cached == 30
    resumed = cache.place([1] * 20 + [2] * 10, 29, no_live)
    assert resumed.length == 29 and resumed.continues_reply  # it runs into its own output ...
    cache.start(resumed, resuming="seq")
    assert not cache.replies.keeps  # ... which does not count as a reply reused


def test_a_preempted_sequence_that_ends_while_it_waits_leaves_only_what_the_rules_keep():
    cache = PrefixCache(4, shared_cells=True)
    slot = preempted_in_one_pool(cache)
    assert cache.abandon("another") == [] and slot.cached == 30
    assert cache.abandon("seq") == [KvOp("share", slot.id, slot.id, 20)]
    assert slot.cached == 20 and slot.resuming is None


def test_a_preempted_sequence_resumed_in_another_slot_leaves_its_old_one_to_the_rules():
    cache = PrefixCache(4, shared_cells=True)
    slot = preempted_in_one_pool(cache)
    resumed = cache.place([1] * 20 + [2] * 10, 29, no_live)
    assert resumed.src is slot
    ops = cache.start(replace(resumed, dst=cache.slots[3]), resuming="seq")
    assert ops == [KvOp("share", 3, slot.id, 29), KvOp("share", slot.id, slot.id, 20)]
    assert slot.cached == 20 and slot.resuming is None
    assert cache.cells_used == 20 + 29  # the first one-shot's prompt; the cells both share


def test_a_preempted_sequence_resumed_without_the_cache_leaves_its_old_slot_to_the_rules():
    cache = PrefixCache(4, shared_cells=True)
    slot = preempted_in_one_pool(cache)
    resumed = cache.place([1] * 20 + [2] * 10, 0, no_live)  # cache_prompt: false
    assert resumed.src is None and resumed.dst is not slot
    assert cache.start(resumed, resuming="seq")[1:] == [KvOp("share", slot.id, slot.id, 20)]
    assert slot.cached == 20 and slot.resuming is None


@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_a_fixed_mode_for_prompts_decides_whatever_comes_back(mode):
    cache = PrefixCache(64, shared_cells=True, prompts=mode, replies="drop")
    distinct_prompts(cache, 40)  # auto would keep them all until the 33rd, then drop them all
    assert held_prompts(cache) == [40 if mode == "keep" else 0] * 40


@pytest.mark.parametrize("mode", ["keep", "drop"])
def test_a_fixed_mode_decides_whatever_comes_back(mode):
    cache = PrefixCache(8, shared_cells=True, replies=mode)
    one_shot(cache, 4)  # none continues a reply: auto would drop them
    for _ in range(8):  # each continues the last: auto would keep them
        last = max(cache.slots, key=lambda s: s.last_used)
        run_sequence(cache, last.tokens + [5], reply=[7] * 50)
    held = [s for s in cache.slots if s.tokens]
    assert len(held) == 4 and all(
        s.cached == (len(s.tokens) if mode == "keep" else s.prompt_length) for s in held)


@pytest.mark.parametrize("admissions, keeps", [
    ("", True), ("-", False), ("---c", True), ("----c", False),
    ("c" * 8 + "-" * 24, True), ("c" * 8 + "-" * 25, False)])  # the window holds the last 32
def test_auto_keeps_replies_while_a_quarter_of_recent_admissions_continue_one(admissions, keeps):
    retention = Retention("auto")
    for admission in admissions:
        retention.admitted(admission == "c")
    assert retention.keeps is keeps


@pytest.mark.parametrize("admissions, keeps", [
    ("-" * 31, True), ("-" * 32, False), ("c" * 8 + "-" * 24, True), ("c" * 7 + "-" * 25, False)])
def test_auto_with_a_minimum_of_admissions_keeps_until_it_has_seen_them(admissions, keeps):
    retention = Retention("auto", min_admissions=32)
    for admission in admissions:
        retention.admitted(admission == "c")
    assert retention.keeps is keeps


def test_with_a_host_tier_an_evicted_prefix_is_saved_first_and_loaded_back_for_a_longer_match():
    host = HostTier(2**30)
    cache = PrefixCache(1, shared_cells=False, host=host)
    history = list(range(1, 101))
    run_sequence(cache, history)
    placement = cache.place(list(range(500, 600)), 99, no_live)  # takes the only slot
    ops = cache.start(placement)
    assert [op.kind for op in ops] == ["save", "clear"]
    assert ops[0].entry.tokens == history and len(host) == 1
    host.store(ops[0].entry, b"state", 0.0)  # as the engine does
    cache.extend(placement.dst, 0, 100)
    cache.finish(placement.dst, list(range(500, 600)))
    follow_up = history + [7, 8, 9]
    placement = cache.place(follow_up, len(follow_up) - 1, no_live)
    assert placement.restore is ops[0].entry and placement.length == 100
    ops = cache.start(placement)
    assert [op.kind for op in ops] == ["save", "load"] and ops[1].length == 100
    assert placement.dst.cached == 100 and cache.cells_used == 100 and host.hits == 1


def test_a_short_gain_over_the_slots_is_computed_not_loaded():
    host = HostTier(2**30)
    cache = PrefixCache(2, shared_cells=False, host=host)
    entry = host.reserve(list(range(1, 101)), 100)
    host.store(entry, b"state", 0.0)
    run_sequence(cache, list(range(1, 81)))  # a slot holds 80 of the entry's 100 tokens
    placement = cache.place(list(range(1, 101)) + [5], 100, no_live)
    assert placement.restore is None and placement.length == 80
