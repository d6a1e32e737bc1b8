"""The HTTP layer's shared plumbing, for the app (cllm/app/server.py) and every protocol's
routes: the app's state, reading bodies, errors and their shapes, SSE, and one generation's
response."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cllm.config import ApiKey, SamplingParams, ServerConfig
from cllm.engine.engine import Delta, Engine, EngineStoppedError, PromptTooLongError
from cllm.engine.sequence import FINISH_ABORT
from cllm.engine.structured import GrammarError
from cllm.errors import APIError
from cllm.http import schemas
from cllm.http.formats import Format, GenerateFormat
from cllm.http.generation import Generation, SequenceFailure, failure
from cllm.http.metrics import Metrics, merge
from cllm.http.pool import Overdue, PoolClosed, WorkPool
from cllm.http.quotas import Quotas
from cllm.http.registry import EngineFactory, ModelRegistry, ServedModel
from cllm.http.responses import anthropic_error, ollama_error
from cllm.http.schemas import Constraint
from cllm.models import ModelSource

log = logging.getLogger(__name__)

# Threads that tokenize client text. llama.cpp tokenizes without the GIL and cannot be
# interrupted; two threads keep one long text from holding every short one behind it, and the
# pool's own threads keep tokenizing from crowding the default executor (engine shutdown,
# grammar compiles), as vLLM gives its tokenizer an executor of its own.
TOKENIZER_THREADS = 2


def shutting_down() -> APIError:
    """What a request gets once the server is stopping."""
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")


class AppState:
    """The models (each with its engine once loaded), the metrics and the tokenizer threads of
    one app."""

    def __init__(self, config: ServerConfig, sources: list[ModelSource],
                 make_engine: EngineFactory) -> None:
        self.config = config
        self.metrics = Metrics(frozenset(k.name for k in config.keys() if k.name))
        self.models = ModelRegistry(config, sources, make_engine, self.metrics)
        self.quotas = Quotas()
        self.tokenizer = WorkPool(TOKENIZER_THREADS, "cllm-tokenize")
        self.stopping = False

    async def stop(self) -> None:
        """Refuse new requests and end the running ones, each with a stated 503 (reason
        'shutdown'); idempotent."""
        self.stopping = True
        self.tokenizer.close()
        await asyncio.to_thread(self.models.close)

    @property
    def busy(self) -> bool:
        """Whether work that cannot be interrupted (tokenizing, rendering) still runs."""
        return self.tokenizer.busy or any(m.renderer is not None and m.renderer.busy
                                          for m in self.models.models.values())

    def check_health(self) -> None:
        if self.stopping:
            raise shutting_down()
        for model in self.models.models.values():
            model.check_health()

    async def model_for(self, request: Request, body: dict | None = None) -> ServedModel:
        """The model a request's body names (the only or first one if none), loaded and held
        until the request's handler returns (its sequences hold it until they end)."""
        if self.stopping:
            raise shutting_down()
        held = request.scope.setdefault("state", {})
        if MODEL_STATE not in held:
            name = schemas.read_field(body, "model", "a string") if body is not None else None
            held[MODEL_STATE] = await self.models.acquire(name)
        return held[MODEL_STATE]

    async def engine_for(self, request: Request, body: dict | None = None) -> Engine:
        """The engine of the model a request's body names (model_for)."""
        return (await self.model_for(request, body)).require_engine()

    def release(self, request: Request) -> None:
        """The request's handler returned: its hold on its model ends."""
        model = request.scope.get("state", {}).pop(MODEL_STATE, None)
        if model is not None:
            self.models.release(model)

    def render_metrics(self) -> bytes:
        """The exposition: with several models, each one's samples labelled `model`."""
        if len(self.models.models) == 1:
            return self.metrics.render()
        return merge({"": self.metrics.render(),
                      **{name: m.metrics.render() for name, m in self.models.models.items()}},
                     label="model")

    def sequence_ended(self, model: ServedModel, sampling: SamplingParams, key: ApiKey | None,
                       delta: Delta) -> None:
        """Every sequence's final delta, whether or not its client is still reading. An abort is
        the client's doing (it left), not a failure of the server."""
        self.models.release(model)
        self.quotas.ended(key, delta.prompt_tokens + delta.completion_tokens)
        error = failure(delta) if delta.finish_reason != FINISH_ABORT else None
        model.metrics.record_sequence(sampling, delta)
        model.metrics.record_outcome(delta.finish_reason, error.status if error else None)
        if self.config.log_requests:
            t = delta.timings or {}
            rate = delta.completion_tokens / t["total"] if t.get("total") else 0.0
            log.info("request prompt=%d generated=%d ttft=%.3fs %.1f tok/s outcome=%s%s",
                     delta.prompt_tokens, delta.completion_tokens, t.get("ttft", float("nan")),
                     rate, delta.finish_reason, f" ({delta.error})" if delta.error else "")


# ---- plumbing shared by the routes ----

