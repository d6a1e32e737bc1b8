"""The chat page at / (static files shipped in cllm/app/web, no build step, nothing fetched from
elsewhere) and GET /status, the JSON the page's live panel polls."""
from __future__ import annotations

from importlib.resources import files

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cllm.errors import APIError
from cllm.http.common import AppState, request_model
from cllm.http.metrics import user_shares

_FILES = {"index.html": "text/html", "app.js": "text/javascript", "style.css": "text/css"}
# The page runs only its own script and talks only to this server.
_HEADERS = {"Content-Security-Policy": "default-src 'self'; frame-ancestors 'none'",
            "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}
# Public without an API key, so the page can load and ask for one; it holds no data.
PUBLIC_PATHS = frozenset({"/", *(f"/ui/{name}" for name in _FILES)})


def _static(name: str) -> Response:
    body = files("cllm.app").joinpath("web", name).read_bytes()
    return Response(body, media_type=_FILES[name], headers=_HEADERS)


async def page(request: Request, state: AppState) -> Response:
    return _static("index.html")


async def asset(request: Request, state: AppState) -> Response:
    name = request.path_params["name"]
    if name not in _FILES or name == "index.html":
        raise APIError(404, f"no such file: {name}", code="not_found")
    return _static(name)


async def status(request: Request, state: AppState) -> Response:
    """The engine's state now; `tokens_generated` counts since start, so a poller gets the
    rate from two readings; `users`: each user's requests running and waiting."""
    engine = await state.engine_for(request)
    return JSONResponse({"model": request_model(request).name, "running": engine.num_running,
                         "waiting": engine.num_waiting, "kv_usage": engine.kv_usage,
                         "tokens_generated": engine.tokens_generated,
                         "users": user_shares(engine, state.metrics.named_users)})
