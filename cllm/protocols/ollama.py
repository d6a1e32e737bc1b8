"""Ollama's API, for the tools that speak it (Open WebUI, Continue, LangChain's ChatOllama, the
`ollama` clients): POST /api/chat and /api/generate (newline-delimited JSON streamed by default,
or whole with "stream": false), /api/embed and the older /api/embeddings, POST /api/show, GET
/api/tags, /api/ps and /api/version.

Bodies are translated into cllm's requests: `options` into SamplingParams (Ollama's defaults for
what a request leaves out), `format` into a JSON Schema constraint, `tools` into cllm's tool
calls (http/tools.py), a generate's `suffix` into a fill-in-the-middle prompt (http/fim.py).
Whatever cllm does not implement is refused by name with a 400 in Ollama's error shape
{"error": "..."}. `keep_alive` sets how long the request's model stays loaded once idle
(http/registry.py), as /api/ps shows. Durations are measured, in nanoseconds. `context`, which Ollama deprecated,
is neither taken nor returned: a conversation goes to /api/chat, whose earlier turns the prefix
cache finds again."""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from cllm.config import SamplingParams, parse_duration
from cllm.engine.engine import Delta, Engine
from cllm.engine.sequence import FINISH_LENGTH
from cllm.errors import APIError
from cllm.http import fim, responses, schemas, tools
from cllm.http.common import (
    AppState,
    chat_prompt,
    constrained,
    new_format,
    read_json,
    request_model,
    respond,
    tokenize_text,
    tokenizer_work,
)
from cllm.http.formats import Choice, Format
from cllm.http.model_card import parameter_size, quantization
from cllm.http.registry import LOADED, ServedModel
from cllm.http.schemas import Constraint
from cllm.protocols import embeddings
from cllm.protocols.llama_server import cllm_version

# Ollama's defaults (api.DefaultOptions) for the sampling options a request leaves out.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "min_p": 0.0, "repeat_penalty": 1.1}
_SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "min_p", "seed", "stop", "repeat_penalty",
                     "presence_penalty", "frequency_penalty")
# Options cllm has no setting for, with the values that ask for nothing (Ollama's defaults):
# cllm's repeat penalty looks back 64 tokens, as Ollama's does by default. Any other value, and
# any option not named here or above, is refused.
_HARMLESS_OPTIONS = {"repeat_last_n": (64,), "mirostat": (0,), "typical_p": (1,),
                     "tfs_z": (1,)}
