"""The access check's keys (cllm/app/access.py): which entry a request's key matched, and what
a named key makes of the request (cllm/http/common.for_caller). No model needed."""
import pytest
from http_checks import metrics
from server_process import ServerProcess
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from cllm.app.access import APIKeyMiddleware
from cllm.config import ApiKey, SamplingParams
from cllm.http.common import KEY_STATE, for_caller

KEYS = (ApiKey("k-alice", "alice", 2.0, 0), ApiKey("k-agents", "agents", 1.0, 5), ApiKey("k"))


async def whose(request):
    key = request.scope["state"][KEY_STATE]
    return JSONResponse({"name": key.name, "weight": key.weight})


@pytest.fixture(scope="module")
def client():
    app = Starlette(routes=[Route("/v1/whose", whose), Route("/v1/messages", whose)],
                    middleware=[Middleware(APIKeyMiddleware, keys=KEYS,
                                           public_paths=frozenset())])
    return TestClient(app)


def test_each_key_opens_the_server_as_its_own_user(client):
    for key, name in (("k-alice", "alice"), ("k-agents", "agents"), ("k", "")):
        r = client.get("/v1/whose", headers={"Authorization": f"Bearer {key}"})
        assert r.status_code == 200 and r.json()["name"] == name
    r = client.get("/v1/messages", headers={"X-Api-Key": "k-agents"})
    assert r.json()["name"] == "agents"
    for headers in ({}, {"Authorization": "Bearer k-alicE"}, {"X-Api-Key": "k-alice"}):
        assert client.get("/v1/whose", headers=headers).status_code == 401


def test_a_named_key_sets_the_user_its_weight_and_a_floor_on_the_priority():
    asked = SamplingParams(priority=1, user="spoofed")
    agents = for_caller(asked, KEYS[1])
    assert (agents.user, agents.user_weight, agents.priority) == ("agents", 1.0, 5)
    alice = for_caller(asked, KEYS[0])
    assert (alice.user, alice.user_weight, alice.priority) == ("alice", 2.0, 1)
    assert for_caller(asked, KEYS[2]) is asked  # an unnamed key: the request's own user
    assert for_caller(asked, None) is asked


def test_each_named_keys_requests_count_for_its_user_at_its_priority(tmp_path):
    """With a key file, /metrics counts tokens by the keys' names and times first tokens by
    the priority a key holds its requests to; /status shows each user's requests."""
    path = tmp_path / "keys"
    path.write_text("k-alice name=alice\nk-bob name=bob weight=2 priority=3\n")
    prompt = "Say something about the sea."
    with ServerProcess("--api-key-file", str(path), "--parallel", "2") as srv:
        for key in ("k-alice", "k-bob"):
            with srv.http_client(api_key=key) as http:
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4,
                                                       "ignore_eos": True, "user": "spoofed"})
                assert r.status_code == 200
                used = r.json()["usage"]["total_tokens"]
        with srv.http_client(api_key="k-alice") as http:
            after = metrics(http)
            assert http.get("/status").json()["users"] == {}  # nothing runs or waits now
    assert after['cllm_user_tokens_total{user="alice"}'] == used
    assert after['cllm_user_tokens_total{user="bob"}'] == used
    assert after['cllm_time_to_first_token_seconds_count{priority="3"}'] == 1
    assert after['cllm_time_to_first_token_seconds_count{priority="0"}'] == 1
    assert not any('user="bucket' in name for name in after)  # the field did not count


def test_a_keys_quotas_answer_429_naming_the_limit_and_free_up_as_sequences_end(tmp_path):
    path = tmp_path / "keys"
    path.write_text("k-one name=one max_requests=1\nk-tpm name=tpm tokens_per_minute=20\n")
    body = {"prompt": "Count to a hundred:", "max_tokens": 24, "ignore_eos": True}
    with ServerProcess("--api-key-file", str(path), "--parallel", "2") as srv:
        with srv.http_client(api_key="k-one") as http:
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as first:
                lines = first.iter_lines()
                next(lines)  # in flight now
                second = http.post("/v1/completions", json=body)
                assert second.status_code == 429 and second.headers["Retry-After"] == "1"
                error = second.json()["error"]
                assert error["code"] == "rate_limit_exceeded"
                assert "1 sequences in flight" in error["message"]
                for _ in lines:  # the first runs to its end
                    pass
            assert http.post("/v1/completions", json=body).status_code == 200
        with srv.http_client(api_key="k-tpm") as http:
            assert http.post("/v1/completions", json=body).status_code == 200  # 24+ tokens
            refused = http.post("/v1/completions", json=body)
            assert refused.status_code == 429 and "20 tokens a minute" in refused.text
            assert 1 <= int(refused.headers["Retry-After"]) <= 60
