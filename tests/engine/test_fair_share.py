"""Fair shares between users (cllm/engine/fair_share.py), alone and in the scheduler's
admissions: no model needed."""
from collections import Counter

from cllm.config import SamplingParams
from cllm.engine.fair_share import RECENT, FairShare
from cllm.engine.scheduler import Scheduler
from cllm.engine.sequence import Sequence


def test_a_user_coming_back_starts_at_the_lowest_active_clock_never_below():
    share = FairShare()
    share.arrive("batch")
    share.charge("batch", 1.0, 500)
    share.arrive("chat")  # new while batch is active: no credit for having been away
    assert share.clock("chat") == 500
    share.charge("chat", 1.0, 20)
    share.leave("chat", 1.0)
    share.arrive("chat")  # its own clock (520) is above the floor (500): kept
    assert share.clock("chat") == 520
    share.leave("chat", 2.0)
    share.leave("batch", 2.0)
    share.arrive("chat")  # nobody was active: every clock restarted
    assert share.clock("chat") == 0 and share.clock("batch") == 0


def test_a_user_shares_the_server_while_it_has_requests_and_a_while_after():
    share = FairShare()
    share.arrive("batch")
    share.arrive("chat")
    assert share.sharing(0.0) == 2
    share.leave("chat", 10.0)  # reading the reply
    assert share.sharing(10.0 + RECENT) == 2
    assert share.sharing(10.1 + RECENT) == 1


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


def _scheduler(max_seqs=2, **options):
    return Scheduler(max_seqs=max_seqs, token_budget=256, kv_capacity=1 << 16, max_queue=1000,
                     eog_tokens=frozenset({2}), **options)


def _batch_running(sched):
    """A batch user's six long requests, admitted two steps ago: every slot is the batch's."""
    for i in range(6):
        sched.add(_seq(f"batch{i}", "batch", max_tokens=50))
    _admissions(sched, 2)


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
    _batch_running(sched)
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


def test_a_user_holding_none_runs_in_the_lane_beside_a_batch_and_takes_nothing():
    sched = _scheduler(max_seqs=3, lanes=1)
    _batch_running(sched)
    sched.add(_seq("chat0", "chat", max_tokens=50))
    out = sched.schedule(2.0)
    assert [seq.sampling.user for seq in out.started] == ["chat"]
    assert out.released == [] and sched.num_preemptions == 0
    assert len(sched.running) == 4 and sched.slots_full  # the batch's next waits for its own


def test_the_lane_is_one_and_a_second_newcomer_takes_a_slot_from_the_batch_instead():
    sched = _scheduler(max_seqs=3, lanes=1)
    _batch_running(sched)
    sched.add(_seq("chat0", "chat", max_tokens=50))
    sched.add(_seq("mail0", "mail", max_tokens=50))
    started = _admissions(sched, 3)
    assert sorted(started) == ["chat", "mail"]
    assert sched.num_preemptions == 1 and len(sched.running) == 4


def test_a_user_of_three_times_the_weight_takes_slots_up_to_its_share():
    sched = _scheduler(max_seqs=4)
    for i in range(8):
        sched.add(_seq(f"big{i}", "big", max_tokens=200))
    _admissions(sched, 2)
    for i in range(6):
        sched.add(_seq(f"small{i}", "small", weight=3.0, max_tokens=200))
    _admissions(sched, 10)  # an exchange in a step where small is behind on its clock
    held = Counter(seq.sampling.user for seq in sched.running)
    assert held == {"small": 3, "big": 1}


def _prompt_tokens_by_user(out):
    tokens = Counter()
    for chunk in out.chunks:
        if chunk.start < chunk.seq.num_prompt_tokens:
            tokens[chunk.seq.sampling.user] += chunk.length
    return tokens


def test_a_newcomers_prompt_goes_before_the_batch_prompts_in_a_capped_step():
    sched = _scheduler(max_seqs=2, lanes=1, shared_prompt_tokens=64)
    for i in range(4):
        sched.add(_seq(f"batch{i}", "batch", n_prompt=400, max_tokens=50))
    out = sched.schedule(0.0)
    assert _prompt_tokens_by_user(out) == {"batch": 256}  # one user: the whole budget
    sched.postprocess(out, [-1] * len(out.chunks), 0.0)
    sched.add(_seq("chat0", "chat", n_prompt=40, max_tokens=50))
    out = sched.schedule(1.0)
    assert [seq.sampling.user for seq in out.started] == ["chat"]
    assert _prompt_tokens_by_user(out) == {"chat": 40, "batch": 24}  # the cap: 64 in all
