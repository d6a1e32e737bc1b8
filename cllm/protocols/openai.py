"""OpenAI's API: POST /v1/completions and /v1/chat/completions (tools and structured output
included), GET /v1/models and /v1/models/{id}. Bodies are read by cllm/http/schemas.py, whose
shapes every other protocol translates into; replies are shaped by cllm/http/formats.py."""
from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cllm.http import schemas, tools
from cllm.http.common import (
    AppState,
    chat_prompt,
    constrained,
    new_format,
    read_json,
    request_model,
    respond,
    respond_batch,
    tokenize_text,
)
from cllm.http.formats import ChatFormat, CompletionFormat
from cllm.http.model_card import model_card
from cllm.http.schemas import Constraint


async def completions(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config)
    engine = await state.engine_for(request, body)
    req = schemas.parse_completion(body, max_n=state.config.max_n,
                               max_tokens_limit=engine.max_seq_len)
    sampling = await constrained(engine, req.sampling, req.constraint)
    prompts = [p if isinstance(p, list) else await tokenize_text(request, engine, p,
                                                                 add_special=True)
               for p in req.prompts]
    fmt = new_format(CompletionFormat, request, "cmpl", sampling, n=req.n,
                     prompt_token_ids=prompts if req.return_token_ids else None)
    return await respond_batch(request, fmt, prompts, sampling, req.n, req.stream,
                               req.include_usage, req.cache_prompt)


async def chat_completions(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config)
    engine = await state.engine_for(request, body)
    req = schemas.parse_chat(body, max_n=state.config.max_n, max_tokens_limit=engine.max_seq_len)
    constraint = req.constraint
    calls = req.tools is not None and req.tools.calls
    if calls and (grammar := tools.call_grammar(req.tools)) is not None:
        constraint = Constraint("lark", grammar, "tool_choice")  # the reply is forced calls
    sampling = await constrained(engine, req.sampling, constraint)
    messages, offered = tools.prompt_messages(req.messages, req.tools,
                                              request_model(request).renderer.template.takes_tools)
    prompt = await chat_prompt(request, engine, messages, offered)
    fmt = new_format(ChatFormat, request, "chatcmpl", sampling, tool_calls=calls,
                     functions=req.functions,
                     prompt_token_ids=prompt if req.return_token_ids else None)
    return await respond(request, fmt, prompt, sampling, req.n, req.stream, req.include_usage,
                         req.cache_prompt)


async def models(request: Request, state: AppState) -> Response:
    """Every model the server serves, loaded or not."""
    return JSONResponse({"object": "list",
                         "data": [model_card(m.name, m.root, m.engine)
                                  for m in state.models.models.values()]})


async def model(request: Request, state: AppState) -> Response:
    """One model by any of its names (the openai SDK's models.retrieve)."""
    found = state.models.find(request.path_params["model_id"])
    return JSONResponse(model_card(found.name, found.root, found.engine))
