"""The HTTP server: the app with every protocol's routes (the OpenAI-compatible ones, the original
/generate, health and metrics here; the others in their modules) and its access checks.

`create_app()` returns a Starlette app; everything it holds lives in the lifespan's AppState
(http_common.py, with the plumbing the routes share)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cllm import api, tools
from cllm.api import Constraint
from cllm.errors import APIError
from cllm.config import ServerConfig
from cllm.engine import Engine
from cllm.formats import ChatFormat, CompletionFormat, GenerateFormat
from cllm.metrics import CONTENT_TYPE
from cllm.model_card import model_card
from cllm.responses import anthropic_error

from cllm import anthropic, embeddings, native, openai_responses, webui
from cllm.http_common import (AppState, chat_prompt, constrained, error_response, error_shape,
                              guarded, new_format, read_json, respond, tokenize_text)

log = logging.getLogger("cllm.server")


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
