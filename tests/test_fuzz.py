"""Property-based fuzzing of the HTTP API (hypothesis) against one real server process.

Random JSON bodies shaped like each endpoint's (known fields with values of any type, unknown
fields, nesting), and random bytes, to every POST route. Properties: never a 5xx, never a hang
(a per-request timeout), a 4xx always has a JSON error body of the route's shape, and a 200 is
a well-formed response (JSON, or SSE ending in [DONE]). max_tokens is always sent and valid
values of it stay at 1-3, so bodies that happen to be valid generate little."""
from __future__ import annotations

import collections
import json

import httpx
import pytest
from http_checks import assert_error, sse_payloads
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_process import ServerProcess

STATUSES: collections.Counter = collections.Counter()  # (path, status): count, printed at the end
TIMEOUT = 30.0  # seconds: a request that takes longer is a hang
SETTINGS = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
    st.integers(min_value=-3, max_value=50_000),  # plausible token ids and counts
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
# Valid max_tokens are small; anything else is refused. null would mean "the default", which
# for chat is the whole context, so it is never sent.
max_tokens = st.integers(min_value=0, max_value=9).flatmap(lambda i: st.one_of(
    st.integers(max_value=0), st.integers(min_value=10**6), st.text(max_size=5), st.floats(),
    st.booleans(), st.lists(st.integers(), max_size=2)) if i == 9 else st.integers(1, 3))
# Text now and then with lone surrogates: JSON can escape them, UTF-8 cannot encode them, so the
# server must refuse them (400) before they reach the tokenizer.
with_surrogates = st.text(st.one_of(st.characters(), st.characters(categories=["Cs"])),
                          min_size=1, max_size=60)
texts = st.integers(min_value=0, max_value=9).flatmap(
    lambda i: with_surrogates if i == 9 else st.text(max_size=60))


def mostly(*valid):
    """Usually a valid value, one time in ten anything at all: with a dozen optional fields,
    an even mix would almost never let a body through to the model."""
    valid = st.one_of(*valid)
    return st.integers(min_value=0, max_value=9).flatmap(lambda i: json_values if i == 9 else valid)



token_ids = st.lists(st.integers(min_value=-2, max_value=60_000), min_size=0, max_size=12)
messages = st.lists(st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["system", "user", "assistant", "developer", "tool"])),
     "content": mostly(texts, st.lists(st.fixed_dictionaries(
         {"type": st.sampled_from(["text"] * 4 + ["image_url"]), "text": texts})))}),
    min_size=1, max_size=3)
sampling = {
    "temperature": mostly(st.floats(min_value=0, max_value=2)),
    "top_p": mostly(st.floats(min_value=0, max_value=1)),
    "top_k": mostly(st.integers(min_value=0, max_value=100)),
    "min_p": mostly(st.floats(min_value=0, max_value=1)),
    "seed": mostly(st.integers(min_value=-1, max_value=2**32 - 2)),
    "stop": mostly(texts.filter(bool), st.lists(texts.filter(bool), max_size=4)),
    "stream": mostly(st.booleans()),
    "ignore_eos": mostly(st.booleans()),
    "repeat_penalty": mostly(st.floats(min_value=0.1, max_value=3)),
    "presence_penalty": mostly(st.floats(min_value=-2, max_value=2)),
    "frequency_penalty": mostly(st.floats(min_value=-2, max_value=2)),
}
openai_extra = {
    "n": mostly(st.integers(min_value=1, max_value=4)),
    "model": mostly(st.just("smollm2-135m-instruct"), st.just("")),  # another name: a 404
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": mostly(st.booleans())})),
}


def body_of(required: dict, optional: dict):
    """A JSON object with the required fields, some optional ones and unknown ones."""
    return st.tuples(st.fixed_dictionaries(required, optional=optional),
                     st.dictionaries(st.text(max_size=10), json_values, max_size=3)).map(
        lambda t: {**t[1], **t[0]})


BODIES = {
    "/v1/completions": body_of(
        {"prompt": mostly(texts.filter(bool), token_ids, st.lists(texts, max_size=2)),
         "max_tokens": max_tokens},
        {**sampling, **openai_extra, "logprobs": mostly(st.integers(0, 20)),
         "echo": mostly(st.just(False))}),
    "/v1/chat/completions": body_of(
        {"messages": mostly(messages), "max_tokens": max_tokens},
        {**sampling, **openai_extra, "max_completion_tokens": max_tokens,
         "logprobs": mostly(st.booleans()), "top_logprobs": mostly(st.integers(0, 20))}),
    "/generate": body_of({"prompt": mostly(texts.filter(bool)), "max_tokens": max_tokens},
                         sampling),
    "/tokenize": body_of({}, {"content": mostly(texts),
                              "add_special": mostly(st.booleans())}),
    "/detokenize": body_of({}, {"tokens": mostly(token_ids)}),
}


@pytest.fixture(scope="module")
def http():
    with ServerProcess("--ctx-size", "1024", "--parallel", "4") as srv, \
            srv.http_client(TIMEOUT) as client:
        yield client
        print("\nresponses by (route, status):", dict(sorted(STATUSES.items())))
        assert "Traceback" not in srv.log, srv.log[-3000:]


def check(http: httpx.Client, path: str, content: bytes) -> None:
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    STATUSES[path, r.status_code] += 1
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert_error(r, r.status_code, generate=path == "/generate")
        return
    assert r.status_code == 200, r.text[:500]
    if r.headers["content-type"].startswith("text/event-stream"):
        assert all(isinstance(payload, dict) for payload in sse_payloads(r.content))
    else:
        assert isinstance(r.json(), dict)


@pytest.mark.parametrize("path", list(BODIES))
def test_random_json_bodies(http, path):
    @SETTINGS
    @given(body=BODIES[path])
    def run(body):
        check(http, path, json.dumps(body).encode())  # NaN/Infinity included: invalid JSON

    run()


@pytest.mark.parametrize("path", list(BODIES))
def test_random_bytes(http, path):
    @settings(SETTINGS, max_examples=50)
    @given(raw=st.one_of(st.binary(max_size=300),
                         st.text(max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass"))))
    def run(raw):
        check(http, path, raw)

    run()
