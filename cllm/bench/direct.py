"""cllm's Engine measured in-process, with no HTTP: the "cllm-engine" series.

The gap between it and the "cllm" series is what the HTTP layer costs. Prompts go in raw (no
chat template), as with the completions endpoint."""
from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from cllm.engine.sequence import FINISH_LENGTH, FINISH_STOP

from .loadgen import LoadSettings, RequestResult, Sized, check_tokens
from .servers import ServerSettings, cllm_flags, say


def _failed_finish(reason: str) -> str | None:
    """Only stop and length are a normal end; abort, timeout, error and shutdown are failures."""
    return None if reason in (FINISH_STOP, FINISH_LENGTH) else f"finished with reason {reason!r}"


def load_llama_as_the_server(threads: int, cllm_args: tuple[str, ...] = ()) -> None:
    """Load llama.cpp into this process under the wait policy `cllm.serve --threads THREADS
    CLLM_ARGS` gives its threads at barriers: OpenMP reads it once, when llama.cpp loads, and
    the engine-direct series must wait as the server does, or the two series differ by more
    than the HTTP path. The benchmark's `main` calls it before anything else loads llama.cpp
    (its default KV layout asks it whether there is a GPU)."""
    if "cllm.llama._core" in sys.modules:
        say("engine-direct: llama.cpp was loaded before its threads' wait policy could be set; "
            "this series may wait at barriers unlike the server")
        return
    from cllm.config import cpu_wait_while_loading
    from cllm.serve import parse_args
    options = parse_args(["--threads", str(threads), *cllm_args])
    try:
        with cpu_wait_while_loading(options["cpu_wait"], options["threads"]):
            from cllm.llama import _core  # noqa: F401
    except ImportError as e:  # the compiled core is missing: a source checkout, not built
        raise SystemExit(f"--engine-direct needs cllm built (pip install .): {e}") from e


class EngineTarget:
    """Sends prompts to an Engine running in this process; never raises from send()."""

    def __init__(self, model_path: str, s: ServerSettings, load: LoadSettings) -> None:
        from cllm.config import SamplingParams
        from cllm.serve import build_config, parse_args
        # The started server's options, --cllm-args included (decode steps, stream interval):
        server = build_config(parse_args(cllm_flags(model_path, s)))
        config = server.engine
        from cllm.engine.engine import Engine  # loaded by now as the server would load it (main)
        self.engine = Engine(config, model_path)
        self.sampling = SamplingParams(max_tokens=load.max_tokens, ignore_eos=load.ignore_eos,
                                       **load.sampling)
        self.cache_prompt = load.cache_prompt is not False  # unsent: the server's default, on
        # A streamed request's deltas as the server cuts them; else a step's tokens at once.
        self.stream_interval = server.stream_interval if load.stream else None

    def sampled(self, fields: dict) -> Callable[[str | Sized], Awaitable[RequestResult]]:
        """A send() whose requests carry these sampling fields instead."""
        sampling = replace(self.sampling, **fields)
        return lambda prompt: self.send(prompt, sampling)

    async def send(self, prompt: str | Sized, sampling=None) -> RequestResult:
        r = RequestResult(start=time.perf_counter())
        sampling = sampling or self.sampling
        if isinstance(prompt, Sized):
            prompt, sampling = prompt.prompt, replace(sampling, max_tokens=prompt.max_tokens)
        try:
            stream = self.engine.submit(self.engine.model.tokenize(prompt), sampling,
                                        cache_prompt=self.cache_prompt,
                                        stream_interval=self.stream_interval)
            async for delta in stream:
                if delta.token_ids:
                    r.arrive(time.perf_counter())
                if delta.finish_reason is not None:
                    r.finish_reason = delta.finish_reason
                    r.prompt_tokens = delta.prompt_tokens
                    r.cached_tokens = delta.cached_tokens
                    r.output_tokens = delta.completion_tokens
                    r.error = delta.error or _failed_finish(delta.finish_reason)
        except Exception as e:  # recorded like an HTTP failure, never lost
            r.error = f"{type(e).__name__}: {e}"
        r.end = time.perf_counter()
        return check_tokens(r)

    async def step_counts(self) -> dict:
        """The engine's step timer so far (`steptimer.since` of two: the steps between)."""
        return self.engine.timer.snapshot()

    def shutdown(self) -> None:
        self.engine.shutdown()
