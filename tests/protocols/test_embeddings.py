"""/v1/embeddings: request parsing without a model, then the real server through the openai SDK
(which asks for base64 unless told otherwise) and raw HTTP."""
from __future__ import annotations

import json
import math
import socket

import httpx
import openai
import pytest
from http_checks import assert_error, read_until_closed, wait_for_metric
from server_process import ServerProcess

from cllm.engine.embedder import pooling_of
from cllm.errors import APIError
from cllm.protocols.embeddings import MAX_INPUTS, MAX_TOKENS, parse_embeddings

MODEL = "smollm2-135m-instruct"


# ---- parsing ----

@pytest.mark.parametrize("value, expected", [
    ("hello", ["hello"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]),
    ([[1, 2], [3]], [[1, 2], [3]]),
])
def test_input_forms(value, expected):
    req = parse_embeddings({"input": value})
    assert req.inputs == expected and req.base64 is False
    assert parse_embeddings({"input": value, "encoding_format": "base64"}).base64 is True


@pytest.mark.parametrize("body, param", [
    ({}, "input"), ({"input": ""}, "input"), ({"input": []}, "input"),
    ({"input": ["ok", ""]}, "input"), ({"input": [[1], []]}, "input"),
    ({"input": [1, "a"]}, "input"), ({"input": [-1]}, "input"), ({"input": {"a": 1}}, "input"),
    ({"input": ["x"] * (MAX_INPUTS + 1)}, "input"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "x", "dimensions": 5}, "dimensions"),  # would change the output
])
def test_bad_input_is_a_400_naming_the_field(body, param):
    with pytest.raises(APIError) as info:
        parse_embeddings(body)
    assert info.value.status == 400 and info.value.param == param


def test_pooling_comes_from_the_gguf_else_mean():
    assert pooling_of({"general.architecture": "bert", "bert.pooling_type": "2"}) == "cls"
    assert pooling_of({"general.architecture": "qwen3", "qwen3.pooling_type": "3"}) == "last"
    assert pooling_of({"general.architecture": "llama", "llama.pooling_type": "0"}) == "mean"
    assert pooling_of({"general.architecture": "llama"}) == "mean"


# ---- the server ----

@pytest.fixture(scope="module")
def server():
    with ServerProcess("--parallel", "2") as srv:
        yield srv


def cosine(a: list[float], b: list[float]) -> float:
    return sum(x * y for x, y in zip(a, b)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b))


def test_same_text_gives_the_same_unit_vector(client):
    text = "The quick brown fox jumps over the lazy dog."
    first = client.embeddings.create(model=MODEL, input=text)
    again = client.embeddings.create(model=MODEL, input=text, encoding_format="float")
    batched = client.embeddings.create(model=MODEL, input=["Something else entirely.", text])
    (a,), (b,) = first.data, again.data
    assert a.index == 0 and a.object == "embedding" and first.model == MODEL
    assert len(a.embedding) == 576  # SmolLM2-135M's hidden size
    assert math.isclose(math.sqrt(sum(x * x for x in a.embedding)), 1.0, rel_tol=1e-5)
    assert a.embedding == pytest.approx(b.embedding, abs=1e-6)  # base64 and float agree
    assert [d.index for d in batched.data] == [0, 1]
    assert cosine(batched.data[1].embedding, a.embedding) > 0.9999


def test_related_texts_are_closer_than_unrelated(client):
    texts = ["The cat sat on the mat.", "A cat was sitting on the mat.",
             "Quarterly revenue rose eight percent on strong bond trading."]
    cat, cat2, revenue = (d.embedding for d in
                          client.embeddings.create(model=MODEL, input=texts).data)
    assert cosine(cat, cat2) > cosine(cat, revenue)
    assert cosine(cat, cat2) > cosine(cat2, revenue)


def test_usage_counts_the_input_tokens(client, server):
    tokens = httpx.post(server.url + "/tokenize",
                        json={"content": "Hello there", "add_special": True}).json()["tokens"]
    r = client.embeddings.create(model=MODEL, input=["Hello there", tokens])
    assert r.usage.prompt_tokens == r.usage.total_tokens == 2 * len(tokens)
    assert cosine(r.data[0].embedding, r.data[1].embedding) > 0.9999  # text and its ids agree


def test_bad_requests_get_openai_shaped_400s(server, client):
    url = server.url + "/v1/embeddings"
    assert_error(httpx.post(url, json={"input": ""}), 400)
    assert_error(httpx.post(url, json={"input": [10 ** 9]}), 400)
    too_long = httpx.post(url, json={"input": [1] * 3000})
    assert_error(too_long, 400, code="context_length_exceeded")
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input=[])


# ---- long requests ----

RUNNING = "cllm_embedding_requests_running"
# A hundred and twenty-eight decodes of 16 inputs: minutes of work on a CPU, a second or two
# a decode, which is as long as another request may wait for its turn.
LARGE = {"input": [[1] * 16] * MAX_INPUTS}


def send_unread(srv: ServerProcess, body: dict) -> socket.socket:
    """POST `body` to /v1/embeddings on a connection of its own, its response unread: closing
    the socket is the client leaving."""
    data = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", srv.port))
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(data)
                 + data)
    return sock


def test_a_request_over_the_token_limit_is_a_400(server):
    r = httpx.post(server.url + "/v1/embeddings", json={"input": [[1] * 300] * 1001}, timeout=60)
    error = assert_error(r, 400)
    assert error["param"] == "input" and str(MAX_TOKENS) in error["message"]


def test_a_small_request_goes_between_a_large_ones_decodes_and_a_client_leaving_stops_it(
        server):
    large = send_unread(server, LARGE)
    try:
        assert wait_for_metric(server.url, RUNNING, lambda n: n == 1, timeout=60) == 1
        small = httpx.post(server.url + "/v1/embeddings", json={"input": "Hello"}, timeout=60)
        assert small.status_code == 200 and len(small.json()["data"]) == 1
        assert wait_for_metric(server.url, RUNNING, lambda n: True) == 1  # the large one goes on
    finally:
        large.close()
    assert wait_for_metric(server.url, RUNNING, lambda n: n == 0, timeout=60) == 0


def test_sigterm_past_the_grace_period_stops_an_embedding_request_with_a_503():
    with ServerProcess("--shutdown-grace", "1") as srv:
        with send_unread(srv, LARGE) as large:
            assert wait_for_metric(srv.url, RUNNING, lambda n: n == 1, timeout=60) == 1
            srv.terminate()
            assert srv.wait(timeout=60) == 0, srv.log
            reply = read_until_closed(large, timeout=30)
        assert reply.startswith(b"HTTP/1.1 503 "), reply[:300]
        assert b'"shutting_down"' in reply
        assert "Traceback" not in srv.log


def test_the_request_timeout_ends_an_embedding_request_with_generations_408():
    with ServerProcess("--request-timeout", "2") as srv:
        r = httpx.post(srv.url + "/v1/embeddings", json=LARGE, timeout=60)
        error = assert_error(r, 408, type_="timeout", code="request_timeout")
        assert "2 s" in error["message"]
        assert wait_for_metric(srv.url, RUNNING, lambda n: n == 0, timeout=60) == 0
        small = httpx.post(srv.url + "/v1/embeddings", json={"input": "Hello"}, timeout=60)
        assert small.status_code == 200 and len(small.json()["data"]) == 1
        assert "Traceback" not in srv.log
