"""Structured output end to end with the real model: grammars compiled by cllm/engine/structured.py,
bitmasks applied in the core, the engine's matchers, and the HTTP API (response_format,
json_schema, grammar, tools) through raw HTTP and the openai SDK."""
import asyncio
import gc
import json
import math
import re
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import llguidance
import openai
import pytest
from engine_checks import FaultyContext, assert_idle, run_tokens
from http_checks import assert_error, metrics, post_stream, sse_payloads
from model_facts import ON_GPU_NOT_BATCH_INVARIANT
from server_process import ServerProcess
from tool_models import Node, Person

from cllm.config import EngineConfig, SamplingParams
from cllm.engine import structured
from cllm.engine.engine import Engine
from cllm.engine.structured import GrammarError, Grammars, MaskFiller
from cllm.llama import _core

SCHEMAS = json.loads((Path(__file__).resolve().parents[1] / "data" / "schemas.json").read_text())
MAX_TOKENS = 96  # every test schema's longest output is well below this
YES_NO = 'root ::= "The answer is " ("yes" | "no") "."'
LIST = 'root ::= item (", " item){0,3}\nitem ::= [a-z]{1,6}'
LIST_RE = re.compile(r"[a-z]{1,6}(, [a-z]{1,6}){0,3}")


def chat_prompt(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def ask_for(item: dict) -> str:
    return f"Give an example of {item['name'].replace('_', ' ')} as JSON."


def validates(text: str, schema: dict) -> bool:
    jsonschema.validate(json.loads(text), schema)  # raises, showing what is wrong
    return True


@pytest.fixture(scope="module", params=[False, True], ids=["host-sampling", "graph-sampling"])
def engine(model_path, request):
    """Split streams (batch-invariant on a CPU), sampling on the host, then in the graph as on a
    GPU, where greedy constrained rows take the device's masked choice (the CPU backend runs the
    same graphs here)."""
    eng = Engine(EngineConfig(n_ctx=16 * 512, n_parallel=16, n_threads=2, kv_unified=False,
                              backend_sampling=request.param), model_path)
    yield eng
    eng.shutdown()


def constrained(engine, **sampling):
    grammar = sampling.pop("schema", None)
    gbnf = sampling.pop("gbnf", None)
    compiled = engine.grammars.json_schema(grammar) if grammar is not None else (
        engine.grammars.gbnf(gbnf))
    return dict(sampling, grammar=compiled)


# ---- compiling ----

def test_grammars_are_cached_by_their_text(engine):
    first = engine.grammars.json_schema(SCHEMAS[0]["schema"])
    assert engine.grammars.json_schema(json.loads(json.dumps(SCHEMAS[0]["schema"]))) is first
    assert engine.grammars.gbnf(YES_NO) is engine.grammars.gbnf(YES_NO)
    assert engine.grammars.json_schema(SCHEMAS[1]["schema"]) is not first


def test_requests_bringing_one_new_grammar_together_compile_it_once(engine, monkeypatch):
    translated = []
    translate = llguidance.grammar_from

    def slow_translate(kind, text):  # long enough for every thread to ask meanwhile
        translated.append(text)
        time.sleep(0.2)
        return translate(kind, text)

    monkeypatch.setattr(llguidance, "grammar_from", slow_translate)
    grammar, bad = 'root ::= "together"', "root ::= missing_together"
    with ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(lambda _: engine.grammars.gbnf(grammar), range(8)))
        failures = [pool.submit(engine.grammars.gbnf, bad) for _ in range(4)]
    assert translated.count(grammar) == 1 and all(g is compiled[0] for g in compiled)
    for future in failures:  # every waiter hears why
        with pytest.raises(GrammarError, match="missing_together"):
            future.result()
    assert translated.count(bad) == 1


def _takes(engine, schema: dict, text: str) -> bool:
    """Whether the grammar of `schema` lets `text`'s tokens through in full."""
    matcher = engine.grammars.json_schema(schema).matcher()
    tokens = engine.model.tokenize(text, add_special=False)
    return matcher.validate_tokens(tokens) == len(tokens)


