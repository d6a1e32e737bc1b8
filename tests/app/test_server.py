"""The HTTP server end to end: real `python -m cllm.serve` processes with the real default model,
driven by the official openai client and raw HTTP (httpx). No mocks.

Servers with the same options are shared (module-scoped fixtures); the ones that a test stops
or configures specially are started inside that test."""
from __future__ import annotations

import asyncio
import json
import resource
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from http_checks import (
    StreamGaps,
    assert_error,
    metrics,
    post_stream,
    read_until_closed,
    sse_payloads,
    wait_for_metric,
)
from model_facts import ON_GPU_NOT_BATCH_INVARIANT
from server_process import ServerProcess
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from cllm.config import ServerConfig
from cllm.engine import steptimer
from cllm.http.chat_template import ChatTemplate
from cllm.http.common import AppState, guarded
from cllm.http.metrics import Metrics, step_timer_counts
from cllm.models import ModelSource

MODEL = "smollm2-135m-instruct"
PROMPT = "Once upon a time, in a small village by the sea,"
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]
LONG = 1500  # max_tokens of a request meant to run until something else stops it


# ---- fixtures and helpers ----

@pytest.fixture(scope="module")
def server():
    with ServerProcess() as srv:
        yield srv


@pytest.fixture(scope="module")
def limits():
    """A small context (256 cells, all for one sequence) and a small body limit."""
    with ServerProcess("--ctx-size", "256", "--parallel", "1", "--max-body-bytes", "4096") as srv:
        yield srv


def n_tokens(http: httpx.Client, text: str) -> int:
    r = http.post("/tokenize", json={"content": text, "add_special": True})
    assert r.status_code == 200
    return len(r.json()["tokens"])


# ---- the openai client ----

def test_completion(client, http):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.model == MODEL and r.id
    (choice,) = r.choices
    assert choice.index == 0 and choice.finish_reason == "length"
    assert isinstance(choice.text, str) and choice.text.strip()
    assert r.usage.prompt_tokens == n_tokens(http, PROMPT)
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8


def test_ignore_eos_streams_text_where_the_model_would_end(client):
    # Greedy SmolLM2 ends this prompt at once; with ignore_eos, end tokens are never sampled
    # (as in llama-server), so the first streamed chunk already carries text.
    prompt = "Explain why the sky is blue in simple terms."
    ended = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
    assert ended.choices[0].finish_reason == "stop" and ended.choices[0].text == ""
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert texts[0] and "".join(texts).strip()
    assert chunks[-1].usage.completion_tokens == 8


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.model == MODEL and r.id
    (choice,) = r.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 5  # the template's tokens and the message's
    assert 1 <= r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_matches_the_whole_response(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    usage_chunk = chunks.pop()
    assert usage_chunk.choices == []
    assert usage_chunk.usage.model_dump() == whole.usage.model_dump()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks)
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == whole.choices[0].finish_reason and set(reasons[:-1]) == {None}
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content


def test_completion_stream_matches_the_whole_response(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True})
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    assert all(c.object == "text_completion" for c in chunks)
    reasons = [c.choices[0].finish_reason for c in chunks]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text


def test_n_choices_share_one_prompt(client, http):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=2, temperature=1.0,
                                  seed=11, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.choices[0].text != r.choices[1].text  # one seed, yet the choices differ
    assert r.usage.prompt_tokens == n_tokens(http, PROMPT)  # counted once, not twice
    assert r.usage.completion_tokens == 12

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, n=2,
                                          extra_body={"ignore_eos": True})
    assert sorted(c.index for c in chat.choices) == [0, 1]
    single = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
    assert chat.usage.prompt_tokens == single.usage.prompt_tokens
    assert chat.usage.completion_tokens == 12

    stream = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, n=2, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True}))
    finished = [ch.index for c in stream for ch in c.choices if ch.finish_reason]
    assert sorted(finished) == [0, 1]
    assert stream[-1].usage.completion_tokens == 8


