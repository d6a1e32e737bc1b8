"""Configuration dataclasses: what a request asks for, how the engine and the server run.

Values are checked here, with ValueError naming the field, so every layer can trust them."""
from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Iterator

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_TOP_LOGPROBS = 20
# llama.cpp seeds its samplers with 32 bits, and takes 0xFFFFFFFF as "pick one at random": the
# seeds that mean distinct streams are 0 .. 2**32 - 2. -1 (llama-server's "random") is no seed.
MAX_SEED = (1 << 32) - 2
MAX_PRIORITY = (1 << 31) - 1  # a 32-bit integer either way, as vLLM's


def _check_range(name: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi) or (isinstance(value, float) and math.isnan(value)):
        raise ValueError(f"{name} must be between {lo} and {hi}, got {value}")


@dataclass(slots=True)
class SamplingParams:
    """How one request is sampled and when it stops. temperature 0 is greedy."""
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: the chosen token's and the k most likely
    grammar: object | None = None  # a structured.Grammar the output must match, or None
    # Lower runs first, as vLLM's `priority`: admitted before, and preempting, higher values.
    priority: int = 0
    # Whose request it is, and that user's weight: requests of the same priority start in
    # proportion to their users' weights (cllm/engine/fair_share.py).
    user: str = ""
    user_weight: float = 1.0

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of n: one seed must still give n different choices,
        so choice i takes seed + i, wrapping within the seed space."""
        if self.seed is None or index == 0:
            return self
        return replace(self, seed=(self.seed + index) % (MAX_SEED + 1))

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        _check_range("temperature", self.temperature, 0.0, 100.0)
        _check_range("top_p", self.top_p, 0.0, 1.0)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("top_k", self.top_k, 0, 1 << 20)
        _check_range("repeat_penalty", self.repeat_penalty, 0.0, 100.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if self.repeat_penalty == 0.0:
            raise ValueError("repeat_penalty must be greater than 0")
        if self.seed == -1:
            self.seed = None
        if self.seed is not None:
            _check_range("seed", self.seed, 0, MAX_SEED)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_LENGTH:
                raise ValueError(f"stop strings must be 1 to {MAX_STOP_LENGTH} characters")
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS)
        _check_range("priority", self.priority, -MAX_PRIORITY, MAX_PRIORITY)
        if not self.user_weight > 0:
            raise ValueError(f"user_weight must be above 0, got {self.user_weight}")


@dataclass(slots=True)
class EngineConfig:
    """How the model runs: context, parallel sequences, batch, threads, GPU."""
    model: str = "smollm2-135m-instruct"
    n_ctx: int = 32768  # KV cells shared by all sequences (or n_ctx / n_parallel each, split)
    n_parallel: int = 16
    # True: one pool of cells for all sequences, preempting when it runs out; every row attends
    # over the pool's occupied span. False: a stream of n_ctx / n_parallel cells per sequence,
    # which attends over its own cells only: on the CPU that is faster with long prompts and a
    # greedy output does not depend on its batch; on a GPU (H200) it is faster for some
    # workloads and slower for chats, and it caps each sequence at n_ctx / n_parallel. None:
    # split on a CPU, one pool on a GPU (docs/design/kv-layout.md has the measurements).
    kv_unified: bool | None = None
    prefix_cache: bool = True  # start sequences from the KV of cached prompt prefixes
    # Whether finished sequences' replies stay cached in one pool (split streams keep them):
    # "auto" while recent requests continue earlier replies (chats), "keep" or "drop".
    cache_replies: str = "auto"
    # Whether their prompts stay cached in one pool: "auto" while recent requests start from
    # idle prompts (documents, conversations), not only from running sequences'; "keep", "drop".
    cache_prompts: str = "auto"
    # MiB of host RAM for prefixes evicted from the KV cache (docs/design/kv-tiers.md); 0: off.
    # None: an eighth of the memory available at start, at most 8 GiB.
    cache_ram: int | None = None
    # A folder for prefixes evicted from RAM and for all cached prefixes at a clean shutdown, so
    # a restarted server goes on from them; None: no disk tier. At most cache_disk MiB of files.
    cache_dir: str | None = None
    cache_disk: int = 8192
    # Greedy sequences sampled inside llama.cpp's decode graph, on the device: their logits never
    # travel to the host. None: on where a GPU runs the model, off on a CPU, where the logits
    # are in host memory already (docs/design/sampling.md).
    backend_sampling: bool | None = None
    n_batch: int = 512
    # Prompt tokens a step may spend ending prompts besides the first it ends; 0: 16 on a CPU,
    # where every token of a step costs about the same, and n_batch on a GPU
    # (docs/design/prompt-scheduling.md).
    prefill_stagger: int = 0
    n_ubatch: int = 512
    n_threads: int = 0  # 0: every core this process may use
    cpu_wait: str = "auto"  # how CPU threads wait for each other: see apply_cpu_wait
    n_gpu_layers: int = -1  # -1: every layer the GPU build can take
    flash_attn: str = "auto"
    max_queue: int = 1024
    decode_steps: int = 0  # decode steps per call into C while only decodes run; 0: auto
    # After a step that ended requests, wait up to this share of a step's time for new ones (a
    # client's next request), while recent ends were followed by one that soon. None: 0.5 on a
    # CPU, 0 on a GPU (cllm/engine/successor_wait.py).
    successor_wait: float | None = None
    request_timeout: float = 600.0  # seconds from arrival to the last token

    def __post_init__(self) -> None:
        for name in ("n_ctx", "n_parallel", "n_batch", "n_ubatch", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.n_parallel > 256:
            raise ValueError("n_parallel must be at most 256 (llama.cpp's sequence limit)")
        if self.flash_attn not in ("auto", "on", "off"):
            raise ValueError(f"flash_attn must be auto, on or off, got {self.flash_attn!r}")
        if self.prefill_stagger < 0:
            raise ValueError("prefill_stagger must be 0 (auto) or positive, "
                             f"got {self.prefill_stagger}")
        if self.request_timeout <= 0:
            raise ValueError("request_timeout must be positive")
        if self.successor_wait is not None:
            _check_range("successor_wait", self.successor_wait, 0.0, 1.0)
        if self.cpu_wait not in CPU_WAIT_MODES:
            raise ValueError(f"cpu_wait must be one of {', '.join(CPU_WAIT_MODES)}, "
                             f"got {self.cpu_wait!r}")
        if self.cache_ram is not None and self.cache_ram < 0:
            raise ValueError(f"cache_ram must be 0 (off) or positive MiB, got {self.cache_ram}")
        for name in ("cache_replies", "cache_prompts"):
            if getattr(self, name) not in RETENTION_MODES:
                raise ValueError(f"{name} must be one of {', '.join(RETENTION_MODES)}, "
                                 f"got {getattr(self, name)!r}")


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A client's key and what it is given: its name (the user its requests count for in the
    fair shares), its weight there, the lowest priority value its requests may have, and its
    quotas (None: no limit): sequences in flight, and prompt plus generated tokens a minute."""
    key: str
    name: str = ""
    weight: float = 1.0
    priority: int = 0
    max_requests: int | None = None
    tokens_per_minute: int | None = None