async def read_json(request: Request, config: ServerConfig) -> dict:
    """The body as a JSON object (read_body's limits)."""
    return schemas.parse_json_body(await read_body(request, config), config.max_body_bytes)


async def read_body(request: Request, config: ServerConfig) -> bytes:
    """The body, read within config.client_timeout: a client that stalls mid-body gets a 408
    and its connection closed rather than holding it; one over max_body_bytes gets a 413."""
    try:
        return await asyncio.wait_for(_read_body(request, config.max_body_bytes),
                                      config.client_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {config.client_timeout:g} s",
                       code="body_timeout", headers={"Connection": "close"}) from None


async def _read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body over {limit} bytes", code="body_too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > limit:
            raise APIError(413, f"request body over {limit} bytes", code="body_too_large")
    return bytes(raw)


async def tokenize_text(request: Request, engine: Engine, text: str, *,
                        add_special: bool) -> list[int]:
    """Special-token text parsed as such (tokenizer_work: off the loop, bounded)."""
    return await tokenizer_work(request, engine.model.tokenize, text, add_special, True)


async def tokenizer_work(request: Request, fn, *args):
    """fn(*args) on the tokenizer's threads for this request: megabytes take seconds, while
    the event loop serves the other requests. Work whose client leaves before its turn is
    dropped; a stopping server answers 503 at once. Past --tokenize-timeout (its wait for a
    thread included) it is a 503 with Retry-After: a text within the body limit takes a few
    seconds on a free tokenizer, so the server was busy: a 503, which OpenAI's and Anthropic's
    clients retry, as llama-server answers 503 (unavailable_error) while it cannot serve yet.
    vLLM and llama-server set no deadline here."""
    state: AppState = request.app.state.cllm
    timeout = state.config.tokenize_timeout
    try:
        return await until_disconnect(request, state.tokenizer.run(fn, *args, timeout=timeout))
    except PoolClosed:
        raise shutting_down() from None
    except Overdue:
        raise APIError(503, f"the tokenizer did not finish within {timeout:g} s "
                       "(--tokenize-timeout): the server is busy, retry later", type="server_error",
                       code="tokenize_timeout", headers={"Retry-After": "1"}) from None


async def chat_prompt(request: Request, engine: Engine, messages: list[dict],
                      tools: list[dict] | None = None) -> list[int]:
    """A conversation's prompt tokens, rendered by the model's chat template (with the tools
    offered to the model, if any). A render whose client leaves before its turn is dropped."""
    renderer = request_model(request).renderer
    try:
        text = await until_disconnect(request, renderer.render(messages, tools))
    except PoolClosed:
        raise shutting_down() from None
    # Templates that write the BOS token themselves must not get a second one. The check is on
    # the BOS token's text ("<bos>"): its piece without special=True is empty.
    bos = renderer.template.bos_token if engine.model.adds_bos else None
    return await tokenize_text(request, engine, text,
                               add_special=not (bos and text.startswith(bos)))


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def until_disconnect(request: Request, awaitable):
    """Await `awaitable`, cancelling it (and so aborting its sequences) if the client leaves."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this task is cancelled: the work must not run on unobserved
        watcher.cancel()
        if not work.done():
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await work
    if work.cancelled():
        raise ClientGone()
    return work.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class SSEResponse(StreamingResponse):
    """Closes its body generator at once when the response ends, the client gone or not, so the
    sequences behind it are aborted now rather than when the generator is collected."""

    def __init__(self, body, media_type: str = "text/event-stream") -> None:
        super().__init__(body, media_type=media_type,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def error_response(error: APIError, fmt_error_body=APIError.body) -> JSONResponse:
    return JSONResponse(fmt_error_body(error), status_code=error.status, headers=error.headers)


# Where the access check leaves the API key a request came with (a config.ApiKey), and where
# AppState.model_for leaves the model (a registry.ServedModel) the request holds.
KEY_STATE = "cllm_api_key"
MODEL_STATE = "cllm_model"


def request_model(request: Request) -> ServedModel:
    """The model the request resolved (AppState.model_for) and holds."""
    return request.scope["state"][MODEL_STATE]


def for_caller(sampling: SamplingParams, key: ApiKey | None) -> SamplingParams:
    """A request sent with a named key counts for that key's user, at its weight, and asks
    for no lower priority value than the key's; without one, the request's own `user` field
    names the user."""
    if key is None or not key.name:
        return sampling
    return dataclasses.replace(sampling, user=key.name, user_weight=key.weight,
                               priority=max(sampling.priority, key.priority))


async def respond(request: Request, fmt: Format, prompt: list[int], sampling: SamplingParams,
                  n: int, stream: bool, include_usage: bool, cache_prompt: bool) -> Response:
    """Submit n sequences for one request and answer it, streamed or whole."""
    return await respond_batch(request, fmt, [prompt], sampling, n, stream, include_usage,
                               cache_prompt)


async def respond_batch(request: Request, fmt: Format, prompts: list[list[int]],
                        sampling: SamplingParams, n: int, stream: bool, include_usage: bool,
                        cache_prompt: bool) -> Response:
    """Submit n sequences for each prompt and answer them together, streamed or whole: choice
    prompt index * n + i, as OpenAI answers a batch of prompts; all run in the engine at once."""
    state: AppState = request.app.state.cllm
    model = await state.model_for(request)
    engine = model.require_engine()
    for prompt in prompts:
        _check_prompt(engine, prompt)
    key = request.scope.get("state", {}).get(KEY_STATE)
    sampling = for_caller(sampling, key)
    total = len(prompts) * n
    state.quotas.admit(key, total)
    streams = []
    # A whole response reads only the sum of the deltas: they may come as the engine makes them.
    interval = state.config.stream_interval if stream else None
    on_end = functools.partial(state.sequence_ended, model, sampling, key)
    try:
        for prompt in prompts:
            for i in range(n):
                streams.append(engine.submit(prompt, sampling.for_choice(i),
                                             f"{fmt.request_id}-{len(streams)}", on_end=on_end,
                                             cache_prompt=cache_prompt,
                                             stream_interval=interval))
                state.models.hold(model)  # until the sequence ends (sequence_ended)
    except BaseException as exc:  # nothing submitted may decode on with nobody reading it
        for s in streams:
            s.abort()
        for _ in range(total - len(streams)):  # never submitted: out of flight at once
            state.quotas.ended(key, 0)
        if isinstance(exc, PromptTooLongError):
            raise APIError(400, str(exc), code="context_length_exceeded",
                           param="prompt") from exc
        if isinstance(exc, EngineStoppedError):
            raise APIError(503, str(exc), type="server_error", code="engine_stopped") from exc
        raise
    generation = Generation(streams, fmt)
    if stream:
        await until_disconnect(request, generation.first_event())
        return SSEResponse(generation.sse(include_usage), fmt.media_type)
    return JSONResponse(await until_disconnect(request, generation.collect()))


def _check_prompt(engine: Engine, prompt: list[int]) -> None:
    if not prompt:  # text such as "\x1d" can tokenize to nothing
        raise APIError(400, "the prompt has no tokens", param="prompt")
    if max(prompt) >= engine.model.n_vocab or min(prompt) < 0:
        raise APIError(400, f"token ids must be in [0, {engine.model.n_vocab})", param="prompt")


def new_format(cls, request: Request, prefix: str, sampling: SamplingParams,
               **options) -> Format:
    """A response format for one request; `options` go to the format's constructor."""
    model = request_model(request)
    return cls(f"{prefix}-{uuid.uuid4().hex[:24]}", model.name, int(time.time()),
               model.token, sampling.logprobs is not None, **options)


