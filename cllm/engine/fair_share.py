"""Fair shares between users: which user's waiting request starts next.

Each user has a clock: the tokens computed for it (prompt and generated), divided by its
weight. Among waiting requests of the same priority, the one whose user's clock is lowest
starts first, the oldest of that user's first; so while several users have requests waiting,
slots and the tokens they compute go to them in proportion to their weights, however many
requests each has queued. A user whose requests all ended keeps no credit: when it comes back,
its clock starts no lower than the lowest clock of the users still active (start-time fair
queuing's rule), so an idle user's share is lent to the others, never saved up.

It also tells how many users are sharing the server: those with requests waiting or running,
and those whose last request ended less than RECENT seconds ago (a person reading a reply
before the next turn still shares it)."""
from __future__ import annotations

from collections import Counter

RECENT = 60.0  # seconds a user who had a request still counts as sharing the server


class FairShare:
    def __init__(self) -> None:
        self._clock: dict[str, float] = {}  # tokens computed / weight, by user
        self._live: Counter[str] = Counter()  # requests waiting or running, by user
        self._left: dict[str, float] = {}  # when each user's last request ended, if recently

    def sharing(self, now: float) -> int:
        """Users with requests waiting or running, or whose last one ended within RECENT."""
        for user in [u for u, t in self._left.items() if now - t > RECENT]:
            del self._left[user]
        return len(self._live) + sum(1 for user in self._left if user not in self._live)

    def clock(self, user: str) -> float:
        return self._clock.get(user, 0.0)

    def arrive(self, user: str) -> None:
        """A request of `user` waits: a user who had none starts at the active users' lowest
        clock if its own is lower."""
        if self._live[user] == 0:
            floor = self._floor()
            if floor is not None and self.clock(user) < floor:
                self._clock[user] = floor
        self._live[user] += 1

    def leave(self, user: str, now: float) -> None:
        """A request of `user` ended at `now`. With no user active, the clocks restart from
        zero."""
        self._live[user] -= 1
        if self._live[user] <= 0:
            del self._live[user]
            self._left[user] = now
            floor = self._floor()
            if floor is None:
                self._clock.clear()
            elif self.clock(user) <= floor:  # it would start at the floor anyway
                self._clock.pop(user, None)

    def charge(self, user: str, weight: float, tokens: int) -> None:
        self._clock[user] = self.clock(user) + tokens / weight

    def _floor(self) -> float | None:
        return min((self.clock(u) for u in self._live), default=None)
