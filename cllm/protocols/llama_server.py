"""llama-server's own routes, for the scripts and tools written against it: POST /completion
(its native body and response, streamed or whole), POST /infill (fill-in-the-middle, the same
response), GET /props, POST /tokenize and /detokenize.

Shapes follow llama-server at the pinned llama.cpp (tools/server): a streamed /completion sends
`data: {...}` events and no [DONE]; its last event has `"stop": true` and the totals."""
from __future__ import annotations

from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cllm.config import SamplingParams
from cllm.engine.engine import Delta
from cllm.engine.sequence import FINISH_LENGTH
from cllm.errors import APIError
from cllm.http import fim, schemas
from cllm.http.common import (
    AppState,
    constrained,
    new_format,
    read_json,
    request_model,
    respond,
    tokenize_text,
    tokenizer_work,
)
from cllm.http.formats import Choice, Format, matched_stop

# llama-server's sampling defaults (common_params_sampling), for fields a request leaves out.
SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
# Its samplers cllm does not have, with the values that leave them off (their defaults): any
# other is refused, never silently ignored.
_NOT_IMPLEMENTED = {**schemas.NOT_IMPLEMENTED, "mirostat": (0,), "typical_p": (1,),
                    "dynatemp_range": (0,), "xtc_probability": (0,), "dry_multiplier": (0,)}


@dataclass(slots=True)
class NativeCompletionRequest:
    """POST /completion."""
    prompt: str | list[int]
    stream: bool
    sampling: SamplingParams
    cache_prompt: bool
    return_tokens: bool  # the generated token ids in each event
    constraint: schemas.Constraint | None = None  # json_schema or grammar (GBNF), as llama-server


def parse_completion(body: dict, *, max_tokens_limit: int) -> NativeCompletionRequest:
    """llama-server's body: prompt (text or token ids), n_predict (-1: until the context is
    full), its sampling fields with its defaults, stream, cache_prompt, return_tokens."""
    return parse_generation(body, schemas.read_prompt(body.get("prompt")),
                            max_tokens_limit=max_tokens_limit)


def parse_generation(body: dict, prompt: str | list[int], *,
                     max_tokens_limit: int) -> NativeCompletionRequest:
    """/completion's fields other than the prompt, which /infill builds from its own."""
    schemas.refuse_unimplemented(body, _NOT_IMPLEMENTED)
    if schemas.read_field(body, "n_probs", "an integer", 0):
        raise APIError(400, "n_probs is not supported on /completion; use /v1/completions "
                       "with logprobs", param="n_probs")
    n_predict = schemas.read_field(body, "n_predict", "an integer")
    if n_predict is None:  # llama-server reads OpenAI's name too
        n_predict = schemas.read_field(body, "max_tokens", "an integer", -1)
    if n_predict == 0:
        raise APIError(400, "n_predict must be -1 or at least 1, got 0", param="n_predict")
    # -1: until the context is full, as is any bound past it (schemas.read_max_tokens)
    n_predict = max_tokens_limit if n_predict < 0 else min(n_predict, max_tokens_limit)
    given = {k: v for k, v in body.items() if v is not None}
    return NativeCompletionRequest(
        prompt=prompt, stream=schemas.read_field(body, "stream", "a boolean", False),
        sampling=schemas.read_sampling({**SAMPLING_DEFAULTS, **given}, n_predict, None),
        cache_prompt=schemas.read_cache_prompt(body),
        return_tokens=schemas.read_field(body, "return_tokens", "a boolean", False),
        constraint=schemas.read_constraint(body))