async def constrained(engine: Engine, sampling: SamplingParams,
                      constraint: Constraint | None) -> SamplingParams:
    """`sampling` with its constraint compiled (cached by its text; in a worker thread, since
    a large schema takes a while). One that does not compile is a 400 naming its field, before
    anything is queued."""
    if constraint is None:
        return sampling
    compile_ = {"json_schema": engine.grammars.json_schema, "gbnf": engine.grammars.gbnf,
                "lark": engine.grammars.lark}[constraint.kind]
    try:
        grammar = await asyncio.to_thread(compile_, constraint.value)
    except GrammarError as exc:
        raise APIError(400, f"{constraint.param}: {exc}", param=constraint.param,
                       code="invalid_grammar") from None
    return dataclasses.replace(sampling, grammar=grammar)


def guarded(handler, error_body=APIError.body):
    """Route wrapper: APIError → its status and body; anything else → a logged 500."""
    async def route(request: Request) -> Response:
        state: AppState = request.app.state.cllm
        try:
            return await handler(request, state)
        except APIError as error:
            if not isinstance(error, SequenceFailure):  # those were counted as they ended
                metrics_of(request, state).record_outcome(None, error.status)
            return error_response(error, error_body)
        except ClientGone:
            return Response(status_code=499)
        except Exception:  # a real fault: say so, keep serving
            # Its details (paths, values) are for the log, not for the client.
            log.exception("internal error in %s", request.url.path)
            metrics_of(request, state).record_outcome(None, 500)
            return error_response(APIError(500, "internal server error (see the server log)",
                                           type="server_error", code="internal_error"),
                                  error_body)
        finally:
            state.release(request)
    return route


def metrics_of(request: Request, state: AppState) -> Metrics:
    """The metrics of the model the request went to, else the server's."""
    model = request.scope.get("state", {}).get(MODEL_STATE)
    return state.metrics if model is None else model.metrics


def error_shape(path: str):
    """The error body of a route: /generate keeps the original API's, /v1/messages (and its
    count_tokens) has Anthropic's, Ollama's /api/... its own."""
    if path.startswith("/api/"):
        return ollama_error
    return {"/generate": GenerateFormat.error_body_of, "/v1/messages": anthropic_error,
            "/v1/messages/count_tokens": anthropic_error}.get(path, APIError.body)
