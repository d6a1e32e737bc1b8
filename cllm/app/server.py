"""The app: every protocol's routes (cllm/protocols/), health and metrics, the chat page, and the
access checks (access.py).

`create_app()` returns a Starlette app; everything it holds lives in the lifespan's AppState
(cllm/http/common.py, with the plumbing the routes share). The engine loads once the server is
up; launch.py runs the app under uvicorn."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cllm.app import webui
from cllm.app.access import access_checks
from cllm.config import ServerConfig
from cllm.errors import APIError
from cllm.http.common import AppState, error_response, guarded
from cllm.http.formats import GenerateFormat
from cllm.http.metrics import CONTENT_TYPE
from cllm.http.registry import EngineFactory
from cllm.http.responses import anthropic_error, ollama_error
from cllm.models import ModelSource
from cllm.protocols import (
    anthropic,
    embeddings,
    generate,
    llama_server,
    ollama,
    openai,
    openai_responses,
    router,
)

log = logging.getLogger(__name__)


async def health(request: Request, state: AppState) -> Response:
    state.check_health()
    return JSONResponse({"status": "ok"})


async def metrics(request: Request, state: AppState) -> Response:
    return Response(state.render_metrics(), media_type=CONTENT_TYPE)


async def _http_error(request: Request, exc: HTTPException) -> Response:
    # 404 and 405 in the same shape as every other error.
    return error_response(APIError(exc.status_code, exc.detail, code=str(exc.status_code)))


def create_app(config: ServerConfig, sources: list[ModelSource],
               make_engine: EngineFactory,
               on_load_failure: Callable[[BaseException], None] | None = None) -> Starlette:
    """The app, serving the models of `sources` (make_engine loads one's GGUF file). The only
    model, or the pinned ones, load once the server is up (/health answers 503 until then); if
    one fails, `on_load_failure` decides what happens (serve.py exits). Others load on their
    first request."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette):
        state = AppState(config, sources, make_engine)
        app.state.cllm = state
        loading = asyncio.create_task(_load_at_start(state, on_load_failure))
        yield
        loading.cancel()
        await state.stop()

    post = lambda path, fn, **kw: Route(path, guarded(fn, **kw), methods=["POST"])  # noqa: E731
    get = lambda path, fn, **kw: Route(path, guarded(fn, **kw), methods=["GET"])  # noqa: E731
    app = Starlette(routes=[
        post("/v1/completions", openai.completions),
        post("/v1/chat/completions", openai.chat_completions),
        get("/v1/models", openai.models), get("/v1/models/{model_id:path}", openai.model),
        post("/generate", generate.generate, error_body=GenerateFormat.error_body_of),
        post("/tokenize", llama_server.tokenize), post("/detokenize", llama_server.detokenize),
        get("/health", health), get("/metrics", metrics),
        get("/models", router.models), post("/models/load", router.load),
        post("/models/unload", router.unload),
        post("/completion", llama_server.completion), get("/props", llama_server.props),
        post("/v1/embeddings", embeddings.embeddings),
        post("/v1/responses", openai_responses.create_response),
        post("/v1/messages", anthropic.create_message, error_body=anthropic_error),
        post("/v1/messages/count_tokens", anthropic.count_tokens, error_body=anthropic_error),
        post("/infill", llama_server.infill),
        *[route(path, fn, error_body=ollama_error) for route, path, fn in (
            (post, "/api/chat", ollama.chat), (post, "/api/generate", ollama.generate),
            (post, "/api/embed", ollama.embed), (post, "/api/embeddings", ollama.embeddings_),
            (post, "/api/show", ollama.show), (get, "/api/tags", ollama.tags),
            (get, "/api/ps", ollama.ps), (get, "/api/version", ollama.version))],
        get("/", webui.page), get("/ui/{name}", webui.asset), get("/status", webui.status),
    ], exception_handlers={HTTPException: _http_error}, lifespan=lifespan,
        middleware=access_checks(config))
    return app


async def _load_at_start(state: AppState, on_load_failure) -> None:
    for model in state.models.at_start():
        try:
            await state.models.load(model, at_start=True)
        except APIError as exc:
            if on_load_failure is not None:
                on_load_failure(exc.__cause__ or exc)
            return
