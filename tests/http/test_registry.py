"""The model registry with the two real models (SmolLM2 and Gemma 3): routing by name, one load
for concurrent first requests, keep-alive, the resident cap, pinning, work in flight, a model
that fails to load, and memory returned on unloading."""
import asyncio
import os

import pytest

from cllm.config import EngineConfig, ServerConfig
from cllm.engine.engine import Engine
from cllm.errors import APIError
from cllm.http.metrics import Metrics
from cllm.http.registry import FAILED, LOADED, UNLOADED, ModelRegistry
from cllm.models import ModelSource

ENGINE = EngineConfig(n_ctx=512, n_parallel=2, n_batch=128, n_threads=1)


class CountingLoads:
    """Loads real engines and counts them by file."""

    def __init__(self) -> None:
        self.loads: dict[str, int] = {}

    def __call__(self, path: str, on_model) -> Engine:
        self.loads[path] = self.loads.get(path, 0) + 1
        return Engine(ENGINE, path, on_model)


@pytest.fixture(scope="module")
def sources(model_path, gemma_path):
    return [ModelSource("smol", "smollm2-135m-instruct", model_path),
            ModelSource("gemma", "gemma3-270m", gemma_path)]


def registry(sources, **server) -> tuple[ModelRegistry, CountingLoads]:
    loads = CountingLoads()
    return ModelRegistry(ServerConfig(**server), sources, loads, Metrics()), loads


def run(coro_fn, *args):
    """Run a test's coroutine; every model it left loaded is closed after."""
    async def body():
        reg = args[0]
        try:
            return await coro_fn(*args)
        finally:
            await asyncio.to_thread(reg.close)
    return asyncio.run(body())


async def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "the condition never held"
        await asyncio.sleep(0.02)


def test_requests_reach_the_model_they_name_and_an_unknown_name_is_a_404(sources):
    reg, _ = registry(sources)
    assert reg.find("gemma").name == "gemma"
    assert reg.find("gemma3-270m").name == "gemma"  # the alias of its file
    assert reg.find(None) is reg.find("") is reg.find("smol")  # none named: the first
    with pytest.raises(APIError) as raised:
        reg.find("llama-70b")
    assert raised.value.status == 404 and raised.value.code == "model_not_found"


def test_concurrent_first_requests_wait_for_one_load(sources):
    async def body(reg, loads):
        models = await asyncio.gather(*(reg.acquire("gemma") for _ in range(6)))
        assert {id(m) for m in models} == {id(reg.models["gemma"])}
        assert loads.loads == {sources[1].path: 1}
        assert reg.models["gemma"].status == LOADED and reg.models["gemma"].in_flight == 6
        assert reg.models["smol"].status == UNLOADED  # never asked for
        engine = models[0].require_engine()
        tokens = engine.model.tokenize("Hello", False, False)
        assert tokens and engine.model.detokenize(tokens).strip() == "Hello"
        for m in models:
            reg.release(m)
    run(body, *registry(sources))


def test_keep_alive_zero_unloads_after_the_last_request_and_a_new_one_loads_again(sources):
    async def body(reg, loads):
        first = await reg.acquire("smol")
        second = await reg.acquire("smol")
        reg.release(first)
        await asyncio.sleep(0.2)
        assert second.status == LOADED  # a request is still in flight
        assert not await reg.unload(second)
        reg.release(second)
        await wait_for(lambda: second.status == UNLOADED)
        assert second.engine is None and second.renderer is None
        again = await reg.acquire("smol")
        assert again.status == LOADED and loads.loads[sources[0].path] == 2
        reg.release(again)
    run(body, *registry(sources, keep_alive=0))


def test_a_negative_keep_alive_keeps_the_model(sources):
    async def body(reg, loads):
        reg.release(await reg.acquire("smol"))
        await asyncio.sleep(0.3)
        assert reg.models["smol"].status == LOADED
    run(body, *registry(sources, keep_alive=-1))


def test_models_max_unloads_the_least_recently_used_idle_model(sources):
    async def body(reg, loads):
        reg.release(await reg.acquire("smol"))
        reg.release(await reg.acquire("gemma"))  # smol makes room
        assert reg.models["smol"].status == UNLOADED and reg.models["gemma"].status == LOADED
        busy = await reg.acquire("gemma")
        with pytest.raises(APIError) as raised:  # gemma is busy: no room for smol
            await reg.acquire("smol")
        assert raised.value.status == 503 and raised.value.code == "models_busy"
        assert busy.status == LOADED and reg.models["smol"].status == UNLOADED
        reg.release(busy)
        reg.release(await reg.acquire("smol"))
        assert reg.models["gemma"].status == UNLOADED and reg.models["smol"].status == LOADED
    run(body, *registry(sources, keep_alive=-1, models_max=1))


def test_a_pinned_model_loads_at_start_and_stays(sources):
    async def body(reg, loads):
        assert [m.name for m in reg.at_start()] == ["gemma"]
        gemma = reg.models["gemma"]
        reg.release(await reg.acquire("gemma"))
        await asyncio.sleep(0.3)
        assert gemma.status == LOADED  # keep-alive 0 does not apply to it
        with pytest.raises(APIError) as raised:  # nor does models-max's room-making
            await reg.acquire("smol")
        assert raised.value.code == "models_busy" and gemma.status == LOADED
    run(body, *registry(sources, keep_alive=0, models_max=1, pinned=("gemma",)))


def test_a_pin_of_no_served_model_is_refused(sources):
    with pytest.raises(ValueError, match="--pin"):
        registry(sources, pinned=("nope",))


def test_a_model_that_fails_to_load_says_why_and_the_others_serve_on(sources, tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)

    async def body(reg, loads):
        with pytest.raises(APIError) as raised:
            await reg.acquire("broken")
        assert raised.value.status == 503 and "failed to load" in raised.value.message
        broken = reg.models["broken"]
        assert broken.status == FAILED and broken.in_flight == 0
        assert broken.describe()["status"]["failed"] and broken.describe()["status"]["reason"]
        with pytest.raises(APIError):  # stays failed, without another try
            await reg.acquire("broken")
        assert loads.loads[str(bad)] == 1
        smol = await reg.acquire("smol")
        assert smol.require_engine().model.n_vocab > 0
        reg.release(smol)
    run(body, *registry([*sources, ModelSource("broken", str(bad), str(bad))]))


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_unloading_returns_the_memory(sources):
    """Resident memory after each unload is back within 5% of what it was before the load, over
    several loads of both models: no growth from one to the next."""
    async def cycle(reg, name: str) -> int:
        model = await reg.acquire(name)
        assert model.require_engine().model.tokenize("Hi", True, False)
        reg.release(model)
        assert await reg.unload(model)
        return rss_bytes()

    async def body(reg, loads):
        for name in ("smol", "gemma") * 2:  # the libraries' and threads' first-use allocations
            await cycle(reg, name)
        before = rss_bytes()
        loaded = await reg.acquire("gemma")
        grown = rss_bytes() - before
        reg.release(loaded)
        await reg.unload(loaded)
        assert grown > 100 * 2**20  # the load itself shows: a test that can fail
        after = [await cycle(reg, name) for name in ("smol", "gemma") * 3]
        assert max(after) <= before * 1.05, (before, after)
    run(body, *registry(sources, keep_alive=-1))
