"""What clients of vLLM and llama-server expect besides the OpenAI basics: the model's names in
/v1/models (vLLM's `root`), models.retrieve, --served-model-name, vLLM's return_token_ids, and
llama-server's /completion, /props and /tokenize with_pieces. Real server, real model."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from http_checks import assert_error, post_stream, sse_payloads
from model_facts import ENDS_AT_ONCE, ON_GPU_NOT_BATCH_INVARIANT
from server_process import ServerProcess

MODEL = "smollm2-135m-instruct"
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"
PROMPT = "Once upon a time, in a small village by the sea,"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--parallel", "4") as srv:
        yield srv


def tokens_of(http: httpx.Client, text: str) -> list[int]:
    return http.post("/tokenize", json={"content": text, "add_special": True}).json()["tokens"]


def detokenize(http: httpx.Client, tokens: list[int]) -> str:
    return http.post("/detokenize", json={"tokens": tokens}).json()["content"]


# ---- model names ----

def test_models_list_the_served_name_with_the_repository_as_root(http, client):
    (card,) = http.get("/v1/models").json()["data"]
    assert card["id"] == MODEL and card["root"] == REPO
    assert card["max_model_len"] >= 256 and card["meta"]["n_vocab"] > 1000
    (listed,) = client.models.list()
    assert listed.id == MODEL and listed.model_extra["root"] == REPO


def test_models_retrieve_by_served_name_or_repository(client, http):
    assert client.models.retrieve(MODEL).id == MODEL
    assert client.models.retrieve(REPO).id == MODEL  # a path with a slash
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert_error(http.get("/v1/models/no-such-model"), 404, code="model_not_found")


def test_served_model_name_names_the_model_everywhere():
    with ServerProcess("--served-model-name", "my-model", "--parallel", "1") as srv:
        with srv.openai_client() as c:
            assert [m.id for m in c.models.list()] == ["my-model"]
            assert c.models.retrieve("my-model").model_extra["root"] == REPO
            r = c.completions.create(model="my-model", prompt=PROMPT, max_tokens=2)
            assert r.model == "my-model"
        assert httpx.get(srv.url + "/props").json()["model_alias"] == "my-model"


# ---- vLLM's return_token_ids ----

@ON_GPU_NOT_BATCH_INVARIANT  # the second request's prompt comes from the prefix cache
def test_completion_returns_prompt_and_output_token_ids(http):
    body = {"prompt": PROMPT, "max_tokens": 8, "return_token_ids": True, **GREEDY}
    whole = http.post("/v1/completions", json=body).json()
    (choice,) = whole["choices"]
    assert choice["prompt_token_ids"] == tokens_of(http, PROMPT)
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 8
    assert detokenize(http, choice["token_ids"]) == choice["text"]

    r, raw = post_stream(http, "/v1/completions", {**body, "stream": True})
    chunks = [c["choices"][0] for c in sse_payloads(raw)]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert [t for c in chunks for t in c["token_ids"]] == choice["token_ids"]
    assert "token_ids" not in http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 2}).json()["choices"][0]


@ON_GPU_NOT_BATCH_INVARIANT  # the second request's prompt comes from the prefix cache
def test_chat_returns_prompt_and_output_token_ids(client, http):
    messages = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                       temperature=0, extra_body={"return_token_ids": True})
    prompt_ids = r.model_extra["prompt_token_ids"]
    output_ids = r.choices[0].model_extra["token_ids"]
    assert detokenize(http, prompt_ids).endswith("<|im_start|>assistant\n")
    assert len(output_ids) == r.usage.completion_tokens
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0, stream=True,
        extra_body={"return_token_ids": True})
    chunks = list(stream)
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids")
                                                            or [])] == output_ids


# ---- llama-server's routes ----

def native_events(raw: bytes) -> list[dict]:
    """/completion's stream: `data: {...}` events, and no [DONE] (as llama-server sends it)."""
    events = raw.split(b"\n\n")
    assert events.pop() == b""
    assert all(e.startswith(b"data: {") for e in events), raw[-300:]
    return [json.loads(e[len(b"data: "):]) for e in events]


def test_native_completion_matches_the_openai_route(http):
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True}
    native = http.post("/completion", json=body).json()
    openai_text = http.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 8, **GREEDY}).json()["choices"][0]["text"]
    assert native["content"] == openai_text
    assert native["stop"] is True and native["stop_type"] == "limit"
    assert native["tokens_predicted"] == 8
    assert native["tokens_evaluated"] == len(tokens_of(http, PROMPT))
    assert native["model"] == MODEL and native["prompt"] == PROMPT
    assert native["generation_settings"]["n_predict"] == 8
    t = native["timings"]
    assert t["predicted_n"] == 8 and t["prompt_ms"] > 0 and t["predicted_per_second"] > 0


def test_native_completion_streams_events_then_totals(http):
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "ignore_eos": True,
            "return_tokens": True}
    whole = http.post("/completion", json=body).json()
    r, raw = post_stream(http, "/completion", {**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = native_events(raw)
    *partial, last = events
    assert partial and all(e["stop"] is False for e in partial)
    assert "".join(e["content"] for e in partial) == whole["content"]
    assert [t for e in partial for t in e["tokens"]] == whole["tokens"]
    assert len(whole["tokens"]) == 8
    assert last["stop"] is True and last["tokens_predicted"] == 8
    assert last["timings"]["predicted_n"] == 8


def test_native_completion_stop_types(http):
    word = http.post("/completion", json={"prompt": PROMPT, "n_predict": 50,
                                           "temperature": 0, "stop": [" "]}).json()
    assert word["stop_type"] == "word" and " " not in word["content"]
    eos = http.post("/completion", json={"prompt": ENDS_AT_ONCE, "n_predict": 200,
                                          "temperature": 0}).json()
    assert eos["stop_type"] == "eos" and eos["tokens_predicted"] < 200
    # A grammar's end is an end of generation too (llama-server samples an end token there).
    done = http.post("/completion", json={"prompt": PROMPT, "n_predict": 50, "stop": ["zzz"],
                                           "grammar": 'root ::= "Hi there"'}).json()
    assert (done["content"], done["stop_type"], done["stopping_word"]) == ("Hi there", "eos", "")


def test_native_completion_rejects_bad_input(http):
    assert_error(http.post("/completion", json={"prompt": PROMPT, "n_predict": 0}), 400)
    assert_error(http.post("/completion", json={"prompt": ""}), 400)
    assert_error(http.post("/completion", json={"prompt": [10**9]}), 400)


def test_props_describe_context_slots_model_and_template(http, server):
    props = http.get("/props").json()
    assert props["default_generation_settings"]["n_ctx"] >= 256
    assert props["total_slots"] == 4
    assert props["model_path"].endswith(".gguf") and props["model_alias"] == MODEL
    assert "<|im_start|>" in props["chat_template"]


def test_tokenize_with_pieces(http):
    text = "Hello 🙂<|im_start|>"
    tokens = http.post("/tokenize", json={"content": text}).json()["tokens"]
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == tokens
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                   for p in pieces)
    assert raw.decode() == text
    assert pieces[-1]["piece"] == "<|im_start|>"
