"""The scheduler alone: token counts and KV capacity, no model."""
import itertools

import pytest

from cllm.config import SamplingParams
from cllm.engine.scheduler import QueueFullError, Scheduler
from cllm.engine.sequence import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    FINISH_TIMEOUT,
    Sequence,
    SequenceStatus,
)

EOS = 2


_first_tokens = itertools.count(1000)


def make_seq(n_prompt, max_tokens=16, name=None, deadline=None, ignore_eos=False, prompt=None,
             priority=0):
    """A prompt of its own (a distinct first token: nothing to share) unless one is given."""
    prompt = prompt or [next(_first_tokens)] + list(range(10, 10 + n_prompt - 1))
    return Sequence(name or f"r{n_prompt}", prompt,
                    SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos,
                                   priority=priority),
                    arrival_time=0.0, deadline=deadline)


def make_scheduler(max_seqs=8, budget=64, kv=4096, max_queue=100, **options):
    return Scheduler(max_seqs=max_seqs, token_budget=budget, kv_capacity=kv, max_queue=max_queue,
                     eog_tokens=frozenset({EOS}), **options)


def live_slots(sched):
    return sorted(slot.id for slot in sched.cache.slots if slot.live)


def assert_only_cache_left(sched):
    """Nothing runs; every cell still counted belongs to a cached prefix."""
    assert live_slots(sched) == [] and sched.running == []
    assert sched.kv_used == sched.cache.cached_cells


def run_step(sched, now=0.0, token=7):
    """One step as the engine runs it: schedule, then a token for every sampling chunk."""
    out = sched.schedule(now)
    sampled = [token if c.samples else -1 for c in out.chunks]
    sched.postprocess(out, sampled, now)
    return out


def test_budget_is_never_exceeded_decodes_come_first_and_rows_are_in_slot_order():
    sched = make_scheduler(max_seqs=4, budget=32)
    for i in range(12):
        sched.add(make_seq(20, max_tokens=5 + 3 * i, name=f"s{i}"))
    for step in range(120):
        decoding = {s for s in sched.running if s.num_computed_tokens == s.num_tokens - 1}
        out = sched.schedule(step)
        assert out.num_tokens <= 32
        assert decoding <= {c.seq for c in out.chunks if c.length == 1}  # no decode waits
        slots = [c.seq.seq_id for c in out.chunks]
        assert slots == sorted(slots)  # llama.cpp's micro-batches take consecutive seq ids
        sched.postprocess(out, [7 if c.samples else -1 for c in out.chunks], step)