def test_stop_string(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.completions.create(**args).choices[0].text
    words = full.split()
    assert len(words) >= 4, full
    stop = words[len(words) // 2]
    r = client.completions.create(**args, stop=[stop, "never-generated-xyz"])
    (choice,) = r.choices
    assert choice.finish_reason == "stop"
    assert choice.text == full[:full.index(stop)]
    assert stop not in choice.text

    chat_args = dict(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    full = client.chat.completions.create(**chat_args).choices[0].message.content
    stop = full.split()[min(2, len(full.split()) - 1)]
    r = client.chat.completions.create(**chat_args, stop=stop)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    (choice,) = r.choices
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert len(lp.text_offset) == 5
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 1 <= len(top) <= 3 and all(v <= 0.0 for v in top.values())
        # Greedy: the chosen token is the most likely one.
        assert token in top and top[token] == pytest.approx(max(top.values()), abs=1e-4)
        assert logprob == pytest.approx(top[token], abs=1e-4)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    (choice,) = r.choices
    content = choice.logprobs.content
    assert len(content) == r.usage.completion_tokens == 6
    assert "".join(e.token for e in content) == choice.message.content
    for entry in content:
        assert entry.logprob <= 0.0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        first, second = entry.top_logprobs
        assert first.logprob >= second.logprob
        assert first.token == entry.token
        assert first.logprob == pytest.approx(entry.logprob, abs=1e-4)

    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert plain.choices[0].logprobs is None


# Greedy replies of characters of several bytes, which tokens split.
EMOJI_CHAT = [{"role": "user", "content": "Send party emojis"},
              {"role": "assistant", "content": "🎉🎉🎉🎉🎉🎉"}, {"role": "user", "content": "More!"}]
CJK_CHAT = [{"role": "user", "content": "Say hello in Japanese"},
            {"role": "assistant", "content": "こんにちは、こんにちは、こんにちは"},
            {"role": "user", "content": "Again"}]
EMOJI_PROMPT = "🙂🎉🙂🎉🙂🎉🙂🎉🙂🎉"
CJK_PROMPT = "日本語: こんにちは、こんにちは、こんにちは、"


@pytest.mark.parametrize("messages", [EMOJI_CHAT, CJK_CHAT], ids=["emoji", "cjk"])
def test_chat_logprobs_bytes_make_up_the_reply(http, messages):
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12,
                                                "temperature": 0, "logprobs": True,
                                                "top_logprobs": 3})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    content = choice["message"]["content"]
    assert any(ord(c) > 0x3000 for c in content), content  # the reply has such characters
    entries = choice["logprobs"]["content"]
    raw = b"".join(bytes(e["bytes"] or b"") for e in entries)
    assert raw.decode("utf-8", "replace") == content
    for e in entries:
        assert e["top_logprobs"][0]["token"] == e["token"]  # greedy: the same name
        assert e["top_logprobs"][0]["bytes"] == e["bytes"]


@pytest.mark.parametrize("prompt", [EMOJI_PROMPT, CJK_PROMPT], ids=["emoji", "cjk"])
def test_completion_logprobs_of_multibyte_text(http, prompt):
    body = {"prompt": prompt, "max_tokens": 10, "temperature": 0, "logprobs": 3,
            "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = whole["logprobs"]
    assert any(ord(c) > 0x3000 for c in whole["text"]), whole["text"]
    # Tokens that are parts of one character have distinct names: none is lost from a top list.
    assert all(len(top) == 3 for top in lp["top_logprobs"]), lp["top_logprobs"]
    assert all(token in top for token, top in zip(lp["tokens"], lp["top_logprobs"]))
    offsets = lp["text_offset"]
    assert offsets == sorted(offsets) and offsets[-1] < len(whole["text"])
    # Streamed, the offsets go on from chunk to chunk.
    response, raw = post_stream(http, "/v1/completions", {**body, "stream": True})
    streamed = [c for e in sse_payloads(raw) for c in e["choices"]]
    assert [o for c in streamed if c["logprobs"] for o in c["logprobs"]["text_offset"]] == offsets


def test_seed_reproduces_sampling(client):
    def sample(seed, chat=False):
        if chat:
            r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12,
                                               temperature=1.0, seed=seed,
                                               extra_body={"ignore_eos": True})
            return r.choices[0].message.content
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                      seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))
    assert sample(99, chat=True) == sample(99, chat=True)


def test_tiny_temperature_is_greedy(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True})
    greedy = client.completions.create(**args, temperature=0).choices[0].text
    assert client.completions.create(**args, temperature=1e-40).choices[0].text == greedy


def test_openai_client_raises_on_a_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["message"]


# A Gemma-style template that writes the BOS token itself, as Gemma's instruct models' do.
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n"
                  "{{ m.content }}<end_of_turn>\n{% endfor %}<start_of_turn>model\n")


def test_template_that_writes_bos_gets_no_second_one(gemma_path, tmp_path):
    gguf = tmp_path / "gemma-chat.gguf"  # the base model has no template: give it one
    subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", gemma_path, str(gguf),
                    "--chat-template", GEMMA_TEMPLATE, "--force"],
                   check=True, capture_output=True, timeout=600)
    rendered = ChatTemplate(GEMMA_TEMPLATE, bos_token="<bos>", eos_token="<eos>").render(CHAT)
    with ServerProcess("--model", str(gguf), "--ctx-size", "512", "--parallel", "1") as srv, \
            srv.http_client(60) as http:
        tokens = http.post("/tokenize", json={"content": rendered}).json()["tokens"]
        assert tokens[0] != tokens[1]  # one BOS: the template's
        r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(tokens)


# ---- /generate, the original API ----