def test_an_object_listing_its_properties_takes_no_others_unless_it_says_so(engine):
    """As llama-server reads such schemas (JSON Schema's default allows any)."""
    inner = {"type": "object", "properties": {"city": {"type": "string"}}}
    closed = {"type": "object", "properties": {"where": inner}}
    assert _takes(engine, closed, '{"where": {"city": "Paris"}}')
    assert not _takes(engine, closed, '{"where": {"city": "Paris", "temperature": 21}}')
    assert not _takes(engine, closed, '{"where": {"city": "Paris"}, "temperature": 21}')
    opened = {**closed, "additionalProperties": {"type": "integer"}}
    assert _takes(engine, opened, '{"where": {"city": "Paris"}, "temperature": 21}')
    assert _takes(engine, {"type": "object"}, '{"temperature": 21}')


def test_integers_and_numbers_take_at_most_16_integral_digits(engine):
    """As llama-server bounds them: free, a small model writing greedily can repeat a digit
    until max_tokens. A bound the schema gives is kept."""
    for kind in ("integer", "number"):
        schema = {"type": "object", "properties": {"n": {"type": kind}}, "required": ["n"]}
        assert _takes(engine, schema, '{"n": 9007199254740991}')
        assert _takes(engine, schema, '{"n": -9007199254740991}')
        assert not _takes(engine, schema, '{"n": 11111111111111111')  # 17 digits
        assert not _takes(engine, schema, '{"n": -11111111111111111')
    assert _takes(engine, {"type": "number"}, "0.25")
    assert _takes(engine, {"type": "integer", "maximum": 10**18}, "111111111111111111")


@pytest.mark.parametrize("compile_, source, problem", [
    ("json_schema", {"type": "foo"}, "foo"),
    ("json_schema", {"type": "string", "pattern": "(("}, "unclosed group"),
    ("json_schema", {"$ref": "#/$defs/missing"}, "missing"),
    ("gbnf", "root ::= missing", "missing"),
    ("gbnf", "root ::= [a-z", "end of input"),
    ("json_schema", {"$ref": "#"}, "admits no text"),  # compiles; fails at its first bitmask
])
def test_a_bad_schema_or_grammar_is_an_error_naming_the_problem(engine, compile_, source, problem):
    with pytest.raises(GrammarError, match=re.escape(problem)):
        getattr(engine.grammars, compile_)(source)


def test_the_vocabulary_comes_from_the_gguf(engine):
    tokenizer = engine.grammars.tokenizer
    model = engine.model
    assert tokenizer.vocab_size == model.n_vocab
    assert set(tokenizer.eos_tokens) == set(model.eog_tokens)
    text = 'A "quoted" word, {and} braces.'
    assert tokenizer.decode_bytes(model.tokenize(text, add_special=False)) == text.encode()
    assert tokenizer.tokenize_str(text) == model.tokenize(text, add_special=False)
    assert tokenizer.is_special_token(model.eos_token)  # <|im_end|> is never spelled by text


# ---- the engine: outputs match, whatever runs beside them ----

def _matchers_midway(engine, n: int) -> list:
    """Matchers of n test schemas, each advanced by a few tokens its grammar allows."""
    matchers = []
    for item in SCHEMAS[:n]:
        matcher = engine.grammars.json_schema(item["schema"]).matcher()
        for token in engine.model.tokenize('{"', add_special=False)[:1]:
            matcher.consume_token(token)
        matchers.append(matcher)
    return matchers


def test_masks_filled_in_one_call_equal_each_matchers_own(engine):
    """MaskFiller fills every row's bitmask in one call into llguidance's threads, before the
    step or while it decodes: each equals the bitmask its matcher computes alone."""
    words = engine.ctx.mask_words
    # compute_bitmask's bytes run a word past the vocabulary's
    expected = [m.compute_bitmask()[:4 * words] for m in _matchers_midway(engine, 8)]
    assert len(set(expected)) > 1
    for filler in (MaskFiller(words), MaskFiller(words, overlap=True, threads=4)):
        masks = filler.fill(_matchers_midway(engine, 8))
        masks.wait()
        assert [bytes(masks.data[i * words:(i + 1) * words]) for i in range(8)] == expected
        assert masks.ready is None or masks.ready[0] == 1
        filler.close()


