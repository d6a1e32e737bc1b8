"""The models one server serves, each loaded on demand.

A `ServedModel` is one model: its engine, chat template renderer, embeddings, the names it
answers to, its metrics, its state (unloaded, loading, loaded, failed and why), when it was last
used and how much of its work is in flight. The `ModelRegistry` resolves a request's `model`
field to one, loads it on its first request (requests that arrive meanwhile wait for that one
load), and unloads it once idle for --keep-alive or to make room under --models-max (the least
recently used first; never a pinned model, nor one with requests in flight). Unloading frees the
engine's llama.cpp context and weights, so the process's memory comes back."""
from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import math
import time
from collections.abc import Callable

from cllm.config import ServerConfig
from cllm.engine.embedder import Embeddings
from cllm.engine.engine import Engine, Model
from cllm.errors import APIError
from cllm.http.chat_template import ChatTemplate, TemplateRenderer
from cllm.http.metrics import Metrics
from cllm.http.model_card import model_names, repo_id
from cllm.http.responses import Token, token_name
from cllm.models import ModelSource, check_names

log = logging.getLogger(__name__)
# Makes a model's engine from its file, calling back with the model once its weights are loaded.
EngineFactory = Callable[[str, Callable[[Model], None]], Engine]

UNLOADED, LOADING, LOADED, FAILED = "unloaded", "loading", "loaded", "failed"


def not_ready(message: str) -> APIError:
    return APIError(503, message, type="server_error", code="model_not_ready")


class ServedModel:
    """One model of the server and, while loaded, its engine."""

    def __init__(self, source: ModelSource, metrics: Metrics, template_timeout: float,
                 pinned: bool) -> None:
        self.source = source
        self.name = source.name
        self.root = source.name  # the repository id once loaded, if known
        # All it answers to (model_card.model_names): its repository's id too once loaded.
        self.names = model_names(source.name, source.name, source.path)
        self.metrics = metrics
        self.pinned = pinned
        self.status = UNLOADED
        self.reason: str | None = None  # why it failed to load
        self.at_start = False  # loading (or failed) when the server started: /health waits
        self.engine: Engine | None = None
        self.renderer: TemplateRenderer | None = None
        self.embeddings: Embeddings | None = None
        self._template_timeout = template_timeout
        self.in_flight = 0  # requests being handled and sequences in the engine
        self.last_used = 0.0  # time.monotonic() of the last start or end of its work
        self.lock = asyncio.Lock()  # one load or unload at a time
        self.idle_timer: asyncio.TimerHandle | None = None
        # Seconds it stays loaded once idle, as the last request that said so asked (Ollama's
        # keep_alive; negative: for good); None: the server's --keep-alive.
        self.keep_alive: float | None = None

    @property
    def resident(self) -> bool:
        return self.status in (LOADING, LOADED)

    def load(self, make_engine: EngineFactory) -> None:
        """Load the engine and what reads its vocabulary (blocking: a worker thread's)."""
        started = time.perf_counter()
        engine = make_engine(self.source.path, self._start_renderer)
        model = engine.model
        self.embeddings = Embeddings(engine)
        self.metrics.watch(engine, self.embeddings)
        self.root = repo_id(model.metadata, self.source.argument) or self.name
        self.names = model_names(self.name, self.root, model.path)
        self.engine = engine
        self.metrics.load_seconds.set(time.perf_counter() - started)
        self.metrics.loads.inc()

    def _start_renderer(self, model: Model) -> None:
        """The chat template's renderer, from the model's vocabulary: its worker processes
        start while the engine makes its context (on a 2-core CPU each takes about as long)."""
        # A vocabulary without BOS or EOS reports -1 for it: no text.
        piece = lambda t: (model.token_to_piece(t, True).decode("utf-8", "replace")  # noqa: E731
                           if t >= 0 else "")
        try:
            template = ChatTemplate(model.chat_template, bos_token=piece(model.bos_token),
                                    eos_token=piece(model.eos_token))
        except ValueError as exc:
            log.warning("the chat template of %s does not compile (%s); using ChatML",
                        self.name, exc)
            template = ChatTemplate(None, bos_token=piece(model.bos_token),
                                    eos_token=piece(model.eos_token))
        self.renderer = TemplateRenderer(template, timeout=self._template_timeout)

    def unload(self) -> None:
        """Stop the engine and drop every reference to it, so that llama.cpp frees its context
        and weights (blocking)."""
        engine, renderer, embeddings = self.engine, self.renderer, self.embeddings
        self.engine = self.renderer = self.embeddings = None
        self.metrics.unwatch()
        if renderer is not None:
            renderer.close(wait=True)
        if embeddings is not None:
            embeddings.close()
        if engine is not None:
            engine.shutdown()
        del engine, renderer, embeddings
        gc.collect()  # the engine's objects refer to each other: free them now, not later
        _trim_heap()


    def close(self) -> None:
        """The server is stopping: end what runs (blocking)."""
        if self.renderer is not None:
            self.renderer.close()
        if self.embeddings is not None:
            self.embeddings.close()
        if self.engine is not None:
            self.engine.shutdown()

    def require_engine(self) -> Engine:
        if self.engine is None:
            raise not_ready(self.reason or "the model is loading")
        if self.engine.failure:
            raise APIError(503, self.engine.failure, type="server_error", code="engine_failed")
        return self.engine

    def check_health(self) -> None:
        """A model that loads as the server starts makes /health wait for it; an engine that
        failed makes it fail."""
        if self.at_start and self.status in (LOADING, FAILED):
            raise not_ready(self.reason or "the model is loading")
        if self.engine is not None and self.engine.failure:
            raise APIError(503, self.engine.failure, type="server_error", code="engine_failed")

    def token(self, token: int) -> Token:
        """A token as logprobs show it: the bytes it adds to the text, named by them; a control
        token, which adds none, by its own name ("<|im_end|>"), so names stay distinct."""
        model = self.engine.model
        raw = model.token_to_piece(token)
        if raw:
            return Token(token_name(raw), raw)
        return Token(model.token_to_piece(token, True).decode("utf-8", "replace"), None)

    def describe(self) -> dict:
        """Its entry in GET /models, in llama-server's router shape."""
        status = {"value": self.status}
        if self.status == FAILED:
            status.update(failed=True, reason=self.reason)
        return {"id": self.name, "object": "model", "owned_by": "cllm", "created": 0,
                "path": self.source.path, "pinned": self.pinned, "in_flight": self.in_flight,
                "status": status}


