"""/metrics (cllm/http/metrics.py): the step timer read back as the benchmark reads it,
from one server and from a scale-out front that merged several replicas; the prefix cache's
tiers."""
import asyncio

from engine_checks import call, run_tokens
from prometheus_client.parser import text_string_to_metric_families

from cllm.config import EngineConfig
from cllm.engine.engine import Engine
from cllm.engine.steptimer import StepTimer
from cllm.http.metrics import (
    Metrics,
    _EngineSteps,
    _KvTiers,
    merge,
    priority_label,
    step_timer_counts,
    user_label,
)


def served(calls: int, rows: int, forward_steps: int) -> tuple[Metrics, StepTimer]:
    metrics, timer = Metrics(), StepTimer()
    metrics.registry.register(_EngineSteps(timer))
    for _ in range(calls):
        call(timer, "decode", rows=rows, forward_steps=forward_steps,
             graphs_reused=forward_steps - 1)
    return metrics, timer


def test_one_servers_counts_read_back_as_its_timer_has_them():
    metrics, timer = served(calls=3, rows=5, forward_steps=8)
    counts = step_timer_counts(metrics.render().decode())
    assert (counts["steps"], counts["rows"], counts["forward_steps"]) == (3, 15, 24)
    assert counts["graphs_reused"] == 21
    assert counts["totals"]["decode"] == timer.totals["decode"]


def test_decode_runs_timing_reads_back_by_part():
    metrics, timer = served(calls=1, rows=4, forward_steps=8)
    timer.start()
    timer.add_run({"steps": 8, "decode_ms": 2.5, "after_step_ms": 0.0, "wait_ms": 0.0,
                   "sample_ms": 0.5, "held_rows": 0.5}, call_seconds=0.025)
    timer.end(rows=4, forward_steps=8)
    text = metrics.render().decode()
    counts = step_timer_counts(text)
    assert (counts["run_steps"], counts["held_rows"]) == (8, 4)
    help_line = next(line for line in text.splitlines()
                     if line.startswith("# HELP cllm_engine_run_seconds_total"))
    assert all(part in help_line for part in ("llama_decode", "after_step", "wait", "sample"))
    assert counts["run"] == timer.run and counts["run"]["llama_decode"] == 8 * 2.5 / 1000
    assert counts["run"].keys() == {"llama_decode", "after_step", "wait", "sample", "outside"}


def test_a_front_that_merged_replicas_reads_as_their_sum():
    (one, _), (two, _) = served(2, 4, 1), served(3, 6, 8)
    counts = step_timer_counts(merge({"r1": one.render(), "r2": two.render()}).decode())
    assert (counts["steps"], counts["rows"], counts["forward_steps"]) == (5, 26, 26)


def test_one_replica_of_a_merged_front_reads_as_its_own():
    (one, _), (two, timer) = served(2, 4, 1), served(3, 6, 8)
    text = merge({"r1": one.render(), "r2": two.render()}).decode()
    counts = step_timer_counts(text, replica="r2")
    assert (counts["steps"], counts["rows"], counts["forward_steps"]) == (3, 18, 24)
    assert counts["totals"]["decode"] == timer.totals["decode"]
    assert step_timer_counts(text, replica="r3") is None


def test_a_server_without_the_counters_has_no_counts():
    assert step_timer_counts(Metrics().render().decode()) is None


def test_labels_stay_few_whatever_clients_send():
    named = frozenset({"alice"})
    assert user_label("alice", named) == "alice" and user_label("", named) == "none"
    buckets = {user_label(f"client-{i}", named) for i in range(1000)}
    assert len(buckets) == 16 and all(b.startswith("bucket-") for b in buckets)
    assert user_label("client-7", named) == user_label("client-7", named)
    assert [priority_label(p) for p in (-1000, -9, 0, 4, 9, 10**9)] == [
        "-9", "-9", "0", "4", "9", "9"]


def tier_samples(engine):
    """The engine's _KvTiers families as scraped: (name, tier label) → value."""
    metrics = Metrics()
    metrics.registry.register(_KvTiers(engine))
    return {(s.name, s.labels.get("tier")): s.value
            for family in text_string_to_metric_families(metrics.render().decode())
            for s in family.samples}


def test_the_kv_tiers_read_back_by_tier(model_path):
    engine = Engine(EngineConfig(n_ctx=2048, n_parallel=1, n_threads=2, kv_unified=False,
                                 cache_ram=64), model_path)
    try:
        story = " a clockmaker repaired every clock in the valley except his own." * 8
        for name in ("Ann", "Bob"):  # one stream: the second evicts the first to RAM
            tokens = engine.model.tokenize(name + story, add_special=False)
            asyncio.run(run_tokens(engine, tokens, max_tokens=2, temperature=0))
        samples = tier_samples(engine)
    finally:
        engine.shutdown()
    host = engine.host_tier
    assert samples[("cllm_kv_tier_cells", "ram")] == host.cells > 0
    assert samples[("cllm_kv_tier_cells", "pool")] == engine.cached_cells > 0
    assert samples[("cllm_kv_tier_ram_bytes", None)] == host.bytes > 0
    assert samples[("cllm_kv_tier_ram_capacity_bytes", None)] == 64 * 2**20
    assert samples[("cllm_kv_tier_ram_saves_total", None)] == host.saves == 1
    assert samples[("cllm_kv_tier_ram_restores_total", None)] == 0
    assert samples[("cllm_kv_tier_cells", "disk")] == 0
    assert ("cllm_kv_tier_disk_entries", None) not in samples  # no --cache-dir


def test_the_disk_tier_reads_back_its_files(model_path, tmp_path):
    engine = Engine(EngineConfig(n_ctx=2048, n_parallel=1, n_threads=2, kv_unified=False,
                                 cache_ram=0, cache_dir=str(tmp_path)), model_path)
    try:
        story = " a clockmaker repaired every clock in the valley except his own." * 8
        for name in ("Ann", "Bob"):  # no RAM: the first goes to a file
            tokens = engine.model.tokenize(name + story, add_special=False)
            asyncio.run(run_tokens(engine, tokens, max_tokens=2, temperature=0))
        samples = tier_samples(engine)
        disk_cells = engine.host_tier.disk_cells  # before the shutdown writes the pool's
    finally:
        engine.shutdown()
    assert samples[("cllm_kv_tier_disk_entries", None)] == 1
    assert samples[("cllm_kv_tier_cells", "disk")] == disk_cells > 0
    assert samples[("cllm_kv_tier_disk_written_total", None)] == 1
    assert samples[("cllm_kv_tier_disk_removed_total", None)] == 0
