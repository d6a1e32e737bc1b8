"""Routing keys and the hash ring with bounded loads (cllm.scaleout.routing): no Ray, no model."""
from __future__ import annotations

import math
from collections import Counter

import pytest

from cllm.http.metrics import Metrics, merge
from cllm.scaleout.routing import HashRing, least_loaded, route_key

REPLICAS = ["a", "b", "c"]


def chat(*messages: tuple[str, str]) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in messages]}


def test_a_conversation_keeps_its_key_from_turn_to_turn():
    turn1 = chat(("system", "notes"), ("user", "first question"))
    turn2 = chat(("system", "notes"), ("user", "first question"), ("assistant", "an answer"),
                 ("user", "a follow-up"))
    assert route_key({}, turn1) == route_key({}, turn2) is not None


def test_conversations_with_different_openings_have_different_keys():
    assert route_key({}, chat(("user", "one"))) != route_key({}, chat(("user", "two")))


def test_a_shared_document_longer_than_the_prefix_gives_one_key():
    document = "word " * 1000
    assert (route_key({}, {"prompt": document + "question 1"})
            == route_key({}, {"prompt": document + "question 2"}))


def test_content_parts_and_token_ids_count_as_prompt():
    parts = chat(("user", [{"type": "text", "text": "hello"}]))
    assert route_key({}, parts) == route_key({}, chat(("user", "hello")))
    assert route_key({}, {"prompt": [1, 2, 3]}) != route_key({}, {"prompt": [1, 2, 4]})


def test_a_session_header_wins_over_the_prompt():
    headers = {"x-session-id": "s1"}
    assert route_key(headers, chat(("user", "one"))) == route_key(headers, chat(("user", "2")))


@pytest.mark.parametrize("body", [None, [], "text", {}, {"max_tokens": 3}])
def test_no_prompt_no_key(body):
    assert route_key({}, body) is None


def test_a_key_goes_to_one_replica_while_loads_are_even():
    ring = HashRing(REPLICAS)
    assert len({ring.choose("k", {}) for _ in range(10)}) == 1


def test_keys_spread_over_the_replicas():
    ring = HashRing(REPLICAS)
    counts = Counter(ring.choose(f"key {i}", {}) for i in range(3000))
    assert set(counts) == set(REPLICAS)
    assert min(counts.values()) > 3000 / len(REPLICAS) / 2


def test_a_replica_leaving_moves_only_its_own_keys():
    before, after = HashRing(REPLICAS), HashRing(["a", "b"])
    for i in range(500):
        owner = before.choose(f"key {i}", {})
        if owner != "c":
            assert after.choose(f"key {i}", {}) == owner


def test_a_full_replica_spills_to_the_next_on_the_ring_and_no_further():
    ring = HashRing(REPLICAS, load_factor=1.25)
    first, second, third = ring.order("hot")
    loads = {first: 4, second: 0, third: 0}  # bound: ceil(1.25 * 5 / 3) = 3
    assert ring.choose("hot", loads) == second
    assert ring.choose("hot", {first: 2, second: 2, third: 1}) == first  # 3 fits the bound


def test_no_replica_takes_more_than_the_bound():
    ring = HashRing(REPLICAS, load_factor=1.25)
    loads = dict.fromkeys(REPLICAS, 0)
    for n in range(60):  # one hot key, requests that never end
        bound = math.ceil(1.25 * (n + 1) / len(REPLICAS))
        loads[ring.choose("hot", loads)] += 1
        assert max(loads.values()) <= bound


def test_a_replica_with_every_slot_busy_is_passed_over_while_another_has_one():
    ring = HashRing(["a", "b"], load_factor=1.25)
    first, second = ring.order("k")
    assert ring.choose("k", {first: 9, second: 7}) == first  # within 1.25x the mean
    assert ring.choose("k", {first: 8, second: 7}, capacity=8) == second


def test_with_free_slots_a_key_stays_within_a_quarter_of_the_slots_above_the_least_loaded():
    ring = HashRing(["a", "b"], load_factor=1.25)
    first, second = ring.order("k")
    # The mean's bound, ceil(1.25 * 41 / 2) = 26, would spill; with 64 slots it holds 12 + 1 + 16.
    assert ring.choose("k", {first: 28, second: 12}, capacity=64) == first
    assert ring.choose("k", {first: 29, second: 12}, capacity=64) == second
    assert ring.choose("k", {first: 28, second: 12}) == second  # no capacity: the mean's bound


def test_when_every_replica_is_full_the_request_queues_where_fewest_wait():
    ring = HashRing(["a", "b"], load_factor=1.25)
    first, second = ring.order("k")
    assert ring.choose("k", {first: 8, second: 8}, capacity=8) == first  # equals: the ring
    assert ring.choose("k", {first: 9, second: 8}, capacity=8) == second  # within 1.25x, yet
    assert ring.choose("k", {first: 8, second: 12}, capacity=8) == first


def test_a_full_pool_stays_balanced_under_one_hot_key():
    ring = HashRing(["a", "b", "c"], load_factor=1.25)
    loads = dict.fromkeys("abc", 8)  # every slot busy; each new request queues somewhere
    for _ in range(30):
        loads[ring.choose("hot", loads, capacity=8)] += 1
    assert max(loads.values()) - min(loads.values()) <= 1


def test_a_load_factor_below_one_is_refused():
    with pytest.raises(ValueError, match="load_factor"):
        HashRing(REPLICAS, load_factor=0.5)


def test_least_loaded_orders_by_load():
    assert least_loaded(REPLICAS, {"a": 3, "c": 1}) == ["b", "c", "a"]


def test_merged_metrics_label_each_replica_and_keep_families_together():
    one, two = Metrics(), Metrics()
    one.prompt_tokens.inc(5)
    two.prompt_tokens.inc(7)
    text = merge({"r1": one.render(), "r2": two.render()}).decode()
    assert 'cllm_prompt_tokens_total{replica="r1"} 5.0' in text
    assert 'cllm_prompt_tokens_total{replica="r2"} 7.0' in text
    assert text.count("# TYPE cllm_prompt_tokens_total counter") == 1