class ModelRegistry:
    """Every model of the server by name, and the policy that loads and unloads them."""

    def __init__(self, config: ServerConfig, sources: list[ModelSource],
                 make_engine: EngineFactory, metrics: Metrics) -> None:
        check_names(sources, config.pinned)
        single = len(sources) == 1
        # One model keeps the server's metrics unlabelled, as before; several have their own.
        self.models = {s.name: ServedModel(s, metrics if single else Metrics(metrics.named_users),
                                           config.template_timeout, s.name in config.pinned)
                       for s in sources}
        self.default = self.models[sources[0].name]  # for requests that name none
        self.keep_alive = config.keep_alive_for(len(sources))
        self.models_max = config.models_max
        self._make_engine = make_engine
        self._room = asyncio.Lock()  # one decision at a time about which models are resident

    def find(self, name: str | None) -> ServedModel:
        """The model a request names by any of its names; none (or an empty name, as some
        clients send) is the first model. Another name is a 404 model_not_found, as OpenAI and
        vLLM answer it, rather than another model's reply under that name."""
        if not name:
            return self.default
        for model in self.models.values():
            if name in model.names:
                return model
        raise APIError(404, f"the model '{name}' does not exist", param="model",
                       code="model_not_found")

    def at_start(self) -> list[ServedModel]:
        """The models that load as the server starts: the only one, or the pinned ones."""
        if len(self.models) == 1:
            return [self.default]
        return [m for m in self.models.values() if m.pinned]

    # ---- work in flight ----

    def hold(self, model: ServedModel) -> None:
        model.in_flight += 1
        model.last_used = time.monotonic()
        if model.idle_timer is not None:
            model.idle_timer.cancel()
            model.idle_timer = None

    def release(self, model: ServedModel) -> None:
        model.in_flight -= 1
        model.last_used = time.monotonic()
        keep_alive = self.keep_alive_of(model)
        if model.in_flight == 0 and not model.pinned and math.isfinite(keep_alive):
            loop = asyncio.get_running_loop()
            model.idle_timer = loop.call_later(
                keep_alive, lambda: loop.create_task(self.unload(model, idle=True)))

    def ask_keep_alive(self, model: ServedModel, seconds: float) -> None:
        """A request's keep_alive for its model (Ollama's), kept where models load on demand:
        the one model of a single-model server stays as the server started it."""
        if len(self.models) > 1:
            model.keep_alive = seconds

    def keep_alive_of(self, model: ServedModel) -> float:
        """Seconds `model` stays loaded once idle: its last request's keep_alive, else the
        server's; inf for good."""
        if model.keep_alive is None:
            return self.keep_alive
        return math.inf if model.keep_alive < 0 else model.keep_alive

    def expires_in(self, model: ServedModel) -> float:
        """Seconds until `model` unloads if no request comes (inf: it stays)."""
        if model.pinned:
            return math.inf
        keep_alive = self.keep_alive_of(model)
        if model.in_flight:
            return keep_alive
        return max(0.0, model.last_used + keep_alive - time.monotonic())

    async def acquire(self, name: str | None) -> ServedModel:
        """The model a request names, loaded, held for the request (release it after)."""
        model = self.find(name)
        self.hold(model)
        try:
            await self.load(model)
        except BaseException:
            self.release(model)
            raise
        return model

    # ---- loading and unloading ----

    async def load(self, model: ServedModel, *, retry: bool = False,
                   at_start: bool = False) -> None:
        """Load `model` unless it is; concurrent callers wait for the one load. A model that
        failed stays failed (its requests get the reason) until loaded again with retry."""
        if model.status == LOADED:
            return
        if model.at_start and model.status == LOADING:  # as before: 503 until the server is up
            raise not_ready("the model is loading")
        async with model.lock:
            if model.status == LOADED:
                return
            if model.status == FAILED and not retry:
                raise not_ready(model.reason)
            async with self._room:
                await self._make_room(model)
                model.status, model.reason, model.at_start = LOADING, None, at_start
            try:
                await asyncio.to_thread(model.load, self._make_engine)
            except Exception as exc:
                model.status, model.reason = FAILED, f"the model failed to load: {exc}"
                log.error("%s: %s", model.name, model.reason)
                await asyncio.to_thread(model.unload)  # whatever the load had made
                raise not_ready(model.reason) from exc
            model.status = LOADED
            log.info("model %s loaded", model.name)

    async def unload(self, model: ServedModel, *, idle: bool = False) -> bool:
        """Unload `model` if nothing of it is in flight (and, when `idle`, only if it has been
        idle for the keep-alive, and is not pinned); whether it did."""
        async with model.lock:
            if model.status != LOADED or model.in_flight:
                return False
            if idle and (model.pinned or time.monotonic() - model.last_used
                         < self.keep_alive_of(model) - 0.01):
                return False
            model.status = UNLOADED  # from here a request waits for the lock, then loads it
            await asyncio.to_thread(model.unload)
        log.info("model %s unloaded", model.name)
        return True

    async def _make_room(self, model: ServedModel) -> None:
        """Unload the least recently used idle models until `model` fits --models-max."""
        if not self.models_max:
            return
        while sum(m.resident for m in self.models.values() if m is not model) >= self.models_max:
            idle = sorted((m for m in self.models.values() if m is not model
                           and m.status == LOADED and not m.pinned and not m.in_flight),
                          key=lambda m: m.last_used)
            if not idle:
                raise APIError(503, f"{self.models_max} models are loaded (--models-max), each "
                               "busy or pinned: retry later", type="server_error",
                               code="models_busy", headers={"Retry-After": "1"})
            await self.unload(idle[0])

    def close(self) -> None:
        """The server is stopping (blocking)."""
        for model in self.models.values():
            if model.idle_timer is not None:
                model.idle_timer.cancel()
            model.close()


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system: glibc keeps what a freed context and
    its threads' arenas held otherwise, tens of MiB a model."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator decides
        pass