def test_a_row_without_a_matcher_keeps_its_bitmask(engine):
    words = engine.ctx.mask_words
    filler = MaskFiller(words)
    first, second, third = _matchers_midway(engine, 3)
    kept = bytes(filler.fill([first, second]).data[:words])
    masks = filler.fill([None, third])
    assert bytes(masks.data[:words]) == kept
    assert bytes(masks.data[words:]) == _matchers_midway(engine, 3)[2].compute_bitmask()[:4 * words]


def test_a_grammar_keeps_its_model_alive(model_path):
    """Its matchers tokenize with the model's vocabulary in C, so the model lives as long as
    any grammar compiled for it, not only as long as its engine."""
    model = _core.Model(model_path, n_gpu_layers=0)
    alive = weakref.ref(model)
    grammar = Grammars(model).json_schema(SCHEMAS[0]["schema"])
    del model
    gc.collect()
    assert alive() is not None
    matcher = grammar.matcher()
    assert matcher.consume_tokens(alive().tokenize('{"', add_special=False))
    del grammar, matcher
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.8, "seed": 5}],
                         ids=["greedy", "sampled"])
def test_a_grammar_that_fails_while_generating_ends_its_request_with_the_error(engine, sampling):
    """A matcher that fails computing a bitmask mid-reply (here past a parser limit of three
    Earley items a step, at the fourth token of YES_NO) lets only end tokens through, or
    nothing at all where they are banned: the request ends with finish reason "grammar" naming
    the failure, never as a complete "stop" with its reply cut short, and nothing stays held."""
    source = engine.grammars.gbnf(YES_NO).source
    failing = structured.Grammar(source, llguidance.LLMatcher(
        engine.grammars.tokenizer, source, log_level=0,
        limits=llguidance.LLParserLimits(step_max_items=3)), engine.model)
    prompt = engine.model.tokenize(chat_prompt("Is the sea salty?"))
    for ignore_eos in (False, True):
        text, _, final = asyncio.run(run_tokens(engine, prompt, grammar=failing, max_tokens=16,
                                                ignore_eos=ignore_eos, **sampling))
        assert not re.fullmatch(r"The answer is (yes|no)\.", text)  # cut short
        assert final.finish_reason == "grammar", (ignore_eos, text, final)
        assert "grammar failed mid-reply" in final.error and "Too many items" in final.error
        assert "\n" not in final.error  # the failure, not the parser's state after it
    assert_idle(engine)


@ON_GPU_NOT_BATCH_INVARIANT  # two engines whose steps take other times batch rows otherwise
def test_the_engine_overlapping_masks_with_the_decode_gives_the_same_outputs(model_path, engine):
    """The GPU engine's way (bitmasks filled on a thread of their own while the step decodes),
    run here: greedy constrained outputs equal those of the engine that fills them before each
    step, token for token."""
    async def outputs(eng):
        return await asyncio.gather(*(
            run_tokens(eng, eng.model.tokenize(chat_prompt(ask_for(item))),
                       **constrained(eng, schema=item["schema"], max_tokens=MAX_TOKENS,
                                     temperature=0))
            for item in SCHEMAS[:8]))

    overlapped = Engine(EngineConfig(n_ctx=16 * 512, n_parallel=16, n_threads=2,
                                     kv_unified=False), model_path)
    overlapped._masks = MaskFiller(overlapped.ctx.mask_words, overlap=True)
    try:
        got = asyncio.run(outputs(overlapped))
    finally:
        overlapped.shutdown()
    assert [ids for _, ids, _ in got] == [ids for _, ids, _ in asyncio.run(outputs(engine))]
    for item, (text, _, _) in zip(SCHEMAS[:8], got):
        assert validates(text, item["schema"])