def test_long_prompt_is_chunked_while_decodes_get_a_token_every_step():
    sched = make_scheduler(max_seqs=16, budget=256, kv=8192)
    decoders = [make_seq(8, max_tokens=1000, name=f"d{i}") for i in range(8)]
    for seq in decoders:
        sched.add(seq)
    run_step(sched)  # prefill the 8 short prompts
    long_prompt = make_seq(4000, max_tokens=4, name="long")
    sched.add(long_prompt)
    steps = 0
    while long_prompt.num_output_tokens == 0:
        before = [s.num_output_tokens for s in decoders]
        out = run_step(sched, now=steps)
        steps += 1
        assert [s.num_output_tokens for s in decoders] == [b + 1 for b in before]
        assert out.num_tokens <= 256
    assert steps == -(-4000 // (256 - 8))  # chunks fill what the decodes leave of the budget
    assert long_prompt.num_computed_tokens == 4000


def prompt_tokens_of(out):
    return {c.seq.request_id: c.length for c in out.chunks if c.length > 1 or c.start == 0}


def test_a_prompt_alone_takes_the_whole_budget_whatever_the_stagger():
    sched = make_scheduler(budget=256, prefill_stagger=16)
    sched.add(make_seq(1000, name="alone"))
    assert prompt_tokens_of(run_step(sched)) == {"alone": 256}


def test_prompts_that_arrive_together_get_their_first_tokens_a_step_apart():
    # Four 10-token prompts at once: a step ends one, since a second would spend 10 more tokens
    # than the stagger of 16 allows; without a stagger all four end in the first step.
    for stagger, expected in ((16, [0, 1, 2, 3]), (None, [0, 0, 0, 0])):
        sched = make_scheduler(budget=256, prefill_stagger=stagger)
        seqs = [make_seq(10, max_tokens=100, name=f"p{i}") for i in range(4)]
        for seq in seqs:
            sched.add(seq)
        for step in range(4):
            run_step(sched, now=step)
        assert [s.first_token_time for s in seqs] == expected


def test_short_prompt_tails_end_together_within_the_stagger():
    # Prompts needing one token each (their prefixes cached, say) all end in one step.
    sched = make_scheduler(budget=256, prefill_stagger=16)
    decoder = make_seq(8, max_tokens=100, name="d")
    sched.add(decoder)
    run_step(sched)  # alone: its whole prompt
    ones = [make_seq(1, max_tokens=4, name=f"one{i}") for i in range(6)]
    for seq in ones:
        sched.add(seq)
    out = run_step(sched, now=1)
    assert {c.seq.request_id for c in out.chunks} == {"d", *(s.request_id for s in ones)}


def test_a_step_that_ends_prompts_leaves_the_decodes_to_the_next_which_ends_none():
    # first_tokens_apart (a CPU build): a question's first token comes out before the decodes
    # are computed, then a step of decodes alone, so that decodes never wait two steps.
    sched = make_scheduler(budget=256, prefill_stagger=16, first_tokens_apart=True)
    decoders = [make_seq(8, max_tokens=100, name=f"d{i}") for i in range(2)]
    for seq in decoders:
        sched.add(seq)
    while any(s.num_output_tokens == 0 for s in decoders):
        run_step(sched)
    for i in range(2):
        sched.add(make_seq(10, max_tokens=100, name=f"q{i}"))
    steps = [[(c.seq.request_id, c.length) for c in run_step(sched, now=n).chunks]
             for n in range(4)]
    assert steps == [[("q0", 10)], [("d0", 1), ("d1", 1), ("q0", 1)], [("q1", 10)],
                     [("d0", 1), ("d1", 1), ("q0", 1), ("q1", 1)]]


def test_a_prompt_the_step_left_out_is_pending_until_its_first_token():
    # The engine runs decode steps ahead in C only while nothing is pending: a prompt the
    # stagger left out of a decodes-only step would otherwise wait for the whole run.
    sched = make_scheduler(budget=256, prefill_stagger=16, first_tokens_apart=True)
    decoder = make_seq(8, max_tokens=100, name="d")
    sched.add(decoder)
    while decoder.num_output_tokens == 0:
        run_step(sched)
    assert not sched.prompts_pending
    questions = [make_seq(10, max_tokens=100, name=f"q{i}") for i in range(2)]
    for seq in questions:
        sched.add(seq)
    pending = []
    for n in range(4):
        out = run_step(sched, now=n)
        decodes_only = all(c.length == 1 and c.seq.num_output_tokens > 1 for c in out.chunks)
        pending.append((decodes_only, not sched.waiting and sched.prompts_pending))
    # q0 ends, then a decodes-only step while q1 still has its whole prompt, q1 ends, decodes
    assert pending == [(False, True), (True, True), (False, False), (True, False)]
    assert all(seq.num_output_tokens for seq in questions)


def test_a_one_token_prompt_end_keeps_the_decodes_in_its_step():
    sched = make_scheduler(budget=256, prefill_stagger=16, first_tokens_apart=True)
    decoder = make_seq(8, max_tokens=100, name="d")
    sched.add(decoder)
    run_step(sched)
    one = make_seq(1, max_tokens=4, name="one")
    sched.add(one)
    out = run_step(sched, now=1)
    assert {c.seq.request_id for c in out.chunks} == {"d", "one"}


def test_a_long_prompt_takes_what_the_decodes_leave_whatever_the_stagger():
    sched = make_scheduler(max_seqs=16, budget=80, kv=8192, prefill_stagger=16)
    decoders = [make_seq(8, max_tokens=1000, name=f"d{i}") for i in range(8)]
    for seq in decoders:
        sched.add(seq)
    while any(s.num_output_tokens == 0 for s in decoders):
        run_step(sched)
    long_prompt = make_seq(1000, max_tokens=4, name="long")
    sched.add(long_prompt)
    while long_prompt.num_output_tokens == 0:
        left = long_prompt.num_tokens - long_prompt.num_computed_tokens
        assert prompt_tokens_of(run_step(sched)) == {"long": min(72, left)}


def test_fifo_admission_by_free_seq_ids():
    sched = make_scheduler(max_seqs=2, budget=512)
    seqs = [make_seq(4, max_tokens=3, name=f"s{i}") for i in range(5)]
    for seq in seqs:
        sched.add(seq)
    admitted = []
    for step in range(30):
        out = sched.schedule(step)
        admitted += [s.request_id for s in out.started]
        assert len(sched.running) <= 2
        sched.postprocess(out, [7 if c.samples else -1 for c in out.chunks], step)
    assert admitted == [f"s{i}" for i in range(5)]
    assert all(s.finish_reason == FINISH_LENGTH and s.num_output_tokens == 3 for s in seqs)
    assert_only_cache_left(sched)


def test_queue_full_is_reported():
    sched = make_scheduler(max_queue=3)
    for i in range(3):
        sched.add(make_seq(4, name=f"s{i}"))
    with pytest.raises(QueueFullError):
        sched.add(make_seq(4, name="s3"))


def test_prompt_that_fills_the_context_is_refused():
    sched = make_scheduler(kv=100)
    with pytest.raises(ValueError):
        sched.add(make_seq(100))
    sched.add(make_seq(99))


def test_eos_and_max_tokens_end_a_sequence():
    sched = make_scheduler()
    eos_seq, ignoring = make_seq(4, max_tokens=10, name="a"), make_seq(4, max_tokens=3, name="b", ignore_eos=True)
    sched.add(eos_seq)
    sched.add(ignoring)
    run_step(sched, token=EOS)
    assert eos_seq.finish_reason == FINISH_STOP and eos_seq.output_token_ids == [EOS]
    run_step(sched, token=EOS)
    run_step(sched, token=EOS)
    assert ignoring.finish_reason == FINISH_LENGTH and ignoring.num_output_tokens == 3


def test_preemption_and_recompute_under_a_tiny_kv_cache():
    kv = 64
    sched = make_scheduler(max_seqs=4, budget=64, kv=kv)
    seqs = [make_seq(10, max_tokens=30, name=f"s{i}", ignore_eos=True) for i in range(4)]
    for seq in seqs:
        sched.add(seq)
    released = []
    for step in range(400):
        out = run_step(sched, now=step, token=5)
        released += out.released
        assert sched.kv_used <= kv
        running_cells = sum(s.num_computed_tokens for s in sched.running)
        assert running_cells + sched.cache.cached_cells == sched.kv_used
        if all(s.is_finished for s in seqs):
            break
    assert sched.num_preemptions > 0
    assert all(s.finish_reason == FINISH_LENGTH and s.num_output_tokens == 30 for s in seqs)
    assert any(s.num_preemptions for s in seqs)
    assert_only_cache_left(sched)


@pytest.mark.parametrize("prefix_cache", [False, True])
def test_preempted_sequence_recomputes_prompt_and_output(prefix_cache):
    """Preemption frees the cells; without a prefix cache the sequence recomputes all of its
    tokens, with one it resumes from those still cached (all but the last: it needs logits)."""
    sched = make_scheduler(max_seqs=2, budget=64, kv=64, prefix_cache=prefix_cache)
    seq = make_seq(10, max_tokens=30, name="a")
    sched.add(seq)
    for step in range(3):
        run_step(sched, now=step)
    assert sched.preempt(3.0) is seq
    assert seq.status is SequenceStatus.WAITING and seq.num_computed_tokens == 0
    out = sched.schedule(4.0)
    (chunk,) = out.chunks
    start = 12 if prefix_cache else 0
    assert (chunk.start, chunk.length, chunk.samples) == (start, 13 - start, True)
    assert chunk.seq.token_ids(0, 13) == seq.prompt_token_ids + [7, 7, 7]


def test_a_preempted_sequence_aborted_while_it_waits_leaves_only_what_the_rules_keep():
    sched = make_scheduler(max_seqs=2, budget=64, kv=64, cache_replies="drop")
    seq = make_seq(10, max_tokens=30, name="a")
    sched.add(seq)
    for step in range(3):
        run_step(sched, now=step)
    slot = sched.cache.slots[seq.seq_id]
    sched.preempt(3.0)
    assert slot.cached == 12  # its prompt and the output it will resume from
    assert sched.finish(seq, FINISH_ABORT, 4.0)
    assert slot.cached == 10  # replies are dropped: its prompt only
    assert_only_cache_left(sched)


def test_abort_frees_exactly_once():
    sched = make_scheduler(max_seqs=2)
    running, waiting = make_seq(4, name="run"), make_seq(4, name="wait")
    sched.add(running)
    run_step(sched)
    sched.add(waiting)
    seq_id = running.seq_id
    assert sched.finish(running, FINISH_ABORT, 1.0)
    assert not sched.finish(running, FINISH_ABORT, 1.0)
    assert sched.finish(waiting, FINISH_ABORT, 1.0)
    assert sched.schedule(2.0).released == [(seq_id, running)]
    assert sched.schedule(3.0).released == []
    assert_only_cache_left(sched)
    assert not sched.has_work


def test_a_row_that_was_to_sample_and_got_no_token_ends_with_an_error():
    """Rather than wait forever for a token: its prompt is computed, so nothing would schedule
    it again. Its cells go back; the other row goes on."""
    sched = make_scheduler()
    stuck, other = make_seq(4, name="stuck"), make_seq(4, name="other")
    sched.add(stuck)
    sched.add(other)
    out = sched.schedule(0.0)
    assert [c.samples for c in out.chunks] == [True, True]
    got = sched.postprocess(out, [-1 if c.seq is stuck else 7 for c in out.chunks], 1.0)
    assert stuck.finish_reason == FINISH_ERROR and stuck.error == "the step sampled no token"
    assert [out.chunks[i].seq for i, _ in got] == [other] and sched.running == [other]
    assert stuck not in {c.seq for c in sched.schedule(2.0).chunks}


def test_aborted_while_decoding_is_not_counted():
    sched = make_scheduler()
    seq = make_seq(4)
    sched.add(seq)
    out = sched.schedule(0.0)
    sched.finish(seq, FINISH_ABORT, 0.5)
    assert sched.postprocess(out, [7], 1.0) == []
    assert seq.output_token_ids == [] and sched.kv_used == sched.cache.cached_cells


def test_deadline_times_out_running_and_waiting():
    sched = make_scheduler(max_seqs=1)
    first, second = make_seq(4, name="a", deadline=5.0), make_seq(4, name="b", deadline=5.0)
    sched.add(first)
    sched.add(second)
    run_step(sched, now=1.0)
    out = sched.schedule(6.0)
    assert out.chunks == []
    assert first.finish_reason == second.finish_reason == FINISH_TIMEOUT
    assert out.expired == [first, second]
    assert out.released == [(0, first)] and live_slots(sched) == []


def test_thousand_sequences_leave_nothing_behind():
    sched = make_scheduler(max_seqs=8, budget=64, kv=512, max_queue=1000)
    for i in range(1000):
        sched.add(make_seq(1 + i % 13, max_tokens=1 + i % 5, name=f"s{i}"))
    released = 0
    for step in range(10_000):
        released += len(run_step(sched, now=step).released)
        if not sched.has_work:
            break
    assert released == 1000
    assert_only_cache_left(sched)


def test_cache_prompt_false_neither_reads_nor_leaves_a_cached_prefix():
    sched = make_scheduler(max_seqs=2, budget=64)
    shared = list(range(500, 540))
    first = make_seq(0, max_tokens=1, prompt=shared + [1])
    sched.add(first)
    run_step(sched)
    assert first.is_finished and sched.cache.cached_cells == 41
    private = make_seq(0, max_tokens=1, prompt=shared + [2])
    private.cache_prompt = False
    sched.add(private)
    run_step(sched)
    assert private.num_cached_tokens == 0 and private.is_finished
    assert sched.cache.cached_cells == 41  # its own cells were cleared when it ended
    later = make_seq(0, max_tokens=1, prompt=shared + [3])
    sched.add(later)
    run_step(sched)
    assert later.num_cached_tokens == 40


def test_a_decode_runs_tokens_end_a_sequence_only_at_a_rows_last():
    """As the core runs them: a row stops at its budget or after an end token."""
    sched = make_scheduler(max_seqs=3)
    budget, eos, going = make_seq(4, max_tokens=4), make_seq(4), make_seq(4)
    for seq in (budget, eos, going):
        sched.add(seq)
    run_step(sched)  # the prompts and a first token each
    out = sched.schedule(1.0)
    assert [c.seq for c in out.chunks] == [budget, eos, going]
    n_steps = 4
    tokens = [5, 6, 7, 0] + [8, EOS, 0, 0] + [9, 10, 11, 12]  # rows' tokens, n_steps apart
    got = sched.postprocess_run(out, tokens, [3, 2, 4], n_steps, 1.0)
    assert got == [(0, 3), (1, 2), (2, 4)]
    assert budget.output_token_ids == [7, 5, 6, 7] and budget.finish_reason == FINISH_LENGTH
    assert eos.output_token_ids == [7, 8, EOS] and eos.finish_reason == FINISH_STOP
    assert going.output_token_ids == [7, 9, 10, 11, 12] and not going.is_finished
    assert going.num_computed_tokens == going.num_tokens - 1


# ---- priority ----

def test_waiting_sequences_start_by_priority_then_arrival():
    sched = make_scheduler(max_seqs=1, budget=64)
    for name, priority in (("late-low", 5), ("first-mid", 1), ("urgent", -3), ("second-mid", 1)):
        sched.add(make_seq(8, max_tokens=1, name=name, priority=priority))
    started = []
    while sched.has_work:
        started += [seq.request_id for seq in run_step(sched).started]
    assert started == ["urgent", "first-mid", "second-mid", "late-low"]


def test_an_arrival_of_higher_priority_preempts_the_lowest_running_the_newest_among_equals():
    sched = make_scheduler(max_seqs=3, budget=64)
    for name, priority in (("a", 2), ("b", 5), ("c", 5)):
        sched.add(make_seq(8, max_tokens=50, name=name, priority=priority))
    run_step(sched)
    run_step(sched)
    assert sched.num_preemptions == 0
    sched.add(make_seq(8, max_tokens=50, name="urgent", priority=0))
    out = run_step(sched)
    assert [seq.request_id for seq in out.started] == ["urgent"]
    assert [seq.request_id for _, seq in out.released] == ["c"]
    assert sorted(seq.request_id for seq in sched.running) == ["a", "b", "urgent"]
    (preempted,) = sched.waiting
    assert preempted.request_id == "c" and preempted.status is SequenceStatus.WAITING
    assert preempted.num_output_tokens == 2  # kept: it resumes after its prompt and these


def test_equal_or_lower_priority_arrivals_wait_for_a_free_slot():
    sched = make_scheduler(max_seqs=2, budget=64)
    for name in ("a", "b"):
        sched.add(make_seq(8, max_tokens=50, name=name, priority=1))
    run_step(sched)
    sched.add(make_seq(8, max_tokens=50, name="same", priority=1))
    sched.add(make_seq(8, max_tokens=50, name="lower", priority=9))
    for _ in range(3):
        assert run_step(sched).started == []
    assert sched.num_preemptions == 0


def test_kv_full_preemption_takes_the_lowest_priority_first():
    sched = make_scheduler(max_seqs=3, budget=64)
    for name, priority in (("low", 7), ("high", -1), ("mid", 3)):
        sched.add(make_seq(8, max_tokens=50, name=name, priority=priority))
    run_step(sched)
    assert [sched.preempt(1.0).request_id for _ in range(3)] == ["low", "mid", "high"]