def timings(prompt_n: int, predicted_n: int, seconds: dict[str, float]) -> dict:
    """llama-server's `timings`: prompt time is until the first token (queueing included),
    generation time the rest."""
    prompt_ms = seconds.get("ttft", 0.0) * 1000
    predicted_ms = max(seconds.get("total", 0.0) * 1000 - prompt_ms, 0.0)

    def rate(n: int, ms: float) -> dict:
        return {"per_token_ms": ms / n if n else 0.0, "per_second": n * 1000 / ms if ms else 0.0}

    p, g = rate(prompt_n, prompt_ms), rate(predicted_n, predicted_ms)
    return {"prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": p["per_token_ms"], "prompt_per_second": p["per_second"],
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": g["per_token_ms"], "predicted_per_second": g["per_second"]}


class NativeCompletionFormat(Format):
    """/completion's events and response. A stop string ends with stop_type "word"; an
    end-of-generation token, or a grammar's end (where llama-server samples one), with "eos"."""

    def __init__(self, *args, prompt: str | list[int], n_prompt: int,
                 settings: SamplingParams, detokenize, return_tokens: bool,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompt = prompt
        self.n_prompt = n_prompt
        self.settings = settings
        self.detokenize = detokenize
        self.return_tokens = return_tokens
        self._streamed = Choice()  # what a stream has sent so far

    def usage_chunk(self, usage_: dict) -> dict | None:
        return None

    def done_event(self) -> bytes | None:
        return None

    def chunks(self, index: int, delta: Delta, first: bool) -> list[dict]:
        self._streamed.add(delta)
        out = []
        if delta.text or (self.return_tokens and delta.token_ids):
            out.append({"index": 0, "content": delta.text, "tokens": self._tokens(delta.token_ids),
                        "stop": False, "id_slot": -1,
                        "tokens_predicted": len(self._streamed.token_ids),
                        "tokens_evaluated": self.n_prompt})
        if delta.finish_reason is not None:
            out.append(self._final(self._streamed, content="", tokens=[]))
        return out

    def response(self, choices: list[Choice]) -> dict:
        (choice,) = choices
        return self._final(choice, content=choice.text, tokens=choice.token_ids)

    def _tokens(self, token_ids: list[int]) -> list[int]:
        return token_ids if self.return_tokens else []

    def _final(self, choice: Choice, *, content: str, tokens: list[int]) -> dict:
        s = self.settings
        stopping_word = matched_stop(self.detokenize(choice.token_ids), s.stop) or ""
        stop_type = ("limit" if choice.finish_reason == FINISH_LENGTH
                     else "word" if stopping_word else "eos")
        return {
            "index": 0, "content": content, "tokens": self._tokens(tokens), "id_slot": -1,
            "stop": True, "model": self.model, "tokens_predicted": choice.completion_tokens,
            "tokens_evaluated": choice.prompt_tokens,
            "generation_settings": {
                "n_predict": s.max_tokens, "temperature": s.temperature, "top_k": s.top_k,
                "top_p": s.top_p, "min_p": s.min_p, "repeat_penalty": s.repeat_penalty,
                "presence_penalty": s.presence_penalty,
                "frequency_penalty": s.frequency_penalty, "seed": s.seed, "stop": list(s.stop),
                "ignore_eos": s.ignore_eos},
            "prompt": self.prompt, "has_new_line": "\n" in choice.text, "truncated": False,
            "stop_type": stop_type, "stopping_word": stopping_word,
            "tokens_cached": choice.cached_tokens,
            "timings": timings(choice.prompt_tokens, choice.completion_tokens, choice.timings)}


# ---- routes ----

async def completion(request: Request, state: AppState) -> Response:
    body = await read_json(request, state.config)
    engine = await state.engine_for(request, body)
    req = parse_completion(body, max_tokens_limit=engine.max_seq_len)
    sampling = await constrained(engine, req.sampling, req.constraint)
    prompt = req.prompt if isinstance(req.prompt, list) else await tokenize_text(
        request, engine, req.prompt, add_special=True)
    fmt = new_format(NativeCompletionFormat, request, "cmpl", sampling, prompt=req.prompt,
                     n_prompt=len(prompt), settings=sampling,
                     detokenize=engine.model.detokenize, return_tokens=req.return_tokens)
    return await respond(request, fmt, prompt, sampling, 1, req.stream, False, req.cache_prompt)


async def infill(request: Request, state: AppState) -> Response:
    """/completion for code: the prompt is built from input_prefix, input_suffix, input_extra
    and prompt (http/fim.py), for a model whose vocabulary has fill-in-the-middle tokens."""
    body = await read_json(request, state.config)
    engine = await state.engine_for(request, body)
    fim.require_fim(engine.model, "input_prefix")
    parts = fim.read_infill(body)
    prompt = await tokenizer_work(request, fim.infill_prompt, engine.model, parts)
    req = parse_generation(body, prompt, max_tokens_limit=engine.max_seq_len)
    sampling = await constrained(engine, req.sampling, req.constraint)
    fmt = new_format(NativeCompletionFormat, request, "cmpl", sampling,
                     prompt=engine.model.detokenize(prompt, special=True), n_prompt=len(prompt),
                     settings=sampling, detokenize=engine.model.detokenize,
                     return_tokens=req.return_tokens)
    return await respond(request, fmt, prompt, sampling, 1, req.stream, False, req.cache_prompt)


async def props(request: Request, state: AppState) -> Response:
    """What llama-server's web UI and clients read first: context size, slots, model, chat
    template and the default sampling settings of /completion."""
    engine = await state.engine_for(request)
    template = request_model(request).renderer.template
    return JSONResponse({
        "default_generation_settings": {"n_ctx": engine.max_seq_len,
                                        "params": {**SAMPLING_DEFAULTS, "n_predict": -1}},
        "total_slots": engine.config.n_parallel, "model_alias": request_model(request).name,
        "model_path": engine.model.path, "model_root": request_model(request).root,
        "modalities": {"vision": False, "audio": False},
        "chat_template": template.source or "", "bos_token": template.bos_token,
        "eos_token": template.eos_token, "build_info": f"cllm {cllm_version()}",
        "endpoint_slots": False, "endpoint_props": True, "endpoint_metrics": True})


def cllm_version() -> str:
    try:
        return version("cllm")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"


async def tokenize(request: Request, state: AppState) -> Response:
    content, add_special, with_pieces = schemas.parse_tokenize(await read_json(request,
                                                                          state.config))
    engine = await state.engine_for(request)
    tokens = await tokenize_text(request, engine, content, add_special=add_special)
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
    tokens = schemas.parse_detokenize(await read_json(request, state.config))
    engine = await state.engine_for(request)
    # A million ids take a while: off the event loop, which serves the other requests meanwhile.
    text = await tokenizer_work(request, _detokenize, engine.model, tokens)
    return JSONResponse({"content": text})


def _detokenize(model, tokens: list[int]) -> str:
    if any(t >= model.n_vocab for t in tokens):
        raise APIError(400, f"token ids must be below {model.n_vocab}", param="tokens")
    # Special tokens as text, as /tokenize parses them (and as llama-server renders them).
    return model.detokenize(tokens, special=True)
