"""The engine-direct target (cllm/bench/direct.py) with the real model: it honours the
benchmark's cache_prompt as the HTTP targets' servers do, and reports cached prompt tokens;
and the benchmark loads llama.cpp under the server's wait policy."""
import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from cllm.bench.direct import EngineTarget
from cllm.bench.loadgen import LoadSettings
from cllm.bench.servers import ServerSettings

PROMPT = "Explain in a few words why the sky is blue, as a teacher would to a class of children."


def _twice(model_path: str, cache_prompt: bool | None):
    target = EngineTarget(model_path, ServerSettings(parallel=2, ctx_size=2048, threads=1),
                          LoadSettings(max_tokens=2, cache_prompt=cache_prompt))

    async def send_twice():
        return [await target.send(PROMPT), await target.send(PROMPT)]
    try:
        return asyncio.run(send_twice())
    finally:
        target.shutdown()


@pytest.mark.parametrize("cache_prompt", [None, True])
def test_a_repeated_prompt_comes_from_the_cache_by_default(model_path, cache_prompt):
    first, second = _twice(model_path, cache_prompt)
    assert first.ok and second.ok, (first.error, second.error)
    assert first.cached_tokens == 0
    assert 0 < second.cached_tokens < second.prompt_tokens


def test_no_cache_prompt_computes_every_prompt_again(model_path):
    first, second = _twice(model_path, False)
    assert first.ok and second.ok, (first.error, second.error)
    assert first.cached_tokens == second.cached_tokens == 0
    assert second.prompt_tokens == first.prompt_tokens > 10


def test_cllm_args_reach_the_engine_and_its_streams(model_path):
    """--cllm-args configure the measured engine as they do the started server: its decode
    runs, and the stream interval that cuts a streamed reply's 9 tokens into 1 + 4 + 4."""
    settings = ServerSettings(parallel=2, ctx_size=2048, threads=1,
                              cllm_args=("--decode-steps", "3", "--stream-interval", "4"))
    target = EngineTarget(model_path, settings, LoadSettings(max_tokens=9, ignore_eos=True))
    try:
        assert target.engine.decode_steps == 3
        result = asyncio.run(target.send(PROMPT))
    finally:
        target.shutdown()
    assert result.ok, result.error
    assert result.output_tokens == 9
    assert len(result.itl) == 2  # three deltas carried the tokens


def test_the_benchmark_loads_llama_cpp_first_under_the_servers_wait_policy():
    """OpenMP reads its wait policy once, when llama.cpp loads. The benchmark's own imports
    leave it unloaded, and load_llama_as_the_server loads it under the policy the started
    server would get (`--cpu-wait sleep` here: OMP_WAIT_POLICY=PASSIVE whatever the cores),
    restoring the environment after; the default KV layout, asked next, finds it loaded.
    Before, importing the benchmark loaded llama.cpp, and the engine-direct series spun at
    barriers while the server slept."""
    code = textwrap.dedent("""
        import importlib.abc, os, sys
        seen = []
        class Watch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name == "cllm.llama._core":
                    seen.append(os.environ.get("OMP_WAIT_POLICY"))
        sys.meta_path.insert(0, Watch())
        from cllm.bench.__main__ import load_llama_as_the_server
        from cllm.bench.cli import parse_args, server_settings
        print("cllm.llama._core" in sys.modules)
        load_llama_as_the_server(1, ("--cpu-wait", "sleep"))
        server_settings(parse_args(["--engine-direct"]))
        print(seen, os.environ.get("OMP_WAIT_POLICY"))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True, timeout=120)
    assert out.stdout.splitlines() == ["False", "['PASSIVE'] None"], out.stderr
