"""Prometheus metrics: one registry per app, gauges read from the engine when scraped."""
from __future__ import annotations

import hashlib
from collections import Counter as Tally
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from cllm.config import SamplingParams
from cllm.engine.embedder import Embeddings
from cllm.engine.engine import Delta, Engine
from cllm.engine.steptimer import RUN_PARTS, StepTimer

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 600)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Labels stay few whatever clients send: priorities beyond ±9 share the end labels, and users
# other than the key file's names fall in one of 16 hashed buckets.
_PRIORITY_LABEL_BOUND = 9
_USER_BUCKETS = 16


def priority_label(priority: int) -> str:
    return str(max(-_PRIORITY_LABEL_BOUND, min(_PRIORITY_LABEL_BOUND, priority)))


def user_label(user: str, named: frozenset[str]) -> str:
    """A key file's user by name; no user as "none"; any other (a request's own `user`
    field) as one of a few buckets of its hash, so that no label holds what a client wrote."""
    if user in named:
        return user
    if not user:
        return "none"
    bucket = int.from_bytes(hashlib.sha256(user.encode()).digest()[:4], "big") % _USER_BUCKETS
    return f"bucket-{bucket:x}"


def _by_user(sequences: Iterable, named: frozenset[str]) -> Tally:
    return Tally(user_label(seq.sampling.user, named) for seq in sequences)


def user_shares(engine: Engine, named: frozenset[str]) -> dict[str, dict[str, int]]:
    """Each user's requests now, running and waiting: what the fair shares give them. The
    queues are copied first (each copy is one call under the GIL: the engine thread cannot
    change them halfway)."""
    running = _by_user(list(engine.scheduler.running), named)
    waiting = _by_user(list(engine.scheduler.waiting), named)
    return {user: {"running": running[user], "waiting": waiting[user]}
            for user in sorted(running.keys() | waiting.keys())}


