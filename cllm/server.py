"""The HTTP server: OpenAI-compatible routes, the original /generate, health, metrics.

`create_app()` returns a Starlette app; everything it holds lives in the lifespan's AppState."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import threading
import time
import uuid
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from cllm import api, tools
from cllm.api import APIError, Constraint
from cllm.chat_template import ChatTemplate, TemplateRenderer
from cllm.config import SamplingParams, ServerConfig
from cllm.embedder import Embeddings
from cllm.engine import Delta, Engine, EngineStoppedError, PromptTooLongError
from cllm.formats import ChatFormat, CompletionFormat, Format, GenerateFormat
from cllm.generation import Generation, SequenceFailure, failure
from cllm.metrics import CONTENT_TYPE, Metrics
from cllm.model_card import model_card, repo_id
from cllm.responses import Token, anthropic_error, token_name
from cllm.sequence import FINISH_ABORT
from cllm.structured import GrammarError

log = logging.getLogger("cllm.server")


def shutting_down() -> APIError:
    """What a request gets once the server is stopping."""
    return APIError(503, "the server is shutting down", type="server_error", code="shutting_down")


class AppState:
    """The engine (once loaded), the chat template's renderer and the metrics of one app."""

    def __init__(self, config: ServerConfig, model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.model_root = model_name  # the repository id once the model is loaded, if known
        self.metrics = Metrics()
        self.engine: Engine | None = None
        self.renderer: TemplateRenderer | None = None
        self.embeddings: Embeddings | None = None
        self.load_error: str | None = None
        self.stopping = False

    def load(self, engine_factory: Callable[[], Engine]) -> None:
        engine = engine_factory()
        model = engine.model
        # A vocabulary without BOS or EOS reports -1 for it: no text.
        piece = lambda t: (model.token_to_piece(t, True).decode("utf-8", "replace")  # noqa: E731
                           if t >= 0 else "")
        try:
            template = ChatTemplate(model.chat_template, bos_token=piece(model.bos_token),
                                    eos_token=piece(model.eos_token))
        except ValueError as exc:
            log.warning("the model's chat template does not compile (%s); using ChatML", exc)
            template = ChatTemplate(None, bos_token=piece(model.bos_token),
                                    eos_token=piece(model.eos_token))
        self.renderer = TemplateRenderer(template, timeout=self.config.template_timeout)
        self.embeddings = Embeddings(engine)
        self.metrics.watch(engine, self.embeddings)
        self.model_root = repo_id(model.metadata, self.config.engine.model) or self.model_name
        self.engine = engine

    async def stop(self) -> None:
        """Refuse new requests and end the running ones, each with a stated 503 (reason
        'shutdown'); idempotent."""
        self.stopping = True
        if self.renderer is not None:
            self.renderer.close()
        if self.embeddings is not None:
            self.embeddings.close()
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)

    def require_engine(self) -> Engine:
        if self.stopping:
            raise shutting_down()
        if self.engine is None:
            message = self.load_error or "the model is loading"
            raise APIError(503, message, type="server_error", code="model_not_ready")
        if self.engine.failure:
            raise APIError(503, self.engine.failure, type="server_error", code="engine_failed")
        return self.engine

    def token(self, token: int) -> Token:
        """A token as logprobs show it: the bytes it adds to the text, named by them; a control
        token, which adds none, by its own name ("<|im_end|>"), so names stay distinct."""
        model = self.engine.model
        raw = model.token_to_piece(token)
        if raw:
            return Token(token_name(raw), raw)
        return Token(model.token_to_piece(token, True).decode("utf-8", "replace"), None)

    def sequence_ended(self, delta: Delta) -> None:
        """Every sequence's final delta, whether or not its client is still reading. An abort is
        the client's doing (it left), not a failure of the server."""
        error = failure(delta) if delta.finish_reason != FINISH_ABORT else None
        self.metrics.record_sequence(delta)
        self.metrics.record_outcome(delta.finish_reason, error.status if error else None)
        if self.config.log_requests:
            t = delta.timings or {}
            rate = delta.completion_tokens / t["total"] if t.get("total") else 0.0
            log.info("request prompt=%d generated=%d ttft=%.3fs %.1f tok/s outcome=%s%s",
                     delta.prompt_tokens, delta.completion_tokens, t.get("ttft", float("nan")),
                     rate, delta.finish_reason, f" ({delta.error})" if delta.error else "")