def test_every_schema_validates_greedy_and_sampled(engine):
    async def scenario():
        jobs = []
        for item in SCHEMAS:
            tokens = engine.model.tokenize(chat_prompt(ask_for(item)))
            for sampling in (dict(temperature=0), dict(temperature=0.8, seed=7)):
                jobs.append(run_tokens(engine, tokens, **constrained(
                    engine, schema=item["schema"], max_tokens=MAX_TOKENS, **sampling)))
        return await asyncio.gather(*jobs)

    results = asyncio.run(scenario())
    for i, (text, _, final) in enumerate(results):
        item = SCHEMAS[i // 2]
        assert final.finish_reason == "stop", (item["name"], text)
        assert validates(text, item["schema"])
    assert_idle(engine)


def test_a_gbnf_output_matches_its_grammar(engine):
    async def scenario():
        prompts = ["Is the sky blue?", "Name some fruits.", "List colors.", "Is 2 odd?"]
        return await asyncio.gather(*(
            run_tokens(engine, engine.model.tokenize(chat_prompt(p)),
                       **constrained(engine, gbnf=grammar, max_tokens=40, temperature=t, seed=3))
            for p in prompts for grammar in (YES_NO, LIST) for t in (0, 1.0)))

    results = asyncio.run(scenario())
    for i, (text, _, final) in enumerate(results):
        assert final.finish_reason == "stop"
        if (i // 2) % 2 == 0:
            assert text in ("The answer is yes.", "The answer is no.")
        else:
            assert LIST_RE.fullmatch(text), text


@ON_GPU_NOT_BATCH_INVARIANT
def test_unconstrained_rows_beside_constrained_ones_are_unchanged(engine):
    prompts = [chat_prompt(q) for q in ("Tell me about the sea.", "What is a cat?",
                                        "Describe a forest.")]

    async def unconstrained():
        return await asyncio.gather(*(run_tokens(engine, engine.model.tokenize(p), max_tokens=24,
                                                 temperature=0) for p in prompts))

    async def mixed():
        constrained_jobs = [run_tokens(engine, engine.model.tokenize(chat_prompt(ask_for(item))),
                                       **constrained(engine, schema=item["schema"],
                                                     max_tokens=MAX_TOKENS, temperature=0))
                            for item in SCHEMAS[:6]]
        results = await asyncio.gather(unconstrained(), *constrained_jobs)
        return results[0], results[1:]

    alone = asyncio.run(unconstrained())
    beside, constrained_results = asyncio.run(mixed())
    assert [ids for _, ids, _ in beside] == [ids for _, ids, _ in alone]
    for item, (text, _, _) in zip(SCHEMAS[:6], constrained_results):
        assert validates(text, item["schema"])


def test_logprobs_report_the_constrained_distribution(engine):
    tokens = engine.model.tokenize(chat_prompt("Is the sky blue?"))
    sampling = constrained(engine, gbnf='root ::= "yes" | "no"', max_tokens=4, temperature=0,
                           logprobs=5)

    async def request():
        text, logprobs = "", []
        async for delta in engine.submit(tokens, SamplingParams(**sampling)):
            text, logprobs = text + delta.text, logprobs + (delta.logprobs or [])
        return text, logprobs

    text, logprobs = asyncio.run(request())
    assert text in ("yes", "no")
    first = logprobs[0]
    pieces = [engine.model.token_to_piece(t).decode() for t, _ in first.top]
    assert all("yes".startswith(p) or "no".startswith(p) for p in pieces), pieces
    # Every allowed token is among the top 5 here, so their probabilities make up the whole.
    assert sum(math.exp(lp) for _, lp in first.top) == pytest.approx(1.0, abs=1e-3)
    assert first.logprob == max(lp for _, lp in first.top)  # greedy took the likeliest


@ON_GPU_NOT_BATCH_INVARIANT  # the texts these expect are the CPU's
def test_a_preempted_constrained_request_resumes_where_it_was(model_path, engine):
    item = SCHEMAS[6]  # nested_address
    tokens = engine.model.tokenize(chat_prompt(ask_for(item)))
    sampling = constrained(engine, schema=item["schema"], max_tokens=MAX_TOKENS,
                           temperature=0.8, seed=11)
    alone = asyncio.run(run_tokens(engine, tokens, **sampling))
    eng = Engine(EngineConfig(n_ctx=2048, n_parallel=2, n_threads=2, kv_unified=False),
                 model_path)
    try:
        eng.ctx = FaultyContext(eng.ctx, _core.KVCacheFullError(1, "injected"), after=10)
        preempted = asyncio.run(run_tokens(eng, tokens, **dict(
            sampling, grammar=eng.grammars.json_schema(item["schema"]))))
        assert eng.scheduler.num_preemptions == 1
        assert preempted[1] == alone[1] and validates(preempted[0], item["schema"])
        assert_idle(eng)
    finally:
        eng.shutdown()


class RunLog:
    """The engine's context, noting how many constrained rows each decode run carried."""

    def __init__(self, ctx):
        self._ctx, self.constrained = ctx, []

    def decode_run(self, *args, **kwargs):
        mask_rows = args[5] if len(args) > 5 else None
        self.constrained.append(0 if mask_rows is None else sum(m >= 0 for m in mask_rows))
        return self._ctx.decode_run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


@ON_GPU_NOT_BATCH_INVARIANT  # the texts these expect are the CPU's
@pytest.mark.parametrize("overlap", [False, True], ids=["before-the-step", "overlapped"])
def test_decode_runs_carry_constrained_rows_to_the_same_outputs(model_path, engine, overlap):
    """With several decode steps per call into C, constrained rows run in them (their matchers
    advancing between steps, a finished grammar ending its row mid-run) and give, token for
    token, what one step at a time gives, free rows beside them too; also with the bitmasks
    filled while each step decodes (a GPU build's way)."""
    free = [chat_prompt("Tell me about the sea."), chat_prompt("What is a cat?")]

    async def scenario(eng):
        jobs = [run_tokens(eng, eng.model.tokenize(p), max_tokens=32, temperature=0)
                for p in free]
        jobs += [run_tokens(eng, eng.model.tokenize(chat_prompt(ask_for(item))),
                            **constrained(eng, schema=item["schema"], max_tokens=MAX_TOKENS,
                                          **sampling))
                 for item in SCHEMAS[:4] for sampling in (dict(temperature=0),
                                                          dict(temperature=0.8, seed=5))]
        return await asyncio.gather(*jobs)

    runs = Engine(EngineConfig(n_ctx=16 * 512, n_parallel=16, n_threads=2, kv_unified=False,
                               decode_steps=8), model_path)
    try:
        runs.ctx = log = RunLog(runs.ctx)
        if overlap:
            runs._masks = MaskFiller(runs.ctx.mask_words, overlap=True)
        results = asyncio.run(scenario(runs))
        assert_idle(runs)
    finally:
        runs.shutdown()
    assert [ids for _, ids, _ in results] == [ids for _, ids, _ in asyncio.run(scenario(engine))]
    # Decode runs carried constrained rows, several at once. Not necessarily all eight: runs
    # wait until no prompt is pending, and when the requests reach the engine (in how many
    # steps' inboxes) differs between machines: on a 2-core Xeon one of the eight never ran in
    # one (its 15 tokens all in single steps), with the same outputs.
    assert max(log.constrained) >= 2
    for i, (text, _, final) in enumerate(results[2:]):
        assert final.finish_reason == "stop" and validates(text, SCHEMAS[i // 2]["schema"])


# ---- HTTP: response_format, json_schema, grammar ----

@pytest.fixture(scope="module")
def server():
    with ServerProcess("--parallel", "16", "--threads", "2") as srv:
        yield srv


HTTP_TIMEOUT = 300  # constrained replies of many schemas, on 2 busy cores
MODEL = "smollm2-135m-instruct"  # the served model's name: another is a 404


def _texts(path: str, response: dict) -> list[str]:
    if path == "/v1/completions":
        return [c["text"] for c in response["choices"]]
    return [c["message"]["content"] for c in response["choices"]]


def _streamed_texts(payloads: list[dict], n: int) -> list[str]:
    texts = [""] * n
    for p in payloads:
        for c in p["choices"]:
            texts[c["index"]] += c.get("text") or c.get("delta", {}).get("content") or ""
    return texts


async def _post(http_async: httpx.AsyncClient, path: str, body: dict) -> tuple[list[str], list]:
    """(texts, finish reasons) of a request, streamed or not."""
    if body.get("stream"):
        async with http_async.stream("POST", path, json=body) as r:
            raw = await r.aread()
        assert r.status_code == 200, raw
        payloads = sse_payloads(raw)
        reasons = [c["finish_reason"] for p in payloads for c in p["choices"]
                   if c["finish_reason"]]
        return _streamed_texts(payloads, body.get("n", 1)), reasons
    r = await http_async.post(path, json=body)
    assert r.status_code == 200, r.text
    return _texts(path, r.json()), [c["finish_reason"] for c in r.json()["choices"]]


def _schema_request(i: int, item: dict) -> tuple[str, dict]:
    """Schema i asked one of four ways, in turn: greedy and sampled, streamed and not, n=2, on
    both OpenAI routes (the engine test above asks every schema greedy and sampled)."""
    schema = item["schema"]
    fmt = {"type": "json_schema", "json_schema": {"name": item["name"], "schema": schema}}
    chat = {"messages": [{"role": "user", "content": ask_for(item)}],
            "response_format": fmt, "max_tokens": MAX_TOKENS}
    completion = {"prompt": chat_prompt(ask_for(item)), "max_tokens": MAX_TOKENS}
    return [("/v1/chat/completions", dict(chat, temperature=0)),
            ("/v1/chat/completions", dict(chat, temperature=0.9, seed=5, n=2, stream=True)),
            ("/v1/completions", dict(completion, response_format=fmt, temperature=0.9, seed=9,
                                     n=2)),
            ("/v1/completions", dict(completion, json_schema=schema, temperature=0,
                                     stream=True))][i % 4]


def test_every_schema_validates_over_http(server):
    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as h:
            jobs = [(item, _post(h, *_schema_request(i, item))) for i, item in enumerate(SCHEMAS)]
            results = await asyncio.gather(*(job for _, job in jobs))
            return [(item, result) for (item, _), result in zip(jobs, results)]

    outputs = 0
    for item, (texts, reasons) in asyncio.run(scenario()):
        assert reasons == ["stop"] * len(texts), (item["name"], texts)
        for text in texts:
            assert validates(text, item["schema"])
            outputs += 1
    assert outputs == 30


def test_json_mode_always_parses(server, engine):
    """A reply that ends is a JSON object. One that max_tokens cuts is a prefix the grammar
    allows: sampled, a 135M model may loop inside a string (one of these eight did on an AMD
    EPYC without AVX-512, whose kernels round differently), as it may under OpenAI's JSON mode."""
    questions = ["Describe a cat.", "List three fruits.", "Who are you?", "What is 2+2?"]

    async def scenario():
        async with httpx.AsyncClient(base_url=server.url, timeout=600) as h:
            return await asyncio.gather(*(_post(h, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": q}], "max_tokens": 200, "n": 2,
                "temperature": 0.7, "seed": 1, "response_format": {"type": "json_object"}})
                for q in questions))

    ended = 0
    for texts, reasons in asyncio.run(scenario()):
        for text, reason in zip(texts, reasons):
            if reason == "stop":
                assert isinstance(json.loads(text), dict)
                ended += 1
            else:
                assert reason == "length" and _takes(engine, {"type": "object"}, text), text
    assert ended >= 4


def test_gbnf_on_every_route(http):
    for path, body in [("/v1/completions", {"prompt": chat_prompt("Is water wet?")}),
                       ("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "Is water wet?"}]}),
                       ("/generate", {"prompt": chat_prompt("Is water wet?")})]:
        r = http.post(path, json=dict(body, grammar=YES_NO, max_tokens=20, temperature=0))
        assert r.status_code == 200, r.text
        body = r.json()
        text = body["data"]["text"] if path == "/generate" else _texts(path, body)[0]
        assert text in ("The answer is yes.", "The answer is no.")


@pytest.mark.parametrize("field, value, problem", [
    ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}},
     "foo"),
    ("json_schema", {"type": "string", "pattern": "(("}, "unclosed group"),
    ("grammar", "root ::= missing", "missing"),
    ("json_schema", {"$ref": "#"}, "admits no text"),
])
def test_a_bad_schema_is_a_400_naming_it_and_nothing_is_queued(http, field, value, problem):
    before = metrics(http)
    r = http.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], field: value})
    error = assert_error(r, 400, type_="invalid_request_error", code="invalid_grammar")
    assert error["param"] == field and problem in error["message"]
    after = metrics(http)
    assert after["cllm_prompt_tokens_total"] == before["cllm_prompt_tokens_total"]
    assert after["cllm_requests_running"] == after["cllm_requests_waiting"] == 0