def parse_api_keys(text: str) -> tuple[ApiKey, ...]:
    """An API key file: a key a line, each optionally followed by name=NAME, weight=W,
    priority=P, max_requests=N and tokens_per_minute=N (blank lines and lines starting with #
    are skipped)."""
    keys = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        try:
            keys.append(_api_key(words[0], words[1:]))
        except ValueError as exc:
            raise ValueError(f"line {number}: {exc}") from None
    return tuple(keys)


_KEY_FIELDS = {"name": str, "weight": float, "priority": int, "max_requests": int,
               "tokens_per_minute": int}


def _api_key(key: str, words: list[str]) -> ApiKey:
    fields = {}
    for word in words:
        name, sep, value = word.partition("=")
        if not sep or name not in _KEY_FIELDS or name in fields:
            raise ValueError(f"{word!r} is not one of {', '.join(f + '=' for f in _KEY_FIELDS)}")
        try:
            fields[name] = _KEY_FIELDS[name](value)
        except ValueError:
            kind = "an integer" if _KEY_FIELDS[name] is int else "a number"
            raise ValueError(f"{name} takes {kind}, got {value!r}") from None
    entry = ApiKey(key, **fields)
    if not entry.weight > 0:
        raise ValueError("the weight must be above 0")
    for name in ("max_requests", "tokens_per_minute"):
        if getattr(entry, name) is not None and getattr(entry, name) < 1:
            raise ValueError(f"{name} must be at least 1")
    return entry