# ---- plumbing shared by the routes ----

async def read_json(request: Request, config: ServerConfig) -> dict:
    """The body as a JSON object (read_body's limits)."""
    return api.parse_json_body(await read_body(request, config), config.max_body_bytes)


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


async def tokenize_text(engine: Engine, text: str, *, add_special: bool) -> list[int]:
    """Special-token text parsed as such. Megabytes take a second: the tokenizer runs in a
    thread, with the GIL released, while the event loop serves the other requests."""
    return await asyncio.to_thread(engine.model.tokenize, text, add_special=add_special,
                                   parse_special=True)


async def chat_prompt(state: AppState, engine: Engine, messages: list[dict],
                      tools: list[dict] | None = None) -> list[int]:
    """A conversation's prompt tokens, rendered by the model's chat template (with the tools
    offered to the model, if any)."""
    text = await state.renderer.render(messages, tools)
    # Templates that write the BOS token themselves must not get a second one. The check is on
    # the BOS token's text ("<bos>"): its piece without special=True is empty.
    bos = state.renderer.template.bos_token if engine.model.adds_bos else None
    return await tokenize_text(engine, text, add_special=not (bos and text.startswith(bos)))


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

    def __init__(self, body) -> None:
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def error_response(error: APIError, fmt_error_body=APIError.body) -> JSONResponse:
    return JSONResponse(fmt_error_body(error), status_code=error.status, headers=error.headers)


async def respond(request: Request, fmt: Format, prompt: list[int], sampling: SamplingParams,
                  n: int, stream: bool, include_usage: bool, cache_prompt: bool) -> Response:
    """Submit n sequences for one request and answer it, streamed or whole."""
    state: AppState = request.app.state.cllm
    engine = state.require_engine()
    if not prompt:  # text such as "\x1d" can tokenize to nothing
        raise APIError(400, "the prompt has no tokens", param="prompt")
    if max(prompt) >= engine.model.n_vocab or min(prompt) < 0:
        raise APIError(400, f"token ids must be in [0, {engine.model.n_vocab})", param="prompt")
    streams = []
    # A whole response reads only the sum of the deltas: they may come as the engine makes them.
    interval = state.config.stream_interval if stream else None
    try:
        for i in range(n):
            streams.append(engine.submit(prompt, sampling.for_choice(i), f"{fmt.request_id}-{i}",
                                         on_end=state.sequence_ended, cache_prompt=cache_prompt,
                                         stream_interval=interval))
    except BaseException as exc:  # nothing submitted may decode on with nobody reading it
        for s in streams:
            s.abort()
        if isinstance(exc, PromptTooLongError):
            raise APIError(400, str(exc), code="context_length_exceeded",
                           param="prompt") from exc
        if isinstance(exc, EngineStoppedError):
            raise APIError(503, str(exc), type="server_error", code="engine_stopped") from exc
        raise
    generation = Generation(streams, fmt)
    if stream:
        await until_disconnect(request, generation.first_event())
        return SSEResponse(generation.sse(include_usage))
    return JSONResponse(await until_disconnect(request, generation.collect()))


def new_format(cls, request: Request, prefix: str, sampling: SamplingParams,
               **options) -> Format:
    """A response format for one request; `options` go to the format's constructor."""
    state: AppState = request.app.state.cllm
    return cls(f"{prefix}-{uuid.uuid4().hex[:24]}", state.model_name, int(time.time()),
               state.token, sampling.logprobs is not None, **options)


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
                state.metrics.record_outcome(None, error.status)
            return error_response(error, error_body)
        except ClientGone:
            return Response(status_code=499)
        except Exception:  # a real fault: say so, keep serving
            # Its details (paths, values) are for the log, not for the client.
            log.exception("internal error in %s", request.url.path)
            state.metrics.record_outcome(None, 500)
            return error_response(APIError(500, "internal server error (see the server log)",
                                           type="server_error", code="internal_error"),
                                  error_body)
    return route


# ---- routes ----

async def completions(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config)
    engine = state.require_engine()
    req = api.parse_completion(body, max_n=state.config.max_n,
                               max_tokens_limit=engine.max_seq_len)
    sampling = await constrained(engine, req.sampling, req.constraint)
    prompt = req.prompt if isinstance(req.prompt, list) else await tokenize_text(
        engine, req.prompt, add_special=True)
    fmt = new_format(CompletionFormat, request, "cmpl", sampling,
                     prompt_token_ids=prompt if req.return_token_ids else None)
    return await respond(request, fmt, prompt, sampling, req.n, req.stream, req.include_usage,
                         req.cache_prompt)