@ON_GPU_NOT_BATCH_INVARIANT  # the second request's prompt comes from the prefix cache
def test_generate(http):
    body = {"prompt": PROMPT, "max_tokens": 7, "temperature": 0.0, "ignore_eos": True}
    r = http.post("/generate", json=body)
    assert r.status_code == 200
    result = r.json()
    assert result.keys() == {"success", "data"} and result["success"] is True
    data = result["data"]
    assert data.keys() == {"text", "generated_tokens", "finish_reason"}
    assert data["generated_tokens"] == 7 and data["finish_reason"] == "length"
    assert isinstance(data["text"], str) and data["text"].strip()

    # With the original fields only; the defaults apply (max_tokens 16).
    r = http.post("/generate", json={"prompt": PROMPT, "temperature": 0.7, "top_p": 0.9,
                                     "top_k": 40, "stream": False})
    assert r.status_code == 200 and 1 <= r.json()["data"]["generated_tokens"] <= 16
    r = http.post("/generate", json={"prompt": PROMPT, "ignore_eos": True})
    assert r.status_code == 200
    assert r.json()["data"]["generated_tokens"] == 16 and r.json()["data"]["finish_reason"] == "length"

    # Streamed: each event carries the new text and the count so far.
    response, raw = post_stream(http, "/generate", {**body, "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(raw)
    assert all(e["success"] is True and e.keys() == {"success", "data"} for e in events)
    counts = [e["data"]["generated_tokens"] for e in events]
    assert counts == sorted(counts) and counts[-1] == 7
    assert [e["data"]["finish_reason"] for e in events][-1] == "length"
    assert all(e["data"]["finish_reason"] is None for e in events[:-1])
    assert "".join(e["data"]["text"] for e in events) == data["text"]


@pytest.mark.parametrize("body", [
    b'{"prompt": "Hi", "max_tokens": 0}',
    b'{"prompt": "Hi", "max_tokens": "10"}',
    b'{"prompt": ""}',
    b'{"max_tokens": 5}',
    b'{"prompt": "Hi", "temperature": "hot"}',
    b'{"prompt": "Hi", "top_p": 2}',
    b'{"prompt": "Hi", "top_k": -1}',
    b'{"prompt": "Hi", "stream": 1}',
    b'{"prompt": "Hi",',
    b'["Hi"]',
    b'{"prompt": "\\ud800"}',
    b'{"prompt": "\\u001d"}',
])
def test_generate_failure(http, body):
    r = http.post("/generate", content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, generate=True, type_="invalid_request_error")


def test_generate_failure_when_streaming(http):
    r = http.post("/generate", json={"prompt": "Hi", "stream": True, "max_tokens": -1})
    assert_error(r, 400, generate=True)


# ---- SSE framing, raw bytes ----

@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": CHAT}),
])
def test_sse_framing(http, path, body):
    body = {**body, "max_tokens": 5, "ignore_eos": True, "stream": True}
    response, raw = post_stream(http, path, body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(raw)
    assert events and all("usage" not in e or e["usage"] is None for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"

    response, raw = post_stream(http, path, {**body, "stream_options": {"include_usage": True}})
    assert response.status_code == 200
    events = sse_payloads(raw)
    usage = events[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(not e.get("usage") for e in events[:-1])


# ---- errors ----

BAD_REQUESTS = [
    ("/v1/completions", b'{"prompt": "Hi",'),
    ("/v1/completions", b""),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'{"prompt": "\xff"}'),
    ("/v1/completions", b'{"prompt": "Hi \\ud800"}'),
    ("/v1/completions", b'{"prompt": "\\u001d"}'),  # text of no tokens
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udc00"}]}'),
    ("/tokenize", b'{"content": "\\ud800"}'),
    ("/v1/completions", b'{"prompt": "Hi", "temperature": NaN}'),
    ("/v1/completions", b'{"prompt": 5}'),
    ("/v1/completions", b'{"prompt": [1000000000]}'),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": "10"}'),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": true}'),
    ("/v1/completions", b'{"prompt": "Hi", "max_tokens": 0}'),
    ("/v1/completions", b'{"prompt": "Hi", "temperature": -1}'),
    ("/v1/completions", b'{"prompt": "Hi", "top_p": 1.5}'),
    ("/v1/completions", b'{"prompt": "Hi", "n": 0}'),
    ("/v1/completions", b'{"prompt": "Hi", "n": 1000}'),
    ("/v1/completions", b'{"prompt": "Hi", "logprobs": 100}'),
    ("/v1/completions", b'{"prompt": "Hi", "stream": "yes"}'),
    ("/v1/completions", b'{"prompt": "Hi", "stop": 5}'),
    ("/v1/completions", b'{"prompt": "Hi", "seed": "x"}'),
    ("/v1/chat/completions", b'{"messages": '),
    ("/v1/chat/completions", b'{"messages": "Hi"}'),
    ("/v1/chat/completions", b'{"messages": []}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "Hi"}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], '
                             b'"max_tokens": -1}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], '
                             b'"top_logprobs": 2}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], '
                             b'"stream": true, "temperature": 1000}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], '
                             b'"response_format": {"type": "json_ob"}}'),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "Hi"}], '
                             b'"tools": [{"type": "function", "function": {"name": "f f"}}]}'),
    ("/v1/completions", b'{"prompt": "Hi", "logit_bias": {"1": 100}}'),
    ("/tokenize", b'{"content": 5}'),
    ("/tokenize", b"{}"),
    ("/detokenize", b'{"tokens": "Hi"}'),
    ("/detokenize", b'{"tokens": [-1]}'),
    ("/detokenize", b'{"tokens": [1000000000]}'),
]


@pytest.mark.parametrize("path,body", BAD_REQUESTS)
def test_bad_request(http, path, body):
    r = http.post(path, content=body, headers={"content-type": "application/json"})
    assert_error(r, 400, type_="invalid_request_error")


def test_internal_errors_do_not_leak_their_details(caplog):
    """A fault's details (paths, values) go to the log, not to the client."""
    async def faulty(request, state):
        raise RuntimeError("secret detail in /home/someone/model.gguf")

    app = Starlette(routes=[Route("/faulty", guarded(faulty), methods=["GET"])])
    app.state.cllm = AppState(ServerConfig(), [ModelSource(MODEL, MODEL, MODEL)], None)
    with TestClient(app) as test_client:
        r = test_client.get("/faulty")
    assert_error(r, 500, type_="server_error", code="internal_error")
    assert "secret" not in r.text and "RuntimeError" not in r.text
    assert "secret detail" in caplog.text