def _chain(links: int, link) -> dict:
    """A schema whose definitions refer each to the next, `links` deep."""
    defs = {f"d{i}": link(f"#/$defs/d{i + 1}") for i in range(links)}
    defs[f"d{links}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


# Each nested past what llguidance's compiler took on an 8 MiB stack (it overflowed it and the
# process died): a chain through properties, items and anyOf, and GBNF rules naming the next.
DEEP_SCHEMAS = [_chain(1500, lambda r: {"type": "object", "properties": {"x": {"$ref": r}}}),
                _chain(3000, lambda r: {"type": "array", "items": {"$ref": r}}),
                _chain(3000, lambda r: {"anyOf": [{"$ref": r}, {"type": "null"}]})]
DEEP_GRAMMAR = ("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(6000))
                + 'r6000 ::= "x"\n')
DEEP_FIELDS = ([("json_schema", s) for s in DEEP_SCHEMAS]
               + [("response_format", {"type": "json_schema", "json_schema": {"schema": s}})
                  for s in DEEP_SCHEMAS] + [("grammar", DEEP_GRAMMAR)])


def test_a_schema_or_grammar_nested_thousands_deep_is_a_400_and_the_server_lives(server, http):
    prompt = {"/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
              "/v1/completions": {"prompt": "Hi"}, "/generate": {"prompt": "Hi"},
              "/completion": {"prompt": "Hi"}}
    for path, body in prompt.items():
        for field, value in DEEP_FIELDS:
            r = http.post(path, json={**body, field: value, "max_tokens": 4})
            assert r.status_code == 400, (path, field, r.text[:300])
            assert r.json()["error"]["message"].startswith(f"{field}: "), r.text[:300]
            assert "levels deep" in r.json()["error"]["message"]
    deep_tool = {"type": "function", "function": {"name": "f", "parameters": DEEP_SCHEMAS[0]}}
    r = http.post("/v1/chat/completions", json={**prompt["/v1/chat/completions"],
                                                "tools": [deep_tool], "tool_choice": "required"})
    assert assert_error(r, 400)["param"] == "tools"
    assert server.proc.poll() is None
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "json_schema":
                                           {"type": "object"}})
    assert r.status_code == 200, r.text