async def chat_completions(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config)
    engine = state.require_engine()
    req = api.parse_chat(body, max_n=state.config.max_n, max_tokens_limit=engine.max_seq_len)
    constraint = req.constraint
    calls = req.tools is not None and req.tools.calls
    if calls and (grammar := tools.call_grammar(req.tools)) is not None:
        constraint = Constraint("lark", grammar, "tool_choice")  # the reply is forced calls
    sampling = await constrained(engine, req.sampling, constraint)
    messages, offered = tools.prompt_messages(req.messages, req.tools,
                                              state.renderer.template.takes_tools)
    prompt = await chat_prompt(state, engine, messages, offered)
    fmt = new_format(ChatFormat, request, "chatcmpl", sampling, tool_calls=calls,
                     prompt_token_ids=prompt if req.return_token_ids else None)
    return await respond(request, fmt, prompt, sampling, req.n, req.stream, req.include_usage,
                         req.cache_prompt)


async def generate(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config)
    engine = state.require_engine()
    req = api.parse_generate(body, max_tokens_limit=engine.max_seq_len)
    sampling = await constrained(engine, req.sampling, req.constraint)
    prompt = await tokenize_text(engine, req.prompt, add_special=True)
    fmt = new_format(GenerateFormat, request, "gen", sampling)
    return await respond(request, fmt, prompt, sampling, 1, req.stream, False, req.cache_prompt)


async def models(request: Request, state: AppState) -> Response:
    engine = state.require_engine()
    return JSONResponse({"object": "list",
                         "data": [model_card(state.model_name, state.model_root, engine)]})


async def model(request: Request, state: AppState) -> Response:
    """One model by its served name or its repository id (the openai SDK's models.retrieve)."""
    engine = state.require_engine()
    model_id = request.path_params["model_id"]
    if model_id not in (state.model_name, state.model_root):
        raise APIError(404, f"the model '{model_id}' does not exist", param="model",
                       code="model_not_found")
    return JSONResponse(model_card(state.model_name, state.model_root, engine))


async def tokenize(request: Request, state: AppState) -> Response:
    content, add_special, with_pieces = api.parse_tokenize(await read_json(request,
                                                                          state.config))
    engine = state.require_engine()
    tokens = await tokenize_text(engine, content, add_special=add_special)
    if with_pieces:
        tokens = [{"id": t, "piece": _piece(engine.model, t)} for t in tokens]
    return JSONResponse({"tokens": tokens})


def _piece(model, token: int) -> str | list[int]:
    """A token's text as llama-server's with_pieces shows it: special tokens by name, and the
    bytes as numbers where they are not whole UTF-8 characters."""
    raw = model.token_to_piece(token, True)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


async def detokenize(request: Request, state: AppState) -> Response:
    tokens = api.parse_detokenize(await read_json(request, state.config))
    engine = state.require_engine()
    # A million ids take a while: off the event loop, which serves the other requests meanwhile.
    return JSONResponse({"content": await asyncio.to_thread(_detokenize, engine.model, tokens)})


def _detokenize(model, tokens: list[int]) -> str:
    if any(t >= model.n_vocab for t in tokens):
        raise APIError(400, f"token ids must be below {model.n_vocab}", param="tokens")
    # Special tokens as text, as /tokenize parses them (and as llama-server renders them).
    return model.detokenize(tokens, special=True)


async def health(request: Request, state: AppState) -> Response:
    state.require_engine()
    return JSONResponse({"status": "ok"})


async def metrics(request: Request, state: AppState) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def error_shape(path: str):
    """The error body of a route: /generate keeps the original API's, /v1/messages has
    Anthropic's."""
    return {"/generate": GenerateFormat.error_body_of,
            "/v1/messages": anthropic_error}.get(path, APIError.body)


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route but the public ones (/health, the chat
    page's files), compared in constant time; on /v1/messages `X-Api-Key: <key>` too, as
    Anthropic's clients send it."""

    def __init__(self, app, api_key: str, public_paths: frozenset[str]) -> None:
        self.app = app
        self.key = api_key.encode()
        self.bearer = b"Bearer " + self.key
        self.public_paths = public_paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.public_paths:
            headers = dict(scope["headers"])
            bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
            key_ok = (scope["path"] == "/v1/messages"
                      and hmac.compare_digest(headers.get(b"x-api-key", b""), self.key))
            if not (bearer_ok or key_ok):
                error = APIError(401, "missing or wrong API key", type="authentication_error",
                                 code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await error_response(error, error_shape(scope["path"]))(scope, receive, send)
                return
        await self.app(scope, receive, send)


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})
WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::"})


