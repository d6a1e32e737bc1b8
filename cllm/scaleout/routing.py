"""Which replica serves a request: consistent hashing of a routing key with bounded loads.

Pure Python, no Ray: the Ray request router (ray_app.py) feeds it the replicas and their
loads. docs/design/scale-out.md says why the key and the bound are what they are."""
from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Hashable, Iterable, Mapping

SESSION_HEADER = "x-session-id"
PREFIX_CHARS = 1024  # prompt characters hashed: about 250 tokens of English
LOAD_FACTOR = 1.25  # a replica takes at most this times the mean load (plus the new request)
SLACK_SHARE = 4  # ...or, with free slots, up to 1/SLACK_SHARE of its slots above the least loaded
VIRTUAL_NODES = 64  # points per replica on the ring: an even share with a handful of replicas

# Fields that make a prompt, in the order the chat templates put them first.
_PROMPT_FIELDS = ("system", "instructions", "messages", "input", "prompt", "content")


def route_key(headers: Mapping[str, str], body: object,
              prefix_chars: int = PREFIX_CHARS) -> str | None:
    """A request's routing key: its session id if it names one, else the first `prefix_chars`
    characters of its prompt; None for a request with neither (it goes to the least loaded).

    For a conversation the prompt is taken through its first user message only: every later
    turn resends that beginning, so the whole conversation has one key (its later text
    differs from turn to turn, and the reply of turn 1 is not in turn 1's prompt)."""
    session = headers.get(SESSION_HEADER)
    if session:
        return "session:" + session
    if not isinstance(body, dict):
        return None
    text = "".join(_prompt_text(body[name]) for name in _PROMPT_FIELDS if name in body)
    return "prefix:" + text[:prefix_chars] if text else None


def _prompt_text(value: object) -> str:
    if isinstance(value, str):
        return value + "\x00"
    if isinstance(value, list) and value and isinstance(value[0], int):  # token ids
        return " ".join(map(str, value)) + "\x00"
    if isinstance(value, list):  # messages or input items: through the first user's
        parts = []
        for message in value:
            if not isinstance(message, dict):
                parts.append(_prompt_text(message))
                continue
            parts.append(f"{message.get('role', '')}\x00{_content_text(message.get('content'))}")
            if message.get("role") == "user":
                break
        return "\x00".join(parts) + "\x00"
    return ""


def _content_text(content: object) -> str:
    """A message's text: a string, or the text parts of a list of parts."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _point(value: str) -> int:
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "big")


class HashRing:
    """Consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam, 2018): a
    key goes to the first replica clockwise from its point on the ring whose load stays within
    `load_factor` times the mean, counting the new request. Replicas joining or leaving move
    only the keys next to their own points; a hot key spills to the next replica on the ring,
    always the same one, so its cache warms there too."""

    def __init__(self, replicas: Iterable[Hashable], load_factor: float = LOAD_FACTOR,
                 virtual_nodes: int = VIRTUAL_NODES) -> None:
        if load_factor < 1:
            raise ValueError(f"load_factor must be at least 1, got {load_factor}")
        self.replicas = frozenset(replicas)
        self.load_factor = load_factor
        ring = sorted((_point(f"{replica}#{i}"), str(replica), replica)
                      for replica in self.replicas for i in range(virtual_nodes))
        self._points = [point for point, _, _ in ring]
        self._owners = [replica for _, _, replica in ring]

    def order(self, key: str) -> list[Hashable]:
        """Every replica once, in the order the ring meets them from `key`'s point."""
        start = bisect.bisect(self._points, _point(key))
        seen: dict[Hashable, None] = {}
        for i in range(len(self._owners)):
            seen.setdefault(self._owners[(start + i) % len(self._owners)])
            if len(seen) == len(self.replicas):
                break
        return list(seen)

    def choose(self, key: str, loads: Mapping[Hashable, int],
               capacity: int | None = None) -> Hashable:
        """The replica for `key`, given each replica's requests in flight (missing: 0). With
        `capacity` (the sequences a replica decodes at once), a replica that has every slot
        busy is passed over while another has one free: a request queued behind a full replica
        waits longer than it takes to prefill its prefix elsewhere, and the free slot idles.
        When every replica is full, the request queues where the fewest wait (the key's own
        replica among equals): its queue empties no later than the others'. Below that, a
        replica keeps its keys while it holds at most a quarter of its slots more than the least
        loaded, whatever the mean: a key sent away prefills its whole prefix again there and
        evicts another's (docs/design/scale-out.md: TTFT p50 halved on 18 long documents;
        SGLang's cache-aware router likewise balances only past an absolute difference)."""
        if not self.replicas:
            raise ValueError("no replicas to choose from")
        order = self.order(key)
        if capacity is not None and all(loads.get(r, 0) >= capacity for r in order):
            return min(order, key=lambda r: loads.get(r, 0))  # min keeps the first of equals
        total = sum(loads.get(r, 0) for r in order)
        bound = math.ceil(self.load_factor * (total + 1) / len(order))
        if capacity is not None:
            least = min(loads.get(r, 0) for r in order)
            bound = min(max(bound, least + 1 + capacity // SLACK_SHARE), capacity)
        # One always fits: the least loaded holds at most the mean, rounded down, and has a
        # free slot.
        return next(r for r in order if loads.get(r, 0) + 1 <= bound)


def least_loaded(replicas: Iterable[Hashable], loads: Mapping[Hashable, int]) -> list[Hashable]:
    """The replicas from the least loaded to the most."""
    return sorted(replicas, key=lambda r: loads.get(r, 0))
