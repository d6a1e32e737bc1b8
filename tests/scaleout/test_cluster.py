"""How `--replicas N` lays the application out (cluster._layout), without starting Ray."""
import pytest

from cllm.config import EngineConfig, ServerConfig
from cllm.scaleout.cluster import _layout

OPTIONS = {"replicas": 2, "gpus_per_replica": 0.0, "front_replicas": None,
           "min_replicas": None, "max_replicas": None, "target_ongoing_requests": None,
           "max_ongoing_requests": None, "routing": "prefix"}


@pytest.fixture
def config(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "passive")  # _layout would choose one for the replicas
    return ServerConfig(engine=EngineConfig(n_parallel=6, n_threads=1))


def test_a_replica_takes_twice_as_many_requests_as_it_has_slots(config):
    """Beyond that they wait in the fronts' routers, which probe the replicas until one has
    room; the autoscaler aims at the slots."""
    _, plan = _layout(config, OPTIONS)
    assert (plan.max_ongoing_requests, plan.target_ongoing_requests) == (12, 6)
    _, plan = _layout(config, {**OPTIONS, "max_ongoing_requests": 9})
    assert plan.max_ongoing_requests == 9


def test_a_front_per_replica_and_the_threads_each_cpu_replica_reserves(config):
    _, plan = _layout(config, OPTIONS)
    assert (plan.fronts, plan.cpus_per_replica, plan.gpus_per_replica) == (2, 1.0, 0.0)
    _, plan = _layout(config, {**OPTIONS, "min_replicas": 1, "max_replicas": 4})
    assert plan.fronts == 4  # one per replica the autoscaler may start