class HostCheckMiddleware:
    """For a server with no API key: only requests whose Host names the bound address or a
    loopback name are served. Otherwise a web page could reach it by DNS rebinding: its own
    name, resolved to 127.0.0.1, arrives as the Host."""

    def __init__(self, app, bound_host: str) -> None:
        self.app = app
        self.allowed = LOOPBACK_NAMES | {_host_name(bound_host)}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and _host_name(
                dict(scope["headers"]).get(b"host", b"").decode("latin-1")) not in self.allowed:
            error = APIError(400, "the Host header names neither this server's address nor "
                             "localhost (set an API key to serve other names)", code="invalid_host")
            await error_response(error, error_shape(scope["path"]))(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _host_name(host: str) -> str:
    """A Host header's (or a bound address's) name, lowercased, without the port: IPv6
    addresses in brackets."""
    host = host.lower()
    if host.startswith("["):
        return host[:host.find("]") + 1]
    return f"[{host}]" if host.count(":") > 1 else host.partition(":")[0]


async def _http_error(request: Request, exc: HTTPException) -> Response:
    # 404 and 405 in the same shape as every other error.
    return error_response(APIError(exc.status_code, exc.detail, code=str(exc.status_code)))


def create_app(config: ServerConfig, engine_factory: Callable[[], Engine], model_name: str,
               on_load_failure: Callable[[BaseException], None] | None = None) -> Starlette:
    """The app. The engine loads in a thread once the server is up (/health answers 503 until
    then); if it fails, `on_load_failure` decides what happens (serve.py exits)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        state = AppState(config, model_name)
        app.state.cllm = state
        threading.Thread(target=_load, args=(state, engine_factory, on_load_failure),
                         name="cllm-load", daemon=True).start()
        yield
        await state.stop()

    # Route modules build on this one's plumbing: imported once it exists.
    from cllm import anthropic, embeddings, native, openai_responses, webui

    post = lambda path, fn, **kw: Route(path, guarded(fn, **kw), methods=["POST"])  # noqa: E731
    get = lambda path, fn: Route(path, guarded(fn), methods=["GET"])  # noqa: E731
    app = Starlette(routes=[
        post("/v1/completions", completions), post("/v1/chat/completions", chat_completions),
        post("/generate", generate, error_body=GenerateFormat.error_body_of),
        get("/v1/models", models), get("/v1/models/{model_id:path}", model),
        post("/tokenize", tokenize), post("/detokenize", detokenize),
        get("/health", health), get("/metrics", metrics),
        post("/completion", native.completion), get("/props", native.props),
        post("/v1/embeddings", embeddings.embeddings),
        post("/v1/responses", openai_responses.create_response),
        post("/v1/messages", anthropic.create_message, error_body=anthropic_error),
        get("/", webui.page), get("/ui/{name}", webui.asset), get("/status", webui.status),
    ], exception_handlers={HTTPException: _http_error}, lifespan=lifespan,
        middleware=access_checks(config))
    return app


def access_checks(config: ServerConfig) -> list[Middleware]:
    """Who may call the server: the API key's holders, or without a key, clients that name its
    address (scaleout.py guards its own routes with these too)."""
    from cllm import webui

    if config.api_key:
        return [Middleware(APIKeyMiddleware, api_key=config.api_key,
                           public_paths=frozenset({"/health"}) | webui.PUBLIC_PATHS)]
    if config.host not in WILDCARD_ADDRESSES:  # bound to all: any name may be legitimate
        return [Middleware(HostCheckMiddleware, bound_host=config.host)]
    return []


def _load(state: AppState, engine_factory, on_load_failure) -> None:
    try:
        state.load(engine_factory)
        log.info("model %s loaded", state.model_name)
    except BaseException as exc:
        state.load_error = f"the model failed to load: {exc}"
        log.error("%s", state.load_error)
        if on_load_failure is not None:
            on_load_failure(exc)
