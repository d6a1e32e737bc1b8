"""The engine's step timer (cllm/engine/steptimer.py): phases per call, and the steps between two
snapshots."""
from engine_checks import call

from cllm.engine.steptimer import StepTimer, since, summarize


def test_the_steps_between_two_snapshots():
    timer = StepTimer()
    call(timer, "decode", rows=4)
    first = timer.snapshot()
    for _ in range(2):  # two decode runs of 8 forward steps
        call(timer, "schedule", "decode", rows=6, forward_steps=8, graphs_reused=6)
    between = since(timer.snapshot(), first)
    assert (between["steps"], between["rows"], between["forward_steps"]) == (2, 12, 16)
    assert between["graphs_reused"] == 12
    assert between["totals"]["decode"] == timer.totals["decode"] - first["totals"]["decode"]
    summary = summarize(between)
    assert summary["rows_per_step"] == 6 and summary["forward_steps_per_step"] == 8
    assert summary["graphs_reused_share"] == 12 / 16
    assert set(summary) >= {"schedule_ms", "decode_ms", "overhead_share"}
    assert 0 <= summary["overhead_share"] <= 1


def test_a_snapshot_does_not_move_with_the_timer():
    timer = StepTimer()
    call(timer, "decode")
    snapshot = timer.snapshot()
    call(timer, "decode")
    assert snapshot["steps"] == 1 and snapshot["totals"]["decode"] < timer.totals["decode"]


def test_a_step_that_calls_nothing_counts_no_time():
    """The engine laps its inbox before it knows whether the step has anything to decode."""
    timer = StepTimer()
    timer.start()
    assert timer.lap("inbox") >= 0  # ... and the step scheduled no chunk: no end()
    call(timer, "decode", rows=2)
    assert set(timer.totals) == {"decode"} and timer.steps == 1


def test_decode_runs_timing_adds_up_over_calls_and_reads_per_forward_step():
    timer = StepTimer()
    first = timer.snapshot()
    for ms in (2.0, 4.0):  # two runs of 8 forward steps, as Context.run_timing reports them
        timer.start()
        timer.add_run({"steps": 8, "decode_ms": ms, "after_step_ms": 0.0, "wait_ms": 0.25,
                       "sample_ms": 1.0, "held_rows": ms / 2},
                      call_seconds=8 * (ms + 1.75) / 1000)
        timer.end(rows=6, forward_steps=8)
    between = since(timer.snapshot(), first)
    assert between["run_steps"] == 16
    assert between["held_rows"] == 8 * 1 + 8 * 2
    summary = summarize(between)
    parts = summary["run_ms_by_part"]
    assert parts.keys() == {"llama_decode", "after_step", "wait", "sample", "outside"}
    assert parts["llama_decode"] == 3.0 and parts["sample"] == 1.0 and parts["after_step"] == 0
    assert parts["wait"] == 0.25
    assert abs(parts["outside"] - 0.5) < 1e-9  # the calls' laps beyond the core's parts
    assert summary["held_rows_per_run_step"] == 1.5


def test_a_run_counts_with_its_call():
    timer = StepTimer()
    timer.start()
    timer.add_run({"steps": 8, "decode_ms": 2.0, "after_step_ms": 0.0, "wait_ms": 0.0,
                   "sample_ms": 1.0, "held_rows": 0.0}, call_seconds=0.03)
    assert timer.run_steps == 0 and "run_ms_by_part" not in timer.summary()  # not ended yet
    timer.end(rows=4, forward_steps=8)
    assert timer.run_steps == 8 and timer.run["llama_decode"] == 0.016


def test_without_decode_runs_there_is_no_run_timing():
    timer = StepTimer()
    call(timer, "decode")
    assert "run_ms_by_part" not in timer.summary()
