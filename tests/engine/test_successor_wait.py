"""SuccessorWait's rule, without a model: wait after a step that ended requests only while
recent ends were followed by a new request within the bound (a share of a step's time)."""
from cllm.engine.successor_wait import HISTORY, SuccessorWait

STEP = 0.040  # seconds


def ends_followed_by(wait: SuccessorWait, delays: list[float | None], start: float = 0.0) -> float:
    """For each delay, a step that ends a request, its successor `delay` seconds after the end
    (None: none comes), seen at the next look at the inbox, a step later; then a step without
    ends. Returns the time after the last."""
    now = start
    for delay in delays:
        now += STEP
        wait.step_done(STEP, 1, now)
        if delay is not None:
            wait.arrived(now + delay)
        now += STEP
        wait.settle(now)
        wait.step_done(STEP, 0, now)
    return now


def test_no_wait_before_ends_have_shown_their_successors_come_soon():
    wait = SuccessorWait(0.5)
    assert wait.seconds(1) == 0.0
    ends_followed_by(wait, [0.005] * (HISTORY // 2 - 1))
    assert wait.seconds(1) == 0.0


def test_waits_half_a_step_while_successors_follow_ends_soon():
    wait = SuccessorWait(0.5)
    ends_followed_by(wait, [0.005] * HISTORY)
    assert wait.seconds(1) == wait.bound
    assert abs(wait.bound - 0.5 * STEP) < 1e-9
    assert wait.seconds(0) == 0.0  # a step that ended nothing has no successor to wait for


def test_stops_waiting_when_successors_come_later_than_the_bound_or_never():
    wait = SuccessorWait(0.5)
    ends_followed_by(wait, [0.005] * HISTORY)
    ends_followed_by(wait, [0.030] * (HISTORY // 2) + [None])  # 30 ms > 20 ms: too late
    assert wait.seconds(1) == 0.0


def test_a_request_that_came_before_the_end_is_not_its_successor():
    wait = SuccessorWait(0.5)
    now = 0.0
    for _ in range(HISTORY):
        now += STEP
        wait.step_done(STEP, 1, now)
        wait.arrived(now - 0.001)  # during the step, before it ended: the next step takes it
        now += STEP
        wait.settle(now)
        wait.step_done(STEP, 0, now)
    assert wait.seconds(1) == 0.0


def test_the_bound_follows_the_step_time():
    wait = SuccessorWait(0.5)
    ends_followed_by(wait, [0.005] * HISTORY)
    for _ in range(50):
        wait.step_done(0.100, 0, 10.0)
    assert 0.049 < wait.bound <= 0.050


def test_no_share_never_waits():
    wait = SuccessorWait(0.0)
    ends_followed_by(wait, [0.0] * HISTORY)
    assert wait.seconds(1) == 0.0


def test_an_end_whose_successor_is_seen_a_step_later_still_counts_it():
    """Without waiting, a successor that came 5 ms after an end is taken at the look after the
    next step, which may itself have ended requests: the arrival's time decides, not when the
    engine saw it."""
    wait = SuccessorWait(0.5)
    now = 0.0
    for _ in range(HISTORY):
        now += STEP
        wait.step_done(STEP, 1, now)  # an end, its successor posted at now + 5 ms ...
        first_end = now
        now += STEP
        wait.step_done(STEP, 1, now)  # ... and seen only after this step, which ended another
        wait.arrived(first_end + 0.005)
        wait.arrived(now + 0.005)
        wait.settle(now + 0.006)
    assert wait.seconds(1) == wait.bound > 0
