"""POST /v1/embeddings, in OpenAI's shape: one unit-length vector per input, computed by
cllm/engine/embedder.py in a worker thread while the event loop keeps serving."""
from __future__ import annotations

import asyncio
import base64
import sys
import threading
from array import array
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cllm.engine.embedder import Embeddings, Stopped
from cllm.engine.sequence import FINISH_TIMEOUT
from cllm.errors import APIError
from cllm.http import schemas
from cllm.http.common import (
    AppState,
    read_json,
    request_model,
    shutting_down,
    tokenize_text,
    until_disconnect,
)
from cllm.http.generation import ended

MAX_INPUTS = 2048  # OpenAI's limits per request
MAX_TOKENS = 300_000  # the inputs' tokens summed
# Matryoshka truncation (OpenAI's `dimensions`) only some embedding models are trained for.
_NOT_IMPLEMENTED = {"dimensions": ()}


@dataclass(slots=True)
class EmbeddingsRequest:
    inputs: list[str | list[int]]
    base64: bool  # encoding_format "base64": little-endian float32, base64-encoded


def parse_embeddings(body: dict) -> EmbeddingsRequest:
    """input: a string, an array of strings, an array of token ids, or an array of arrays of
    token ids; encoding_format: float (default) or base64."""
    schemas.refuse_unimplemented(body, _NOT_IMPLEMENTED)
    value = body.get("input")
    if isinstance(value, str) or (isinstance(value, list) and value
                                  and all(schemas.is_token(t) for t in value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise APIError(400, "input must be a non-empty string or array", param="input")
    if len(value) > MAX_INPUTS:
        raise APIError(400, f"at most {MAX_INPUTS} inputs, got {len(value)}", param="input")
    for i, item in enumerate(value):
        if not (isinstance(item, str) and item) and not (
                isinstance(item, list) and item and all(schemas.is_token(t) for t in item)):
            raise APIError(400, f"input[{i}] must be a non-empty string or array of token ids",
                           param="input")
    encoding = schemas.read_field(body, "encoding_format", "a string", "float")
    if encoding not in ("float", "base64"):
        raise APIError(400, "encoding_format must be float or base64", param="encoding_format")
    return EmbeddingsRequest(value, encoding == "base64")


async def embed(request: Request, state: AppState, inputs: list[list[int]]) -> list[array]:
    """The vectors, computed in a worker thread. Within the request timeout, as a generation:
    its turns wait behind other requests' decodes, and 300,000 tokens take minutes on a CPU."""
    stop = threading.Event()
    timeout = state.config.engine.request_timeout
    embeddings = request_model(request).embeddings
    try:
        return await asyncio.wait_for(until_disconnect(
            request, asyncio.to_thread(embeddings.embed, inputs, stop)), timeout)
    except asyncio.TimeoutError:
        raise ended(FINISH_TIMEOUT, "the request did not finish within the request timeout "
                    f"({timeout:g} s)") from None
    except Stopped:
        raise shutting_down() from None
    finally:  # the worker goes on unless told: its client may have left, or time run out
        embeddings.stop(stop)


def _encode(vector: array, as_base64: bool) -> list[float] | str:
    if not as_base64:
        return vector.tolist()
    if sys.byteorder == "big":  # OpenAI's clients read little-endian float32
        vector = array("f", vector)
        vector.byteswap()
    return base64.b64encode(vector.tobytes()).decode("ascii")


async def embeddings(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config)
    req = parse_embeddings(body)
    engine = await state.engine_for(request, body)
    inputs = [item if isinstance(item, list)
              else await tokenize_text(request, engine, item, add_special=True)
              for item in req.inputs]
    n_tokens = check_inputs(request_model(request).embeddings, engine, inputs)
    vectors = await embed(request, state, inputs)
    return JSONResponse({
        "object": "list", "model": request_model(request).name,
        "data": [{"object": "embedding", "index": i, "embedding": _encode(v, req.base64)}
                 for i, v in enumerate(vectors)],
        "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})


def check_inputs(embeddings: Embeddings, engine, inputs: list[list[int]]) -> int:
    """The inputs' tokens summed; a 400 for an input that is empty, too long for the embedder
    or holds ids past the vocabulary, or for inputs over MAX_TOKENS together."""
    for i, tokens in enumerate(inputs):
        if not tokens:
            raise APIError(400, f"input[{i}] has no tokens", param="input")
        if len(tokens) > embeddings.max_tokens:
            raise APIError(400, f"input[{i}] has {len(tokens)} tokens; at most "
                           f"{embeddings.max_tokens} fit", param="input",
                           code="context_length_exceeded")
        if max(tokens) >= engine.model.n_vocab:
            raise APIError(400, f"token ids must be below {engine.model.n_vocab}", param="input")
    n_tokens = sum(len(t) for t in inputs)
    if n_tokens > MAX_TOKENS:
        raise APIError(400, f"the inputs have {n_tokens} tokens; at most {MAX_TOKENS} a request",
                       param="input")
    return n_tokens