# Top-level fields refused unless absent or one of these values.
_NOT_IMPLEMENTED = {"think": (False,), "logprobs": (False,), "top_logprobs": (0,)}
# What /api/ps shows for a model that stays resident: Ollama's expiry for keep_alive < 0, the
# longest duration it has from now.
_FOREVER = timedelta(microseconds=((1 << 63) - 1) // 1000)


@dataclass(slots=True)
class OllamaRequest:
    """What /api/chat and /api/generate share."""
    stream: bool
    sampling: SamplingParams
    constraint: Constraint | None
    num_ctx: int | None  # a bound on the sequence's tokens, prompt and reply


# ---- reading a body ----

def read_keep_alive(body: dict) -> float | None:
    """keep_alive in seconds: a number of seconds or a duration such as "5m" (negative: for
    good, 0: unload as soon as the request ends); None when absent."""
    value = body.get("keep_alive")
    if value is None:
        return None
    try:
        return parse_duration(value)
    except ValueError:
        raise APIError(400, "keep_alive must be a number of seconds or a duration such as "
                       f"\"5m\", got {value!r}", param="keep_alive") from None


def _options(body: dict) -> dict:
    options = schemas.read_field(body, "options", "an object", {})
    for name, value in options.items():
        if name in _SAMPLING_OPTIONS or name in ("num_predict", "num_ctx") or value is None:
            continue
        if value not in _HARMLESS_OPTIONS.get(name, ()):
            raise APIError(400, f"options.{name} is not supported", param=f"options.{name}")
    return options


def _max_tokens(options: dict, limit: int) -> int:
    """num_predict: -1 (Ollama's default) and -2 run until the context is full."""
    value = schemas.read_field(options, "num_predict", "an integer", -1)
    if value in (-1, -2):
        return limit
    if value < 1:
        raise APIError(400, f"options.num_predict must be -1, -2 or at least 1, got {value}",
                       param="options.num_predict")
    return min(value, limit)


def _num_ctx(options: dict, limit: int) -> int | None:
    value = schemas.read_field(options, "num_ctx", "an integer")
    if value is not None and not 1 <= value <= limit:
        raise APIError(400, f"options.num_ctx must be between 1 and {limit}, the tokens a "
                       f"sequence holds on this server, got {value}", param="options.num_ctx")
    return value


def _format(body: dict) -> Constraint | None:
    """format: "json" (any JSON object, as Ollama's) or a JSON Schema."""
    value = body.get("format")
    if value in (None, ""):
        return None
    if value == "json":
        return Constraint("json_schema", {"type": "object"}, "format")
    if isinstance(value, dict):
        return Constraint("json_schema", value, "format")
    raise APIError(400, 'format must be "json" or a JSON Schema object', param="format")


def parse_request(body: dict, limit: int) -> OllamaRequest:
    """The fields /api/chat and /api/generate share; `limit`: the tokens a sequence holds."""
    schemas.refuse_unimplemented(body, _NOT_IMPLEMENTED)
    options = _options(body)
    fields = {**DEFAULTS, **{k: options.get(k) for k in _SAMPLING_OPTIONS
                             if options.get(k) is not None}}
    return OllamaRequest(
        stream=schemas.read_field(body, "stream", "a boolean", True),
        sampling=schemas.read_sampling(fields, _max_tokens(options, limit), None),
        constraint=_format(body), num_ctx=_num_ctx(options, limit))


def chat_messages(body: dict) -> tuple[list[dict], tools.ToolSpec | None]:
    """Ollama's messages (text; an assistant's tool_calls with arguments as objects; a tool's
    result) and tools, read as cllm's chat messages and tool spec."""
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise APIError(400, "messages must be a non-empty array", param="messages")
    for i, turn in enumerate(turns):
        for field in ("images", "thinking"):
            if isinstance(turn, dict) and turn.get(field):
                raise APIError(400, f"messages[{i}].{field} are not supported",
                               param=f"messages[{i}].{field}")
    chat = schemas.parse_chat({"messages": turns, "tools": body.get("tools")}, max_n=1,
                              max_tokens_limit=1)
    return chat.messages, chat.tools


# ---- the response ----

def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(round(seconds * 1e9), 0)


def _ollama_calls(calls: list[dict], first: int) -> list[dict]:
    """OpenAI-shaped calls (tools.new_call) in Ollama's shape: arguments as an object."""
    return [{"function": {"index": first + k, "name": c["function"]["name"],
                          "arguments": json.loads(c["function"]["arguments"])}}
            for k, c in enumerate(calls)]


class OllamaFormat(Format):
    """Ollama's objects, one a line when streamed: a chat's `message` or a generate's
    `response`, and the measurements on the last one. `started` is the request's arrival and
    `load_ns` the time it waited for its model (time.perf_counter_ns)."""
    media_type = "application/x-ndjson"

    def __init__(self, *args, chat: bool, tool_calls: bool, started: int, load_ns: int,
                 **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.is_chat = chat
        self.tool_calls = tool_calls
        self.started = started
        self.load_ns = load_ns
        self._parser = tools.CallParser()  # streamed

    def event(self, payload: dict) -> bytes:
        return responses.json_line(payload)

    def error_body(self, error: APIError) -> dict:
        return responses.ollama_error(error)

    def done_event(self) -> bytes | None:
        return None

    def usage_chunk(self, usage_: dict) -> dict | None:
        return None

    def chunks(self, index: int, delta: Delta, first: bool) -> list[dict]:
        text, calls = delta.text, []
        if self.tool_calls:
            made = len(self._parser.calls)
            text, calls = self._parser.feed(delta.text)
            calls = _ollama_calls(calls, made)
            if delta.finish_reason is not None:
                text += self._parser.close()
        out = [self._object(text, calls, done=False)] if text or calls else []
        if delta.finish_reason is not None:
            final = self._object("", [], done=True)
            final.update(self._measurements(delta.finish_reason, delta.prompt_tokens,
                                            delta.cached_tokens, delta.completion_tokens,
                                            delta.timings or {}))
            out.append(final)
        return out

    def response(self, choices: list[Choice]) -> dict:
        (choice,) = choices
        text, calls = (tools.split_reply(choice.text) if self.tool_calls
                       else (choice.text, []))
        body = self._object(text, _ollama_calls(calls, 0), done=True)
        body.update(self._measurements(choice.finish_reason, choice.prompt_tokens,
                                       choice.cached_tokens, choice.completion_tokens,
                                       choice.timings))
        return body

    def _object(self, text: str, calls: list[dict], *, done: bool) -> dict:
        body = {"model": self.model, "created_at": _now()}
        if self.is_chat:
            body["message"] = {"role": "assistant", "content": text}
            if calls:
                body["message"]["tool_calls"] = calls
        else:
            body["response"] = text
        body["done"] = done
        return body

    def _measurements(self, reason: str | None, prompt: int, cached: int, generated: int,
                      timings: dict[str, float]) -> dict:
        """Ollama's counts and durations: the prompt's tokens computed (those the prefix cache
        held were not) and the time until the first token less the queue, the reply's tokens
        and the time after its first."""
        ttft = timings.get("ttft", 0.0)
        return {"done_reason": "length" if reason == FINISH_LENGTH else "stop",
                "total_duration": time.perf_counter_ns() - self.started,
                "load_duration": self.load_ns,
                "prompt_eval_count": prompt - cached,
                "prompt_eval_duration": _ns(ttft - timings.get("queued", 0.0)),
                "eval_count": generated,
                "eval_duration": _ns(timings.get("total", 0.0) - ttft)}


# ---- routes ----

async def _engine(request: Request, state: AppState, body: dict) -> tuple[Engine, int]:
    """The engine the body's model names and the nanoseconds spent getting it; the body's
    keep_alive, if any, becomes the model's."""
    keep_alive = read_keep_alive(body)
    started = time.perf_counter_ns()
    engine = await state.engine_for(request, body)
    if keep_alive is not None:
        state.models.ask_keep_alive(request_model(request), keep_alive)
    return engine, time.perf_counter_ns() - started


def _loaded(request: Request, state: AppState, chat: bool) -> JSONResponse:
    """What Ollama answers a request with nothing to generate: the model is loaded, or with
    keep_alive 0, unloads as the request ends."""
    reply = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    model = request_model(request)
    unloads = state.models.keep_alive_of(model) == 0
    return JSONResponse({"model": model.name, "created_at": _now(), **reply, "done": True,
                         "done_reason": "unload" if unloads else "load"})


async def _generate(request: Request, state: AppState, engine: Engine, req: OllamaRequest,
                    prompt: list[int], fmt: Format) -> Response:
    sampling = await constrained(engine, req.sampling, req.constraint)
    if req.num_ctx is not None:
        if len(prompt) >= req.num_ctx:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; options.num_ctx "
                           f"{req.num_ctx} leaves no room for a reply",
                           param="options.num_ctx", code="context_length_exceeded")
        sampling = dataclasses.replace(
            sampling, max_tokens=min(sampling.max_tokens, req.num_ctx - len(prompt)))
    return await respond(request, fmt, prompt, sampling, 1, req.stream, False, True)


async def chat(request: Request, state: AppState) -> Response:
    started = time.perf_counter_ns()
    body = await read_json(request, state.config)
    engine, load_ns = await _engine(request, state, body)
    req = parse_request(body, engine.max_seq_len)
    if body.get("messages") == []:
        return _loaded(request, state, chat=True)
    messages, spec = chat_messages(body)
    rendered, offered = tools.prompt_messages(messages, spec,
                                              request_model(request).renderer.template.takes_tools)
    prompt = await chat_prompt(request, engine, rendered, offered)
    fmt = new_format(OllamaFormat, request, "chat", req.sampling, chat=True,
                     tool_calls=spec is not None and spec.calls, started=started,
                     load_ns=load_ns)
    return await _generate(request, state, engine, req, prompt, fmt)


async def generate(request: Request, state: AppState) -> Response:
    """A prompt rendered as a user's turn by the model's chat template (with `system` before
    it), or as it is with `raw`; with `suffix`, a fill-in-the-middle prompt."""
    started = time.perf_counter_ns()
    body = await read_json(request, state.config)
    engine, load_ns = await _engine(request, state, body)
    req = parse_request(body, engine.max_seq_len)
    schemas.refuse_unimplemented(body, {"images": ([],), "context": ([],), "template": ("",)})
    text = schemas.read_field(body, "prompt", "a string", "")
    system = schemas.read_field(body, "system", "a string", "")
    suffix = schemas.read_field(body, "suffix", "a string", "")
    raw = schemas.read_field(body, "raw", "a boolean", False)
    if not text and not suffix:
        return _loaded(request, state, chat=False)
    if system and (raw or suffix):
        raise APIError(400, "system goes with a prompt the chat template renders, not with raw "
                       "or suffix", param="system")
    if suffix:
        fim.require_fim(engine.model, "suffix")
        prompt = await tokenizer_work(request, fim.infill_prompt, engine.model,
                                      fim.Infill(text, suffix))
    elif raw:
        prompt = await tokenize_text(request, engine, text, add_special=True)
    else:
        turns = [{"role": "system", "content": system}] if system else []
        prompt = await chat_prompt(request, engine, [*turns, {"role": "user", "content": text}])
    fmt = new_format(OllamaFormat, request, "gen", req.sampling, chat=False, tool_calls=False,
                     started=started, load_ns=load_ns)
    return await _generate(request, state, engine, req, prompt, fmt)


async def _embed(request: Request, state: AppState, body: dict, texts: list[str],
                 truncate: bool) -> tuple[list, int, int]:
    """The texts' vectors (cllm/protocols/embeddings.py), their tokens summed and the
    nanoseconds spent getting the model; with `truncate`, a text longer than the embedder
    takes is cut to what it takes."""
    engine, load_ns = await _engine(request, state, body)
    if schemas.read_field(body, "options", "an object", {}):
        raise APIError(400, f"options.{next(iter(body['options']))} is not supported",
                       param="options")
    inputs = [await tokenize_text(request, engine, t, add_special=True) for t in texts]
    if truncate:
        inputs = [tokens[:request_model(request).embeddings.max_tokens] for tokens in inputs]
    n_tokens = embeddings.check_inputs(request_model(request).embeddings, engine, inputs)
    return await embeddings.embed(request, state, inputs), n_tokens, load_ns


async def embed(request: Request, state: AppState) -> Response:
    """input: a text or a list of texts; truncate (default true) cuts each to what the embedder
    takes, false refuses a longer one; dimensions is refused (the vectors are whole)."""
    started = time.perf_counter_ns()
    body = await read_json(request, state.config)
    schemas.refuse_unimplemented(body, {"dimensions": ()})
    texts = body.get("input")
    texts = [texts] if isinstance(texts, str) else texts
    if not (isinstance(texts, list) and all(isinstance(t, str) and t for t in texts)
            and 0 < len(texts) <= embeddings.MAX_INPUTS):
        raise APIError(400, "input must be a non-empty text or a list of 1 to "
                       f"{embeddings.MAX_INPUTS} non-empty texts", param="input")
    truncate = schemas.read_field(body, "truncate", "a boolean", True)
    vectors, n_tokens, load_ns = await _embed(request, state, body, texts, truncate)
    return JSONResponse({"model": request_model(request).name,
                         "embeddings": [v.tolist() for v in vectors],
                         "total_duration": time.perf_counter_ns() - started,
                         "load_duration": load_ns, "prompt_eval_count": n_tokens})


async def embeddings_(request: Request, state: AppState) -> Response:
    """The older route: {"prompt"} → {"embedding"}, one text, not truncated."""
    body = await read_json(request, state.config)
    text = schemas.read_field(body, "prompt", "a string")
    if not text:
        raise APIError(400, "prompt must be a non-empty string", param="prompt")
    vectors, _, _ = await _embed(request, state, body, [text], truncate=False)
    return JSONResponse({"embedding": vectors[0].tolist()})


@functools.lru_cache(maxsize=8)
def _digest(path: str, mtime: float, size: int) -> str:
    """The file's sha256, once for each version of it (a GGUF of gigabytes takes seconds)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


async def _entry(model: ServedModel) -> dict:
    """A model as /api/tags and /api/ps list it: its file, and once it is loaded what its
    GGUF says of it."""
    path = model.source.path
    stat = os.stat(path)
    details = {"parent_model": "", "format": "gguf", "family": "", "families": [],
               "parameter_size": "", "quantization_level": ""}
    engine = model.engine if model.status == LOADED else None
    if engine is not None:
        arch = engine.model.metadata.get("general.architecture", "")
        details.update(family=arch, families=[arch],
                       parameter_size=parameter_size(engine.model.n_params),
                       quantization_level=quantization(engine.model.metadata))
    return {"name": model.name, "model": model.name,
            "modified_at": datetime.fromtimestamp(stat.st_mtime, timezone.utc).isoformat(),
            "size": stat.st_size,
            "digest": await asyncio.to_thread(_digest, path, stat.st_mtime, stat.st_size),
            "details": details}


async def tags(request: Request, state: AppState) -> Response:
    """Every model the server has, loaded or not (details once loaded)."""
    return JSONResponse({"models": [await _entry(m) for m in state.models.models.values()]})


async def ps(request: Request, state: AppState) -> Response:
    """The loaded models, each with when it unloads if no request comes (a model that stays
    shows Ollama's expiry for keep_alive < 0); size_vram is what the GPU holds of its
    weights."""
    loaded = []
    for model in state.models.models.values():
        if model.status != LOADED or model.engine is None:
            continue
        entry, engine = await _entry(model), model.engine
        expires_in = state.models.expires_in(model)
        until = _FOREVER if math.isinf(expires_in) else timedelta(seconds=expires_in)
        entry.update({"expires_at": (datetime.now(timezone.utc) + until).isoformat(),
                      "size_vram": engine.model.size_bytes if engine.weights_on_gpu else 0,
                      "context_length": engine.max_seq_len})
        loaded.append(entry)
    return JSONResponse({"models": loaded})


async def show(request: Request, state: AppState) -> Response:
    """A model's details, GGUF metadata (model_info), chat template and capabilities; `name`
    is the older field for `model`."""
    body = await read_json(request, state.config)
    schemas.refuse_unimplemented(body, {"verbose": (False,)})
    engine = await state.engine_for(request, {"model": schemas.read_field(
        body, "model", "a string") or schemas.read_field(body, "name", "a string")})
    model = engine.model
    fim_tokens = model.fim_tokens
    capabilities = ["completion", "tools"]
    if min(fim_tokens.prefix, fim_tokens.suffix, fim_tokens.middle) >= 0:
        capabilities.append("insert")
    info = {k: int(v) if v.isdigit() else v for k, v in model.metadata.items()}
    entry = await _entry(request_model(request))
    return JSONResponse({"modelfile": f"FROM {model.path}\n", "parameters": "",
                         "template": request_model(request).renderer.template.source or "",
                         "details": entry["details"], "modified_at": entry["modified_at"],
                         "model_info": {**info, "general.parameter_count": model.n_params},
                         "capabilities": capabilities})


async def version(request: Request, state: AppState) -> Response:
    return JSONResponse({"version": cllm_version()})
