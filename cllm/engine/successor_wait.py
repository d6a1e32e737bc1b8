"""After a step that ended requests, how long the engine thread waits for their successors.

A client that sends its next request as soon as the last one ends (an agent calling the model
again with a tool's result, a script working through a list, a benchmark's closed loop) reaches
the engine a few milliseconds into the next step. On a CPU that step is tens of milliseconds of
decodes the new prompt cannot join, so its first token comes a whole step later than it could.
Waiting briefly for it instead (anticipatory scheduling, as disk schedulers wait for a process's
next read) lets it start in the very next step. The wait is bounded by a share of a step's time
and kept only while it pays: while most recent ends were followed by an arrival within that
bound. Traffic that does not come back at once (people reading their replies, arrivals
independent of the ends) turns it off after a few ends.
docs/design/cpu-waits.md has the measurements."""
from __future__ import annotations

from collections import deque

HISTORY = 8  # the recent ends whose successors decide whether waiting pays
STEP_SMOOTHING = 0.2  # weight of the newest step in the moving average of a step's time


class SuccessorWait:
    """The engine thread's bookkeeping: `step_done` after each step, `arrived` for each new
    request and `settle` after each look at the inbox, `seconds` to ask how long to wait after
    a step that ended requests."""

    def __init__(self, share: float) -> None:
        self.share = share  # of a step's time: the longest wait, and how soon a successor counts
        self._step_seconds = 0.0
        self._outcomes: deque[bool] = deque(maxlen=HISTORY)  # did an end's successor come in time
        self._ends: deque[float] = deque()  # steps that ended requests, their successors unseen

    @property
    def bound(self) -> float:
        return self.share * self._step_seconds

    def step_done(self, seconds: float, ended: int, now: float) -> None:
        """A step that took `seconds` ended `ended` requests at `now`."""
        if self._step_seconds:
            self._step_seconds += STEP_SMOOTHING * (seconds - self._step_seconds)
        else:
            self._step_seconds = seconds
        if ended:
            self._ends.append(now)

    def arrived(self, when: float) -> None:
        """A request reached the engine at `when`: the successor of the last end before it (the
        ends before that one had none). One that came before every end unseen followed none:
        the next step would take it without waiting anyway."""
        latest = None
        while self._ends and self._ends[0] <= when:
            if latest is not None:
                self._outcomes.append(False)
            latest = self._ends.popleft()
        if latest is not None:
            self._outcomes.append(when - latest <= self.bound)

    def settle(self, now: float) -> None:
        """Every request that arrived before `now` has been seen: the ends whose bound passed
        before it had no successor in time."""
        while self._ends and now - self._ends[0] > self.bound:
            self._ends.popleft()
            self._outcomes.append(False)

    def seconds(self, ended: int) -> float:
        """How long to wait for the successors of the `ended` requests the last step ended: the
        bound, while at least half of the recent ends (and at least HISTORY / 2 of them) had a
        successor within it; otherwise 0."""
        outcomes = self._outcomes
        if not ended or len(outcomes) < HISTORY // 2 or 2 * sum(outcomes) < len(outcomes):
            return 0.0
        return self.bound