@dataclass(slots=True)
class ServerConfig:
    """Where and how the HTTP server listens."""
    served_model_name: str | None = None  # the model's name in the API; None: from --model
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    api_keys: tuple[ApiKey, ...] = ()  # from --api-key-file, each with its name and share
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 16  # completions per request ("n")
    shutdown_grace: float = 30.0
    template_timeout: float = 10.0  # seconds a chat template may take to render a prompt
    # Seconds a request's text may take to tokenize, its wait for a tokenizer thread included.
    # A body at the 4 MB limit takes about 1.5 s on a 2-core CPU as plain text, 10 s as text
    # dense in special tokens ("<|im_end|>a" repeated): this leaves room for a few ahead of it.
    tokenize_timeout: float = 30.0
    client_timeout: float = 30.0  # seconds a client may take to send a request's headers, or body
    max_connections: int = 1000  # open connections (and requests) before uvicorn answers 503
    log_requests: bool = True
    # Tokens a streamed event carries at most (vLLM's --stream-interval): the first token goes
    # at once, then every `stream_interval` tokens (cllm/engine/pending.py; the figures are in
    # docs/design/streaming.md).
    stream_interval: int = 1
    # Several models (cllm/http/registry.py): --model arguments (none: engine.model alone), a
    # folder whose GGUF files are served too, seconds a loaded model stays loaded once idle
    # (0: unloads after its last request, negative: never; None: never with one model, else
    # DEFAULT_KEEP_ALIVE), the most loaded at once (0: no cap), names that stay loaded.
    models: tuple[str, ...] = ()
    models_dir: str | None = None
    keep_alive: float | None = None
    models_max: int = 0
    pinned: tuple[str, ...] = ()
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self) -> None:
        for name in ("template_timeout", "tokenize_timeout", "client_timeout",
                     "max_connections"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}")
        if self.models_max < 0:
            raise ValueError(f"models_max must be 0 (no cap) or more, got {self.models_max}")

    def keep_alive_for(self, n_models: int) -> float:
        """Seconds an idle model stays loaded; infinite: never unloads."""
        if self.keep_alive is None:
            return math.inf if n_models == 1 else DEFAULT_KEEP_ALIVE
        return math.inf if self.keep_alive < 0 else self.keep_alive

    def keys(self) -> tuple[ApiKey, ...]:
        """Every key that opens the server: --api-key's (no name) and the key file's."""
        return ((ApiKey(self.api_key),) if self.api_key else ()) + self.api_keys


DEFAULT_KEEP_ALIVE = 300.0  # Ollama's five minutes, for a server of several models
# A duration in Go's notation ("5m", "1h30m", "-1s", "500ms"), as Ollama's keep_alive takes it.
_DURATION = re.compile(r"[-+]?(?:(?:\d+\.?\d*|\.\d+)(?:ns|us|µs|ms|s|m|h))+")
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|µs|ms|s|m|h)")
_SECONDS = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | float) -> float:
    """A keep-alive as Ollama takes it, in seconds: a number of seconds (also as text, "-1"),
    or a duration in Go's notation ("500ms", "5m", "1h30m"); negative means forever."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        return float(text)
    value = text.strip() if isinstance(text, str) else ""
    if _SECONDS.fullmatch(value):
        return float(value)
    if _DURATION.fullmatch(value):
        sign = -1.0 if value.startswith("-") else 1.0
        return sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in _DURATION_PART.findall(value))
    raise ValueError(f"not a duration: {text!r} (seconds, or a duration such as 5m or 1h30m; "
                     "negative: never)")


CPU_WAIT_MODES = ("auto", "spin", "sleep")
# Whether finished requests' cells stay cached in one pool (prefix_cache.Retention decides).
RETENTION_MODES = ("auto", "keep", "drop")


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask, which containers narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def apply_cpu_wait(mode: str, n_threads: int) -> str:
    """Choose how llama.cpp's CPU threads (OpenMP) wait at the barriers between operations.

    spin: libgomp's default, busy-waiting up to milliseconds; the fastest on an idle machine,
    but when the threads take every core, any other busy process preempts one of them and the
    rest spin through its time slice: a step became ~10x slower beside a competing load.
    sleep: wait in the kernel at once; graceful under load, but a wake-up at each of the
    hundreds of barriers of a step cost 28% of the tokens/s of one stream on an idle machine.
    auto: when the threads take every usable core, spin briefly (GOMP_SPINCOUNT=3000, tens of
    microseconds: longer than most waits of an idle step, far shorter than a time slice) and
    then sleep; spin when a core is spare. docs/design/cpu-waits.md has the measurements.
    OpenMP reads this once, when llama.cpp loads, so call it before that; a policy the user put
    in the environment (OMP_WAIT_POLICY, GOMP_SPINCOUNT) wins. Returns the policy in effect."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return "environment"
    if mode == "auto":
        if 0 < n_threads < usable_cores():
            return "spin"
        os.environ["GOMP_SPINCOUNT"] = str(BRIEF_SPIN)
        return f"spin {BRIEF_SPIN}, then sleep"
    if mode == "sleep":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return mode


BRIEF_SPIN = 3000  # libgomp spin iterations before a thread sleeps (its default: 300,000)
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # what apply_cpu_wait may set


@contextmanager
def cpu_wait_while_loading(mode: str, n_threads: int) -> Iterator[str]:
    """apply_cpu_wait for a llama.cpp loaded inside the block, the environment as it was after
    it: for a process that loads an engine and then starts other programs (the benchmark's
    engine-direct target, then llama-server), which must keep their own defaults. Yields the
    policy in effect."""
    saved = {name: os.environ.get(name) for name in WAIT_VARIABLES}
    try:
        yield apply_cpu_wait(mode, n_threads)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
