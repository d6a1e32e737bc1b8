"""POST /generate: cllm's original API, a prompt in and its text out, whole or streamed."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from cllm.http import schemas
from cllm.http.common import AppState, constrained, new_format, read_json, respond, tokenize_text
from cllm.http.formats import GenerateFormat


async def generate(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config)
    engine = await state.engine_for(request, body)
    req = schemas.parse_generate(body, max_tokens_limit=engine.max_seq_len)
    sampling = await constrained(engine, req.sampling, req.constraint)
    prompt = await tokenize_text(request, engine, req.prompt, add_special=True)
    fmt = new_format(GenerateFormat, request, "gen", sampling)
    return await respond(request, fmt, prompt, sampling, 1, req.stream, False, req.cache_prompt)