@pytest.mark.parametrize("method,path,status", [
    ("GET", "/nowhere", 404), ("POST", "/v1/nowhere", 404), ("GET", "/v1/completions", 405),
    ("POST", "/health", 405),
])
def test_unknown_route(http, method, path, status):
    assert_error(http.request(method, path), status)


def test_prompt_longer_than_the_context(limits):
    long_text = "hello " * 300  # about 300 tokens; the context holds 256
    with limits.http_client(60) as http:
        for path, body, generate in [
            ("/v1/completions", {"prompt": long_text, "max_tokens": 1}, False),
            ("/v1/completions", {"prompt": [1] * 300, "max_tokens": 1, "stream": True}, False),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}],
                                      "max_tokens": 1}, False),
            ("/generate", {"prompt": long_text, "max_tokens": 1}, True),
        ]:
            error = assert_error(http.post(path, json=body), 400, generate=generate)
            assert error["code"] == "context_length_exceeded", error
        # max_tokens past the context is clamped to it: the reply ends where the context fills
        for path, body in [("/v1/completions", {"prompt": "Hi"}),
                           ("/v1/chat/completions", {"messages": CHAT})]:
            r = http.post(path, json={**body, "max_tokens": 4096, "ignore_eos": True})
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            assert r.json()["choices"][0]["finish_reason"] == "length"
            assert usage["prompt_tokens"] + usage["completion_tokens"] == 256
        # the same server still answers a prompt that fits
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_body_too_large(limits):
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()
    with limits.http_client(60) as http:
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
            assert_error(http.post(path, content=big), 413)
        assert_error(http.post("/generate", content=big), 413, generate=True)
        # Without a Content-Length (chunked), the limit holds while reading.
        chunks = iter([big[i:i + 1000] for i in range(0, len(big), 1000)])
        assert_error(http.post("/v1/completions", content=chunks), 413)
        # Just under the limit is fine.
        body = json.dumps({"content": "x" * 3900}).encode()
        assert len(body) < 4096
        r = http.post("/tokenize", content=body)
        assert r.status_code == 200 and r.json()["tokens"]


def test_request_timeout():
    body = {"prompt": "Hi", "max_tokens": 1000, "ignore_eos": True}
    with ServerProcess("--request-timeout", "0.5") as srv, \
            srv.http_client(60) as http:
        assert_error(http.post("/v1/completions", json=body), 408, code="request_timeout")
        assert_error(http.post("/generate", json=body), 408, generate=True,
                     code="request_timeout")
        # Streamed: 408 if the deadline passes before the first token, else an error event.
        response, raw = post_stream(http, "/v1/chat/completions",
                                    {**body, "messages": CHAT, "stream": True})
        if response.status_code == 200:
            events = sse_payloads(raw)
            assert events[-1]["error"]["code"] == "request_timeout", events[-1]
            assert all("error" not in e for e in events[:-1])
        else:
            assert response.status_code == 408
            assert json.loads(raw)["error"]["code"] == "request_timeout"
        assert metrics(http)['cllm_request_failure_total{code="408"}'] == 3  # each once


def test_api_key():
    with ServerProcess("--api-key", "s3cret") as srv, \
            srv.http_client(60) as http:
        routes = [
            ("GET", "/v1/models", None), ("GET", "/metrics", None),
            ("POST", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
            ("POST", "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
            ("POST", "/generate", {"prompt": "Hi", "max_tokens": 1}),
            ("POST", "/tokenize", {"content": "Hi"}),
            ("POST", "/detokenize", {"tokens": [1]}),
        ]
        for method, path, body in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                            {"Authorization": "Bearer s3cret2"},
                            {"Authorization": "Bearer S3CRET"}, {"X-Api-Key": "s3cret"}):
                r = http.request(method, path, json=body, headers=headers)
                assert_error(r, 401, generate=path == "/generate",
                             type_="authentication_error")
                assert r.headers.get("www-authenticate") == "Bearer"
            r = http.request(method, path, json=body, headers={"Authorization": "Bearer s3cret"})
            assert r.status_code == 200, (path, r.text)
        assert_error(http.get("/nowhere"), 401)  # routes that do not exist are refused too
        assert http.get("/health").status_code == 200  # no key needed
        with srv.openai_client(api_key="wrong") as bad:
            with pytest.raises(openai.AuthenticationError):
                bad.models.list()
        with srv.openai_client(api_key="s3cret") as good:
            assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices


def test_foreign_host_header_is_refused_without_an_api_key(server, http):
    """DNS rebinding: a web page's own name, resolved to 127.0.0.1, reaches the server with
    that name as Host. Without an API key only loopback names and the bound address pass."""
    for host in ("evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhostx"):
        assert_error(http.get("/v1/models", headers={"Host": host}), 400, code="invalid_host")
    r = http.post("/generate", json={"prompt": "Hi"}, headers={"Host": "evil.example"})
    assert_error(r, 400, generate=True, code="invalid_host")
    for host in (f"127.0.0.1:{server.port}", f"localhost:{server.port}", "LOCALHOST",
                 f"[::1]:{server.port}"):
        assert http.get("/v1/models", headers={"Host": host}).status_code == 200, host


def test_queue_full_is_429_with_retry_after():
    """One sequence at a time and one waiting: with one running and one queued, the next
    request is refused at once."""
    with ServerProcess("--parallel", "1", "--max-queue", "1") as srv, \
            srv.http_client(120) as http:
        long_body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
        with http.stream("POST", "/v1/completions", json={**long_body, "stream": True}) as holder:
            assert holder.status_code == 200
            events = holder.iter_raw()  # kept: a collected iterator closes the connection
            next(events)  # it runs
            queued: dict = {}
            waiter = threading.Thread(target=lambda: queued.update(r=httpx.post(
                srv.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3,
                                                   "ignore_eos": True}, timeout=120)))
            waiter.start()
            assert wait_for_metric(srv.url, "cllm_requests_waiting", lambda v: v == 1) == 1
            for path, body, generate in [
                ("/v1/completions", {"prompt": "Hi", "max_tokens": 3}, False),
                ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True}, False),
                ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 3}, False),
                ("/generate", {"prompt": "Hi", "max_tokens": 3}, True),
            ]:
                r = http.post(path, json=body)
                assert_error(r, 429, generate=generate, code="server_overloaded")
                assert int(r.headers["retry-after"]) >= 1
        # The holder is gone: the queued request runs and succeeds.
        waiter.join(60)
        assert queued["r"].status_code == 200, queued["r"].text
        assert queued["r"].json()["usage"]["completion_tokens"] == 3
        assert metrics(http)['cllm_request_failure_total{code="429"}'] == 4