# Its first bitmask is within llguidance's limits, its second (after one token) is not: too many
# Earley items, from short lexemes that can end almost anywhere.
LIMITS_PASSED_MIDWAY = 'root ::= ([a-z]* "e" [a-z]{12} " ")*'


@pytest.mark.parametrize("stream", [False, True])
def test_a_grammar_past_the_matchers_limits_mid_reply_is_the_clients_error(http, stream):
    """The request's grammar is at fault, not the server: a 400 (streamed, an error event of
    that type), counted as a client's failure in /metrics, with a message that says so."""
    before = metrics(http)
    body = {"prompt": chat_prompt("Say something."), "grammar": LIMITS_PASSED_MIDWAY,
            "max_tokens": 16, "temperature": 0, "stream": stream}
    if stream:
        r, raw = post_stream(http, "/v1/completions", body)
        assert r.status_code == 200
        error = sse_payloads(raw)[-1]["error"]
    else:
        error = assert_error(http.post("/v1/completions", json=body), 400)
    assert error["type"] == "invalid_request_error" and error["code"] == "grammar_failed"
    assert "grammar failed mid-reply" in error["message"] and "Too many items" in error["message"]
    after = metrics(http)
    failures = lambda m, code: m.get(f'cllm_request_failure_total{{code="{code}"}}', 0)  # noqa: E731
    assert failures(after, 400) == failures(before, 400) + 1
    assert failures(after, 500) == failures(before, 500)


