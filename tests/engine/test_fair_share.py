"""Fair shares between users (cllm/engine/fair_share.py), alone and in the scheduler's
admissions: no model needed."""
from collections import Counter

from cllm.config import SamplingParams
from cllm.engine.fair_share import FairShare
from cllm.engine.scheduler import Scheduler
from cllm.engine.sequence import Sequence


def test_a_user_coming_back_starts_at_the_lowest_active_clock_never_below():
    share = FairShare()
    share.arrive("batch")
    share.charge("batch", 1.0, 500)
    share.arrive("chat")  # new while batch is active: no credit for having been away
    assert share.clock("chat") == 500
    share.charge("chat", 1.0, 20)
    share.leave("chat")
    share.arrive("chat")  # its own clock (520) is above the floor (500): kept
    assert share.clock("chat") == 520
    share.leave("chat")
    share.leave("batch")
    share.arrive("chat")  # nobody was active: every clock restarted
    assert share.clock("chat") == 0 and share.clock("batch") == 0


def test_weights_divide_the_charge():
    share = FairShare()
    share.arrive("a")
    share.charge("a", 4.0, 100)
    assert share.clock("a") == 25


def _seq(name, user, weight=1.0, n_prompt=16, max_tokens=4, priority=0):
    prompt = [hash(name) % 30000 + 1000] + list(range(10, 10 + n_prompt - 1))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, user=user,
                            user_weight=weight, priority=priority)
    return Sequence(name, prompt, params, arrival_time=0.0)


def _admissions(sched, steps):
    """The users of the requests each step started, step after step, with a token for every
    sampling chunk."""
    started = []
    for step in range(steps):
        out = sched.schedule(float(step))
        started += [seq.sampling.user for seq in out.started]
        sched.postprocess(out, [7 if c.samples else -1 for c in out.chunks], float(step))
    return started


def _scheduler(max_seqs=2):
    return Scheduler(max_seqs=max_seqs, token_budget=256, kv_capacity=1 << 16, max_queue=1000,
                     eog_tokens=frozenset({2}))


def test_a_user_with_few_requests_gets_slots_as_often_as_one_with_many():
    sched = _scheduler()
    for i in range(40):
        sched.add(_seq(f"batch{i}", "batch"))
    for i in range(5):
        sched.add(_seq(f"chat{i}", "chat"))
    started = _admissions(sched, 40)
    # FIFO would start all 40 batch requests first; shares alternate while both wait.
    assert started[:10].count("chat") == 5


def test_slots_go_in_proportion_to_the_users_weights():
    sched = _scheduler()
    for i in range(60):
        sched.add(_seq(f"heavy{i}", "heavy", weight=3.0))
        sched.add(_seq(f"light{i}", "light", weight=1.0))
    counts = Counter(_admissions(sched, 60)[:40])
    assert 2.5 <= counts["heavy"] / counts["light"] <= 3.5


def test_priority_comes_before_the_shares():
    sched = _scheduler(max_seqs=1)
    sched.add(_seq("a0", "a"))
    sched.add(_seq("a1", "a"))
    sched.add(_seq("b0", "b", priority=1))
    assert _admissions(sched, 30)[:3] == ["a", "a", "b"]


def test_a_user_holding_no_slot_takes_one_from_the_user_holding_the_most():
    sched = _scheduler(max_seqs=3)
    for i in range(6):
        sched.add(_seq(f"batch{i}", "batch", max_tokens=50))
    _admissions(sched, 2)
    sched.add(_seq("chat0", "chat", max_tokens=50))
    out = sched.schedule(2.0)
    assert [seq.sampling.user for seq in out.started] == ["chat"]
    assert [seq.request_id for _, seq in out.released] == ["batch2"]  # the newest batch one
    assert sched.waiting[0].request_id == "batch2"  # it resumes first of the batch


def test_no_slot_changes_hands_while_every_user_holds_at_most_one():
    sched = _scheduler(max_seqs=2)
    sched.add(_seq("a0", "a", max_tokens=50))
    sched.add(_seq("b0", "b", max_tokens=50))
    _admissions(sched, 2)
    sched.add(_seq("c0", "c", max_tokens=50))
    _admissions(sched, 5)
    assert sched.num_preemptions == 0