def test_slow_clients_are_cut_off():
    """Connections that stall mid-headers or mid-body are closed after --client-timeout; the
    server answers others meanwhile."""
    n = min(500, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2 - 50)
    with ServerProcess("--client-timeout", "1") as srv:
        stalled = []
        try:
            for _ in range(n):
                stalled.append(socket.create_connection(("127.0.0.1", srv.port)))
                stalled[-1].sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConte")
            body = socket.create_connection(("127.0.0.1", srv.port))
            stalled.append(body)
            body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            assert httpx.get(srv.url + "/health", timeout=10).status_code == 200
            for sock in stalled[:-1]:
                assert read_until_closed(sock, timeout=30) == b""
            reply = read_until_closed(body, timeout=30)
            assert reply.startswith(b"HTTP/1.1 408 "), reply
            assert b'"code":"body_timeout"' in reply
        finally:
            for sock in stalled:
                sock.close()
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200


def test_headers_without_end_are_refused_and_the_server_goes_on(server):
    """A request whose headers keep coming is refused with a 431 once more than
    launch.MAX_HEADER_BYTES of them wait incomplete, so no client grows the server's buffer
    without bound; a request under the cap is served."""
    reply = b""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        try:
            for i in range(64):  # 64 KiB, a line at a time: each arrives in a read of its own
                sock.sendall(b"X-Pad-%02d: %s\r\n" % (i, b"a" * 1012))
                time.sleep(0.01)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the client was done
        try:
            reply = read_until_closed(sock, timeout=30)
        except ConnectionResetError:
            pass
    assert reply.startswith(b"HTTP/1.1 431 "), reply[:200]
    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # under the cap
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"c" * 15_000
                     + b"\r\nConnection: close\r\n\r\n")
        assert read_until_closed(sock, timeout=30).startswith(b"HTTP/1.1 200 ")


def test_headers_over_the_cap_in_one_write_are_a_431_and_the_server_goes_on(server):
    """Headers past launch.MAX_HEADER_BYTES that arrive whole, in one read, are refused as
    those that keep coming are (h11 bounds only incomplete ones)."""
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 20_000
                     + b"\r\n\r\n")
        reply = read_until_closed(sock, timeout=30)
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 431 "), reply[:200]
    assert json.loads(body)["error"]["code"] == "headers_too_large"
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_pipelined_requests_on_one_connection_are_all_answered(server):
    """Requests sent back to back on one connection are answered in order; the headers'
    deadline does not cut the ones queued behind a running request."""
    request = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(request * 2 + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                   b"Connection: close\r\n\r\n")
        replies = read_until_closed(sock, timeout=30)
    assert replies.count(b"HTTP/1.1 200 ") == 3, replies[:500]
    assert replies.count(b'"object":"list"') == 2


# ---- health, loading, shutdown ----

def test_health_is_200_only_when_a_completion_succeeds():
    srv = ServerProcess().spawn()
    try:
        deadline, health = time.monotonic() + 120, None
        with srv.http_client(60) as http:
            while time.monotonic() < deadline:
                assert srv.proc.poll() is None, srv.log
                try:
                    health = http.get("/health")
                except httpx.TransportError:
                    time.sleep(0.02)
                    continue
                if health.status_code == 200:
                    break
                assert_error(health, 503, code="model_not_ready")
                # Still loading, unless it finished in between.
                r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
                if r.status_code != 200:
                    assert_error(r, 503, code="model_not_ready")
                r = http.post("/generate", json={"prompt": "Hi", "max_tokens": 1})
                if r.status_code != 200:
                    assert_error(r, 503, generate=True, code="model_not_ready")
            assert health is not None and health.status_code == 200, srv.log
            assert health.json() == {"status": "ok"}
            r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        # An idle server stops at once, and cleanly.
        assert srv.stop(timeout=30) == 0, srv.log
        assert "Traceback" not in srv.log
    finally:
        srv.kill()