class Metrics:
    def __init__(self, named_users: frozenset[str] = frozenset()) -> None:
        self.named_users = named_users
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("cllm_requests_running", "Sequences holding a seq id", registry=r)
        self.waiting = Gauge("cllm_requests_waiting", "Sequences queued for a seq id", registry=r)
        self.kv_usage = Gauge("cllm_kv_cache_usage_ratio",
                              "Share of KV cells running requests hold", registry=r)
        self.preemptions = Gauge("cllm_preemptions_total",
                                 "Sequences preempted for lack of KV cells", registry=r)
        self.embedding_requests = Gauge("cllm_embedding_requests_running",
                                        "Embedding requests computing or waiting for their turn",
                                        registry=r)
        self.cached_cells = Gauge("cllm_prefix_cache_cells",
                                  "KV cells holding cached prefixes no running request uses",
                                  registry=r)
        self.prompt_tokens = Counter("cllm_prompt_tokens", "Prompt tokens processed", registry=r)
        # vLLM's pair: their ratio is the prefix cache's hit rate.
        self.cache_queries = Counter("cllm_prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache", registry=r)
        self.cache_hits = Counter("cllm_prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache", registry=r)
        self.generation_tokens = Counter("cllm_generation_tokens", "Tokens generated", registry=r)
        self.success = Counter("cllm_request_success", "Finished requests", ["finish_reason"],
                               registry=r)
        self.failure = Counter("cllm_request_failure", "Failed requests by HTTP status",
                               ["code"], registry=r)
        self.ttft = Histogram("cllm_time_to_first_token_seconds", "Arrival to first token",
                              ["priority"], buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("cllm_request_queue_time_seconds",
                                    "Arrival to the first step that scheduled the request",
                                    ["priority"], buckets=_LATENCY_BUCKETS, registry=r)
        self.user_tokens = Counter("cllm_user_tokens",
                                   "Prompt and generated tokens served, by user", ["user"],
                                   registry=r)
        self.itl = Histogram("cllm_inter_token_latency_seconds", "Mean gap between tokens",
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("cllm_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.load_seconds = Gauge("cllm_model_load_seconds",
                                  "Seconds the model's last load took", registry=r)
        self.loads = Counter("cllm_model_loads", "Times the model was loaded", registry=r)
        self._watched: list = []

    def watch(self, engine: Engine, embeddings: Embeddings) -> None:
        """Read the engine's live state on every scrape."""
        self.embedding_requests.set_function(lambda: embeddings.running)
        self.running.set_function(lambda: engine.num_running)
        self.waiting.set_function(lambda: engine.num_waiting)
        self.kv_usage.set_function(lambda: engine.kv_usage)
        self.cached_cells.set_function(lambda: engine.cached_cells)
        self.preemptions.set_function(lambda: engine.scheduler.num_preemptions)
        self._watched = [_EngineSteps(engine.timer), _UsersWaiting(engine, self.named_users),
                         _KvTiers(engine)]
        for collector in self._watched:
            self.registry.register(collector)

    def unwatch(self) -> None:
        """Let go of an unloaded engine, so that its memory can be freed: its gauges read 0."""
        for gauge in (self.embedding_requests, self.running, self.waiting, self.kv_usage,
                      self.cached_cells, self.preemptions):
            gauge.set_function(lambda: 0)
        for collector in self._watched:
            self.registry.unregister(collector)
        self._watched = []

    def record_sequence(self, sampling: SamplingParams, final: Delta) -> None:
        """Account for one sequence from what it asked for and its last delta."""
        priority = priority_label(sampling.priority)
        user = user_label(sampling.user, self.named_users)
        self.user_tokens.labels(user=user).inc(final.prompt_tokens + final.completion_tokens)
        self.prompt_tokens.inc(final.prompt_tokens)
        self.cache_queries.inc(final.prompt_tokens)
        self.cache_hits.inc(final.cached_tokens)
        self.generation_tokens.inc(final.completion_tokens)
        timings = final.timings or {}
        if "queued" in timings:
            self.queue_time.labels(priority=priority).observe(timings["queued"])
        if "ttft" in timings:
            self.ttft.labels(priority=priority).observe(timings["ttft"])
        if "tpot" in timings:
            self.itl.observe(timings["tpot"])
        if "total" in timings:
            self.e2e.observe(timings["total"])

    def record_outcome(self, finish_reason: str | None, status: int | None) -> None:
        if status is None:
            self.success.labels(finish_reason=finish_reason).inc()
        else:
            self.failure.labels(code=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The engine's step timer as counters, so a client can read where the engine thread's time went
# over any interval, as the benchmark does engine-direct (`steptimer.summarize` of the difference
# of two scrapes: `step_timer_counts`).
ENGINE_PHASE_COUNTER = "cllm_engine_step_phase_seconds"
ENGINE_RUN_COUNTER = "cllm_engine_run_seconds"
_RUN_HELP = f"Decode runs' calls by part: the core's {', '.join(RUN_PARTS)}, and outside them"
ENGINE_STEP_COUNTERS = {  # the snapshot's key: (counter name, help)
    "steps": ("cllm_engine_steps", "Calls into the core (a decode run is one)"),
    "rows": ("cllm_engine_step_rows", "Rows those calls carried"),
    "forward_steps": ("cllm_engine_forward_steps", "Forward steps computed (a run's several)"),
    "graphs_reused": ("cllm_engine_graphs_reused",
                      "Forward steps llama.cpp ran on the graph of the step before, not a new one"),
    "run_steps": ("cllm_engine_run_steps", "Forward steps of decode runs"),
    "held_rows": ("cllm_engine_run_held_rows",
                  "Rows those steps carried after they stopped, keeping the run's shape"),
}
# A snapshot's seconds by label: its key, the counter, the label.
_LABELLED = {"totals": (ENGINE_PHASE_COUNTER, "phase"), "run": (ENGINE_RUN_COUNTER, "part")}


class _EngineSteps:
    def __init__(self, timer: StepTimer) -> None:
        self.timer = timer

    def collect(self):
        counts = self.timer.snapshot()
        phases = CounterMetricFamily(ENGINE_PHASE_COUNTER, "Engine thread time by step phase",
                                     labels=["phase"])
        for phase, seconds in counts["totals"].items():
            phases.add_metric([phase], seconds)
        yield phases
        parts = CounterMetricFamily(ENGINE_RUN_COUNTER, _RUN_HELP, labels=["part"])
        for part, seconds in counts["run"].items():
            parts.add_metric([part], seconds)
        yield parts
        for key, (name, help_) in ENGINE_STEP_COUNTERS.items():
            yield CounterMetricFamily(name, help_, value=counts[key])


class _UsersWaiting:
    """Requests waiting and running by user, read from the scheduler when scraped."""

    def __init__(self, engine: Engine, named: frozenset[str]) -> None:
        self.engine, self.named = engine, named

    def collect(self):
        shares = user_shares(self.engine, self.named)
        for key, help_ in (("waiting", "Requests waiting for a slot, by user"),
                           ("running", "Requests holding a slot, by user")):
            family = GaugeMetricFamily(f"cllm_user_requests_{key}", help_, labels=["user"])
            for user, counts in shares.items():
                family.add_metric([user], counts[key])
            yield family


class _KvTiers:
    """The prefix cache by tier, read when scraped: cells in the KV pool ("pool"), in host RAM
    ("ram") and in files ("disk", docs/design/kv-tiers.md), the RAM tier's bytes, budget and
    traffic, and the disk tier's files."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def collect(self):
        host = self.engine.host_tier
        cells = GaugeMetricFamily("cllm_kv_tier_cells", "KV cells holding cached prefixes, by "
                                  "tier (pool: idle slots' cells; ram: evicted prefixes' copies)",
                                  labels=["tier"])
        cells.add_metric(["pool"], self.engine.cached_cells)
        cells.add_metric(["ram"], host.cells)
        cells.add_metric(["disk"], host.disk_cells)
        yield cells
        yield GaugeMetricFamily("cllm_kv_tier_ram_bytes", "Bytes of KV copies in host RAM",
                                value=host.bytes)
        yield GaugeMetricFamily("cllm_kv_tier_ram_capacity_bytes",
                                "The RAM tier's budget (--cache-ram; 0: off)", value=host.capacity)
        for name, help_, value in (
                ("ram_entries", "Evicted prefixes held in RAM", len(host)),
                ("ram_saves", "Evicted prefixes copied to RAM", host.saves),
                ("ram_save_seconds", "Engine-thread seconds spent copying them", host.save_seconds),
                ("ram_hits", "Prompts placed on a prefix held in RAM", host.hits),
                ("ram_restores", "Prefixes loaded from RAM into a slot", host.restores),
                ("ram_restored_tokens", "Prompt tokens those loads gave", host.restored_tokens),
                ("ram_restore_seconds", "Engine-thread seconds spent loading them",
                 host.restore_seconds)):
            family = GaugeMetricFamily if name == "ram_entries" else CounterMetricFamily
            yield family(f"cllm_kv_tier_{name}", help_, value=value)
        if host.disk is not None:
            yield from _disk_families(host)


def _disk_families(host):
    disk = host.disk
    yield GaugeMetricFamily("cllm_kv_tier_disk_entries", "Prefixes held in --cache-dir's files",
                            value=host.disk_entries)
    for name, help_, value in (("written", "Files written", disk.written),
                               ("read", "Files read back into RAM", disk.read),
                               ("read_seconds", "Engine-thread seconds reading and checking them",
                                disk.read_seconds),
                               ("removed", "Files removed as foreign, truncated or corrupt",
                                disk.removed)):
        yield CounterMetricFamily(f"cllm_kv_tier_disk_{name}", help_, value=value)


def step_timer_counts(exposition: str, replica: str | None = None) -> dict | None:
    """A step timer snapshot from a /metrics text, summed over replicas where a scale-out
    front merged several, or only `replica`'s (its `replica` label); None if it has none:
    another server, or no such replica."""
    counts: dict = {key: {} for key in _LABELLED}
    labelled = {name + "_total": (key, label) for key, (name, label) in _LABELLED.items()}
    names = {name + "_total": key for key, (name, _) in ENGINE_STEP_COUNTERS.items()}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if replica is not None and sample.labels.get("replica") != replica:
                continue
            if sample.name in labelled:
                key, label = labelled[sample.name]
                name = sample.labels[label]
                counts[key][name] = counts[key].get(name, 0.0) + sample.value
            elif sample.name in names:
                key = names[sample.name]
                counts[key] = counts.get(key, 0) + int(sample.value)
    return counts if len(counts) == len(_LABELLED) + len(ENGINE_STEP_COUNTERS) else None


def merge(expositions: Mapping[str, bytes], label: str = "replica") -> bytes:
    """Several servers' (or models') expositions as one, each sample labelled with its
    server's name (`replica="..."`, or `model="..."`): a family's samples stay together, as
    the text format requires, and a query sums over replicas with
    `sum without (replica) (...)`. An empty name adds no label."""
    families: dict[str, Metric] = {}
    for replica, text in expositions.items():
        for family in text_string_to_metric_families(text.decode()):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation,
                                                             family.type, family.unit))
            added = {label: replica} if replica else {}
            merged.samples += [s._replace(labels={**added, **s.labels})
                               for s in family.samples]
    registry = CollectorRegistry()
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


class _Families:
    """A collector of families already built."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
