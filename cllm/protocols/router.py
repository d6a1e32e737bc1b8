"""llama-server's router endpoints: GET /models (every model with its state: unloaded, loading,
loaded, or failed and why), POST /models/load and POST /models/unload ({"model": NAME})."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cllm.errors import APIError
from cllm.http import schemas
from cllm.http.common import AppState, read_json
from cllm.http.registry import ServedModel


async def models(request: Request, state: AppState) -> Response:
    return JSONResponse({"object": "list",
                         "data": [m.describe() for m in state.models.models.values()]})


async def load(request: Request, state: AppState) -> Response:
    """Load a model now (again, if it failed): the reply comes once it is loaded."""
    model = await _named(request, state)
    await state.models.load(model, retry=True)
    return JSONResponse({"success": True})


async def unload(request: Request, state: AppState) -> Response:
    """Unload a model now; one with requests in flight is a 409, as it would not unload."""
    model = await _named(request, state)
    if model.in_flight:
        raise APIError(409, f"the model '{model.name}' has requests in flight", param="model",
                       code="model_busy")
    await state.models.unload(model)
    return JSONResponse({"success": True})


async def _named(request: Request, state: AppState) -> ServedModel:
    body = await read_json(request, state.config)
    unknown = set(body) - {"model"}
    if unknown:
        raise APIError(400, f"unknown field(s): {', '.join(sorted(unknown))}",
                       param=sorted(unknown)[0])
    name = schemas.read_field(body, "model", "a string")
    if not name:
        raise APIError(400, "model is required", param="model")
    return state.models.find(name)