def _request_in_thread(url: str, path: str, body: dict, results: dict, key) -> threading.Thread:
    def run():
        try:
            with httpx.Client(timeout=120) as http:
                with http.stream("POST", url + path, json=body) as r:
                    results[key] = (r.status_code, r.headers.get("content-type", ""), r.read())
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion
            results[key] = ("exception", "", repr(exc).encode())
    thread = threading.Thread(target=run)
    thread.start()
    return thread


SHUTDOWN_LOAD = [
    ("/v1/completions", {"prompt": PROMPT, "stream": True}),
    ("/v1/chat/completions", {"messages": CHAT, "stream": True}),
    ("/generate", {"prompt": PROMPT, "stream": True}),
    ("/v1/completions", {"prompt": PROMPT}),
    ("/v1/chat/completions", {"messages": CHAT}),
    ("/generate", {"prompt": PROMPT}),
]


def _start_load(srv: ServerProcess, max_tokens: int) -> tuple[dict, list[threading.Thread]]:
    results: dict = {}
    threads = [_request_in_thread(srv.url, path, {**body, "max_tokens": max_tokens,
                                                  "ignore_eos": True}, results, i)
               for i, (path, body) in enumerate(SHUTDOWN_LOAD)]
    # All of them arrived: running, or (on a fast machine) already done.
    deadline = time.monotonic() + 60
    while True:
        m = metrics(srv.url)
        arrived = m["cllm_requests_running"] + sum(
            v for k, v in m.items() if k.startswith("cllm_request_success_total{"))
        if arrived == len(SHUTDOWN_LOAD):
            return results, threads
        assert time.monotonic() < deadline, srv.log
        time.sleep(0.05)


def test_sigterm_lets_in_flight_requests_finish():
    with ServerProcess("--shutdown-grace", "60") as srv:
        results, threads = _start_load(srv, max_tokens=40)
        srv.terminate()
        rc = srv.wait(timeout=60)
        for t in threads:
            t.join(60)
        assert rc == 0, srv.log
        for i, (path, body) in enumerate(SHUTDOWN_LOAD):
            status, content_type, raw = results[i]
            assert status == 200, (path, status, raw[-300:])
            if body.get("stream"):
                events = sse_payloads(raw)
                last = events[-1]
                if path == "/generate":
                    assert last["data"]["generated_tokens"] == 40
                    assert last["data"]["finish_reason"] == "length"
                else:
                    assert last["choices"][0]["finish_reason"] == "length"
            else:
                out = json.loads(raw)
                if path == "/generate":
                    assert out["data"]["generated_tokens"] == 40
                else:
                    assert out["usage"]["completion_tokens"] == 40
        assert "Traceback" not in srv.log


def test_sigterm_past_the_grace_period_ends_requests_with_503():
    with ServerProcess("--shutdown-grace", "1") as srv:
        results, threads = _start_load(srv, max_tokens=LONG)
        started = time.monotonic()
        srv.terminate()
        rc = srv.wait(timeout=30)
        elapsed = time.monotonic() - started
        for t in threads:
            t.join(60)
        assert rc == 0, srv.log
        assert elapsed < 10, srv.log  # the grace period (1 s) and the 503s, not 1500 tokens
        for i, (path, body) in enumerate(SHUTDOWN_LOAD):
            status, content_type, raw = results[i]
            generate = path == "/generate"
            if body.get("stream"):
                # The 200 and the first tokens went out before SIGTERM: the error is an event.
                assert status == 200, (path, status, raw[-300:])
                events = sse_payloads(raw)
                last = events[-1]
                assert last["error"]["code"] == "shutting_down", last
                assert ("success" in last and last["success"] is False) == generate
            else:
                assert status == 503, (path, status, raw[-300:])
                response = httpx.Response(status, headers={"content-type": content_type},
                                          content=raw)
                assert_error(response, 503, generate=generate, code="shutting_down")
        assert "Traceback" not in srv.log


# ---- clients that leave, and many at once ----