# ---- tools through the openai SDK ----

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                   "required": ["zone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]


def _arguments(call, tool: dict) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


@pytest.mark.parametrize("parallel", [False, True])
def test_a_named_tool_choice_calls_that_tool_once(client, parallel):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, TIME], temperature=0, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=parallel)
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_time" and _arguments(call, TIME)


def test_required_calls_are_valid_calls_of_offered_tools(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME],
                                       tool_choice="required", temperature=0.8, seed=2, n=2,
                                       parallel_tool_calls=False, max_tokens=100)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        tools = {"get_weather": WEATHER, "get_time": TIME}
        for call in choice.message.tool_calls:
            assert _arguments(call, tools[call.function.name]) is not None
        assert len({c.id for c in choice.message.tool_calls}) == len(choice.message.tool_calls)


@ON_GPU_NOT_BATCH_INVARIANT  # the texts these expect are the CPU's
def test_parallel_calls_come_with_their_own_ids(client):
    """A reply of two forced calls ("required" allows one or more; the prompt asks for two)."""
    messages = [{"role": "system", "content": "Always call get_weather once for each city."},
                {"role": "user", "content": "Weather in Paris and in Rome?"}]
    r = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], temperature=0, max_tokens=100,
        tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_weather"] * len(calls)
    assert len(calls) >= 2, calls  # observed with SmolLM2 greedy: Paris, then Rome
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    assert len({c.id for c in calls}) == len(calls)


