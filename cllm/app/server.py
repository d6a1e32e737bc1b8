"""The app: every protocol's routes (cllm/protocols/), health and metrics, the chat page, and the
access checks (access.py).

`create_app()` returns a Starlette app; everything it holds lives in the lifespan's AppState
(cllm/http/common.py, with the plumbing the routes share). The engine loads once the server is
up; launch.py runs the app under uvicorn."""
from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cllm.app import webui
from cllm.app.access import access_checks
from cllm.config import ServerConfig
from cllm.engine.engine import Engine
from cllm.errors import APIError
from cllm.http.common import AppState, error_response, guarded
from cllm.http.formats import GenerateFormat
from cllm.http.metrics import CONTENT_TYPE
from cllm.http.responses import anthropic_error, ollama_error
from cllm.protocols import (
    anthropic,
    embeddings,
    generate,
    llama_server,
    ollama,
    openai,
    openai_responses,
)

log = logging.getLogger(__name__)


async def health(request: Request, state: AppState) -> Response:
    state.require_engine()
    return JSONResponse({"status": "ok"})


async def metrics(request: Request, state: AppState) -> Response:
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


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
    get = lambda path, fn, **kw: Route(path, guarded(fn, **kw), methods=["GET"])  # noqa: E731
    app = Starlette(routes=[
        post("/v1/completions", openai.completions),
        post("/v1/chat/completions", openai.chat_completions),
        get("/v1/models", openai.models), get("/v1/models/{model_id:path}", openai.model),
        post("/generate", generate.generate, error_body=GenerateFormat.error_body_of),
        post("/tokenize", llama_server.tokenize), post("/detokenize", llama_server.detokenize),
        get("/health", health), get("/metrics", metrics),
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


def _load(state: AppState, engine_factory, on_load_failure) -> None:
    try:
        state.load(engine_factory)
        log.info("model %s loaded", state.model_name)
    except BaseException as exc:
        state.load_error = f"the model failed to load: {exc}"
        log.error("%s", state.load_error)
        if on_load_failure is not None:
            on_load_failure(exc)