async def _drop_mid_stream(url: str, i: int) -> int:
    path, body = [("/v1/completions", {"prompt": PROMPT}),
                  ("/v1/chat/completions", {"messages": CHAT}),
                  ("/generate", {"prompt": PROMPT})][i % 3]
    body = {**body, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        async with http.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            seen = b""
            async for chunk in r.aiter_raw():
                seen += chunk
                if seen.count(b"\n\n") >= 2:
                    break  # leave: the connection closes with the response unread
    return seen.count(b"data: ")


async def _give_up_waiting(url: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url, timeout=0.5) as http:
        with pytest.raises(httpx.ReadTimeout):
            await http.post("/v1/completions", json=body)


def test_clients_dropping_mid_stream_free_everything(server, http):
    aborted = 'cllm_request_success_total{finish_reason="abort"}'
    before = metrics(http).get(aborted, 0)

    async def main():
        drops = [_drop_mid_stream(server.url, i) for i in range(50)]
        gone = [_give_up_waiting(server.url) for _ in range(4)]
        return await asyncio.gather(*drops, *gone)

    seen = asyncio.run(main())
    assert all(n >= 2 for n in seen[:50])
    idle = lambda v: v == 0  # noqa: E731
    assert wait_for_metric(server.url, "cllm_requests_running", idle, timeout=10) == 0
    assert wait_for_metric(server.url, "cllm_requests_waiting", idle, timeout=10) == 0
    assert wait_for_metric(server.url, "cllm_kv_cache_usage_ratio", idle, timeout=10) == 0
    assert wait_for_metric(server.url, aborted, lambda v: v - before >= 54) - before == 54
    for _ in range(3):
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4,
                                               "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_72_streams_at_concurrency_32(server, http):
    async def one(client: httpx.AsyncClient, gate: asyncio.Semaphore, i: int):
        path, body = [("/v1/completions", {"prompt": f"{PROMPT} {i}"}),
                      ("/v1/chat/completions", {"messages": CHAT})][i % 2]
        body = {**body, "max_tokens": 16, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        async with gate, client.stream("POST", path, json=body) as r:
            return path, r.status_code, await r.aread()

    async def main():
        gate = asyncio.Semaphore(32)
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=32)) as client:
            return await asyncio.gather(*(one(client, gate, i) for i in range(72)))

    results = asyncio.run(main())
    assert len(results) == 72
    for path, status, raw in results:
        assert status == 200, raw[-300:]
        events = sse_payloads(raw)
        assert events[-1]["usage"]["completion_tokens"] == 16
        choices = [c for e in events[:-1] for c in e["choices"]]
        text_key = "text" if path == "/v1/completions" else "content"
        text = "".join((c.get("delta", c).get(text_key) or "") for c in choices)
        assert text, raw
        assert choices[-1]["finish_reason"] == "length"
    assert wait_for_metric(server.url, "cllm_requests_running", lambda v: v == 0) == 0


# ---- models, tokenize, metrics ----