def test_streamed_tool_call_deltas_reassemble_to_the_same_calls(client):
    request = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                   parallel_tool_calls=False, temperature=0, max_tokens=100)
    whole = client.chat.completions.create(**request).choices[0]
    assembled: dict[int, dict] = {}
    reasons = []
    for chunk in client.chat.completions.create(stream=True, **request):
        for choice in chunk.choices:
            reasons += [choice.finish_reason] if choice.finish_reason else []
            for d in choice.delta.tool_calls or []:
                call = assembled.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += d.id or ""
                call["name"] += d.function.name or ""
                call["arguments"] += d.function.arguments or ""
    assert reasons == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for _, c in sorted(assembled.items())] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in assembled.values())


def _earlier_call(i: int, city: str) -> list[dict]:
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}
    return [{"role": "user", "content": f"Weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [call]}]


def test_auto_calls_when_the_history_shows_how_and_answers_when_not_asked(client):
    """With `auto` the model decides. SmolLM2-135M (greedy) does not call on a bare request, but
    does after two earlier calls in the history; asked to say hello, it answers in text."""
    history = _earlier_call(1, "London") + _earlier_call(2, "Rome")
    calls = client.chat.completions.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_tokens=60,
        messages=history + [{"role": "user", "content": "Weather in Paris?"}])
    (choice,) = calls.choices
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] == "Paris"  # unconstrained: as it wrote
    plain = client.chat.completions.create(
        model=MODEL, tools=[WEATHER], temperature=0, max_tokens=40,
        messages=[{"role": "user", "content": "Say hello to me."}])
    (choice,) = plain.choices
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content and "<tool_call>" not in choice.message.content


def test_a_tool_result_in_the_history_round_trips(client):
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], temperature=0, max_tokens=100,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False).choices[0]
    assert first.message.tool_calls, first
    first = first.message
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                      "content": '{"temperature": 21, "sky": "clear"}'}]
    reply = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER],
                                           tool_choice="none", temperature=0, max_tokens=16)
    (choice,) = reply.choices
    assert choice.message.content and not choice.message.tool_calls
    assert reply.usage.prompt_tokens > 0


# ---- tools whose parameters are Pydantic models with nested ones ($defs and $ref) ----

@pytest.mark.parametrize("model, ask", [(Person, "Save Ann, who lives at 1 Main St in Oslo."),
                                        (Node, "Save a tree: a root with no children.")])
def test_a_forced_call_of_a_pydantic_tool_has_arguments_that_validate(client, model, ask):
    """The openai SDK's pydantic_function_tool, forced: its schema's references resolve per
    tool, and the arguments the model writes are a valid instance."""
    tool = openai.pydantic_function_tool(model, name=f"save_{model.__name__.lower()}")
    name = tool["function"]["name"]
    served = client.models.list().data[0].id
    for choice in ({"type": "function", "function": {"name": name}}, "required"):
        r = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": ask}],
            tools=[tool, WEATHER], tool_choice=choice, parallel_tool_calls=False,
            temperature=0, max_tokens=200)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        (call,) = r.choices[0].message.tool_calls
        if call.function.name == name:
            model.model_validate_json(call.function.arguments)
        else:
            _arguments(call, WEATHER)