def test_models(http, client):
    r = http.get("/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list"
    (model,) = body["data"]
    assert model["id"] == MODEL and model["object"] == "model"
    assert model["meta"]["n_ctx"] >= 256 and model["meta"]["n_vocab"] > 1000
    assert [m.id for m in client.models.list()] == [MODEL]


def test_tokenize_detokenize_round_trip(http):
    text = "Hello, world! Ünïcödé 你好 🙂 <|im_start|>"
    r = http.post("/tokenize", json={"content": text})
    assert r.status_code == 200
    tokens = r.json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    r = http.post("/detokenize", json={"tokens": tokens})
    assert r.status_code == 200 and r.json() == {"content": text}
    # The special token is one token, parsed as such.
    special = http.post("/tokenize", json={"content": "<|im_start|>"}).json()["tokens"]
    assert len(special) == 1
    assert http.post("/detokenize", json={"tokens": []}).json() == {"content": ""}


def test_heavy_requests_do_not_stall_streams(server):
    """Tokenizing megabytes and detokenizing a million ids take seconds: other requests' tokens
    keep flowing meanwhile."""
    text = "The sea, the sea. " * (3_900_000 // 18)  # under the 4 MiB body limit
    heavy = [("/tokenize", {"content": text}), ("/tokenize", {"content": text}),
             ("/v1/completions", {"prompt": text, "max_tokens": 1}),
             ("/v1/completions", {"prompt": text, "max_tokens": 1}),
             ("/detokenize", {"tokens": [9] * 1_000_000})]  # 3 bytes an id
    results: dict = {}
    with StreamGaps(server.url) as gaps:
        threads = [_request_in_thread(server.url, path, body, results, i)
                   for i, (path, body) in enumerate(heavy)]
        for t in threads:
            t.join(120)
        assert gaps.largest() < 2.0
    statuses = [results[i][0] for i in range(len(heavy))]
    assert statuses == [200, 200, 400, 400, 200], statuses  # the prompts overflow the context


METRIC_NAMES = [
    "cllm_requests_running", "cllm_requests_waiting", "cllm_kv_cache_usage_ratio",
    "cllm_prompt_tokens_total", "cllm_generation_tokens_total", "cllm_preemptions_total",
    'cllm_request_success_total{finish_reason="length"}',
    'cllm_request_failure_total{code="400"}',
    *(f"{h}{suffix}" for h in ("cllm_inter_token_latency_seconds",
                               "cllm_e2e_request_latency_seconds")
      for suffix in ("_count", "_sum", '_bucket{le="+Inf"}')),
    *(f"{h}{suffix}" for h in ("cllm_time_to_first_token_seconds",
                               "cllm_request_queue_time_seconds")
      for suffix in ('_count{priority="0"}', '_sum{priority="0"}',
                     '_bucket{le="+Inf",priority="0"}')),
    'cllm_user_tokens_total{user="none"}',
]


def test_metrics(http):
    before = metrics(http)
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    assert_error(http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0}), 400)
    response = http.get("/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    after = metrics(http)
    missing = [name for name in METRIC_NAMES if name not in after]
    assert not missing, missing

    def grew(name):
        return after[name] - before.get(name, 0)

    assert grew("cllm_generation_tokens_total") == 5
    assert grew("cllm_prompt_tokens_total") == n_tokens(http, PROMPT)
    assert grew('cllm_request_success_total{finish_reason="length"}') == 1
    assert grew('cllm_request_failure_total{code="400"}') == 1
    for h in ("cllm_inter_token_latency_seconds", "cllm_e2e_request_latency_seconds"):
        assert grew(h + "_count") == 1
    for h in ("cllm_time_to_first_token_seconds", "cllm_request_queue_time_seconds"):
        assert grew(h + '_count{priority="0"}') == 1
    assert grew('cllm_user_tokens_total{user="none"}') == n_tokens(http, PROMPT) + 5
    assert after["cllm_requests_running"] == 0 and after["cllm_requests_waiting"] == 0
    assert 0 <= after["cllm_kv_cache_usage_ratio"] <= 1


def test_metrics_say_where_the_engine_threads_time_went(http):
    """The step timer over /metrics, as the benchmark reads it for a server it measures."""
    def counts():
        return step_timer_counts(http.get("/metrics").text)

    before = counts()
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    steps = steptimer.summarize(steptimer.since(counts(), before))
    # the prompt's step, then four decode steps: a call each, or fewer calls of decode runs
    assert steps["steps"] * steps["forward_steps_per_step"] >= 5
    assert steps["forward_steps_per_step"] >= 1 and steps["rows_per_step"] >= 1
    phases = {"inbox", "schedule", "prepare", "decode", "postprocess", "handoff", "successors"}
    timed = {key for key in steps if key.endswith("_ms")}
    # kv_tiers: the prefix cache's RAM tier, there once it has saved or loaded a prefix
    assert {f"{p}_ms" for p in phases} <= timed <= {f"{p}_ms" for p in phases | {"kv_tiers"}}
    assert steps["decode_ms"] > 0


# ---- the prefix cache over HTTP ----

@pytest.fixture(scope="module")
def fresh():
    """A server of its own for the prefix cache's tests. In one pool (a GPU's default), idle
    prompts stay cached only while enough recent requests reused such prompts
    (docs/design/prefix-cache.md), and this module's other tests send many one-shot
    prompts: after them, the same server would rightly drop a new prompt when it ends."""
    with ServerProcess() as srv:
        yield srv


@pytest.fixture(scope="module")
def fresh_http(fresh):
    with fresh.http_client() as client:
        yield client


@pytest.fixture(scope="module")
def fresh_client(fresh):
    with fresh.openai_client() as client:
        yield client


def test_usage_reports_cached_prompt_tokens(fresh_client, fresh_http):
    """A second request with the same long prefix reports it cached, streamed or whole;
    cache_prompt=false computes it all again."""
    prefix = "The lighthouse keeper's log, winter of 1901. " * 30
    first = fresh_http.post("/v1/completions",
                            json={"prompt": prefix + "Entry one:", "max_tokens": 4})
    assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # The prefix, less what the layout recomputes: on a CPU, prompts are reused in whole blocks
    # of 64 tokens (docs/design/batch-invariance.md).
    n_prefix = n_tokens(fresh_http, prefix) - 64
    whole = fresh_client.completions.create(model=MODEL, prompt=prefix + "Entry two:",
                                            max_tokens=4)
    assert whole.usage.prompt_tokens_details.cached_tokens >= n_prefix
    _, body = post_stream(fresh_http, "/v1/completions", {
        "prompt": prefix + "Entry three:", "max_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}})
    usage = sse_payloads(body)[-1]["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= n_prefix
    off = fresh_http.post("/v1/completions", json={"prompt": prefix + "Entry two:",
                                                   "max_tokens": 4, "cache_prompt": False})
    assert off.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    error = assert_error(fresh_http.post("/v1/completions",
                                         json={"prompt": "x", "cache_prompt": "no"}), 400)
    assert "cache_prompt" in error["message"]


def test_the_next_chat_turn_starts_from_the_last_one(fresh_client):
    messages = [{"role": "system", "content": "You answer in one short sentence. " * 10},
                {"role": "user", "content": "Name a colour."}]
    turn1 = fresh_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                 temperature=0)
    messages += [{"role": "assistant", "content": turn1.choices[0].message.content},
                 {"role": "user", "content": "And another one?"}]
    turn2 = fresh_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                 temperature=0)
    assert turn2.usage.prompt_tokens_details.cached_tokens >= turn1.usage.prompt_tokens - 64


def test_metrics_count_prefix_cache_lookups_and_hits(fresh_http):
    before = metrics(fresh_http)
    prompt = "A ledger of ships that passed the cape, one per line. " * 20
    for _ in range(2):
        r = fresh_http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 200
    after = metrics(fresh_http)
    looked_up = (after["cllm_prefix_cache_queries_total"]
                 - before.get("cllm_prefix_cache_queries_total", 0))
    found = after["cllm_prefix_cache_hits_total"] - before.get("cllm_prefix_cache_hits_total", 0)
    assert looked_up == 2 * n_tokens(fresh_http, prompt)
    assert found >= n_tokens(fresh_http, prompt) - 64
    assert after["cllm_prefix_cache_cells"] > 0


def test_a_failed_engine_turns_every_route_and_health_to_503():
    from types import SimpleNamespace

    from cllm.config import ServerConfig
    from cllm.errors import APIError
    from cllm.http.registry import ModelRegistry

    models = ModelRegistry(ServerConfig(), [ModelSource(MODEL, MODEL, MODEL)], None, Metrics())
    model = models.default
    model.engine = SimpleNamespace(failure="the engine failed: RuntimeError: injected")
    with pytest.raises(APIError) as raised:
        model.require_engine()  # what every model route calls first
    assert raised.value.status == 503 and raised.value.code == "engine_failed"
    with pytest.raises(APIError) as raised:
        model.check_health()  # and /health
    assert raised.value.status == 503 and raised.value.code == "engine_failed"
    assert "injected" in raised.value.message
