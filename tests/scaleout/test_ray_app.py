"""Scale-out on Ray Serve: `python -m cllm.serve --replicas 2` under a local Ray, two CPU
replicas of the default model (one thread each), driven over HTTP and the openai SDK."""
from __future__ import annotations

import json
import os
import re
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
from server_process import ServerProcess, listening_process

from cllm.scaleout.environment import processes_carrying

MODEL = "smollm2-135m-instruct"  # the served model's name: another is a 404
KEY = "scale-out-test-key"  # the replicas check it; the front's /metrics too
MARK = "CLLMTEST_RAY_MARK"  # an environment variable every process of this test's Ray inherits
HTTP_TIMEOUT = 120
REPLICA = "x-cllm-replica"


def ray_processes(mark: str) -> list[int]:
    """The processes whose environment carries `mark`: the driver, Ray's own, the replicas."""
    return processes_carrying(MARK, mark)


@pytest.fixture(scope="module")
def mark():
    return uuid.uuid4().hex


@pytest.fixture(scope="module")
def server(mark):
    # A front per replica by default, each with its own router: a conversation must still
    # keep to one replica.
    process = ServerProcess("--replicas", "2", "--ctx-size", "2048", "--parallel", "4",
                            "--api-key", KEY, startup_timeout=300)
    os.environ[MARK] = mark
    try:
        process.spawn()
    finally:
        del os.environ[MARK]
    try:
        process.wait_ready()
        yield process
    finally:
        process.__exit__(None, None, None)  # SIGTERM if still running; its files removed


@pytest.fixture(scope="module")
def http(server):
    with server.http_client(HTTP_TIMEOUT, api_key=KEY) as client:
        yield client


@pytest.fixture(scope="module")
def client(server):
    with server.openai_client(HTTP_TIMEOUT, api_key=KEY) as c:
        yield c


def chat(conversation: list[dict], **extra) -> dict:
    return {"messages": conversation, "max_tokens": 4, "temperature": 0, **extra}


def test_the_openai_sdk_works_through_ray_whole_and_streamed(client):
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    assert whole.choices[0].message.content and whole.usage.completion_tokens == 5
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 5


def test_requests_come_in_through_haproxy_to_a_front_per_replica(server, mark):
    assert listening_process(server.port) == "haproxy"  # not Ray's Python proxy actor
    fronts = [pid for pid in ray_processes(mark)
              if b"ServeReplica:cllm:Front" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    assert len(fronts) == 2


def test_the_replicas_run_at_the_servers_priority_not_rays_background_one(server, mark):
    replicas = [pid for pid in ray_processes(mark)
                if re.search(rb"ServeReplica:cllm:(Engine|Front)",
                             Path(f"/proc/{pid}/cmdline").read_bytes())]
    assert len(replicas) == 4  # two engines, two fronts
    assert {os.getpriority(os.PRIO_PROCESS, pid) for pid in replicas} == {
        os.getpriority(os.PRIO_PROCESS, 0)}


def test_errors_are_the_single_servers(http):
    bad = http.post("/v1/chat/completions", content=b"{not json")
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    original = http.post("/generate", json={"max_tokens": 3})
    assert original.status_code == 400 and original.json()["success"] is False
    assert http.get("/v1/nowhere").status_code == 404


def test_the_api_key_guards_the_replicas_and_the_front(server):
    assert httpx.get(server.url + "/health").status_code == 200  # public, as on one server
    for path in ("/v1/models", "/metrics"):
        refused = httpx.get(server.url + path)
        assert refused.status_code == 401, path
        assert refused.json()["error"]["code"] == "invalid_api_key"


def test_a_conversation_stays_on_one_replica_and_reuses_its_cache(http):
    conversation = [{"role": "system", "content": "You answer in one short sentence."},
                    {"role": "user", "content": "What is the capital of France?"}]
    replicas, usages = set(), []
    for follow_up in ("And of Italy?", "And of Spain?", "And of Peru?"):
        r = http.post("/v1/chat/completions", json=chat(conversation))
        assert r.status_code == 200, r.text
        replicas.add(r.headers[REPLICA])
        usages.append(r.json()["usage"])
        conversation += [r.json()["choices"][0]["message"], {"role": "user", "content": follow_up}]
    assert len(replicas) == 1
    # The second turn starts from the KV of the whole first prompt, on the replica that has it.
    assert usages[1]["prompt_tokens_details"]["cached_tokens"] >= usages[0]["prompt_tokens"]


def test_different_conversations_spread_over_both_replicas(http):
    replicas = {http.post("/v1/chat/completions", json=chat(
        [{"role": "user", "content": f"Question number {i}: what is {i} + {i}?"}],
        max_tokens=1)).headers[REPLICA] for i in range(16)}
    assert len(replicas) == 2


def test_metrics_cover_every_replica(http):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # replicas report every 2 s
        text = http.get("/metrics").text
        labelled = {line.split('replica="')[1].split('"')[0] for line in text.splitlines()
                    if line.startswith("cllm_generation_tokens_total{")}
        if len(labelled) == 2:
            return
        time.sleep(0.5)
    pytest.fail(f"/metrics did not show two replicas:\n{text[:2000]}")


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Write a long story.", "max_tokens": 400}),
    ("/v1/responses", {"input": "Write a long story.", "max_output_tokens": 400}),
])
def test_a_replica_killed_mid_stream_ends_its_stream_with_a_stated_error(http, path, body):
    events = []
    with http.stream("POST", path, json={**body, "ignore_eos": True, "stream": True},
                     timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events.append(next(line for line in lines if line.startswith("data: ")))
        os.kill(int(r.headers["x-cllm-replica-pid"]), signal.SIGKILL)
        events += [line for line in lines if line.startswith("data: ")]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events]
    last = payloads[-1]
    if path == "/v1/responses":  # the route's own error event, numbered after the others
        assert (last["type"], last["code"]) == ("error", "replica_failed"), events[-3:]
        assert last["sequence_number"] == payloads[-2]["sequence_number"] + 1
    else:
        assert last["error"]["code"] == "replica_failed", events[-3:]
    for i in range(4):  # the other replica serves while Ray replaces the dead one
        later = http.post("/v1/completions", json={"prompt": f"Hello {i}", "max_tokens": 2})
        assert later.status_code == 200, later.text


@pytest.mark.parametrize("fields, message", [
    ({"min_replicas": 1}, "--max-replicas"), ({"min_replicas": 3, "max_replicas": 2}, "min"),
    ({"router": "round-robin"}, "prefix or random"), ({"max_ongoing_requests": 0}, "at least 1"),
    ({"fronts": 0}, "at least 1"),
])
def test_a_plan_that_cannot_work_is_refused(fields, message):
    from cllm.scaleout.ray_app import Plan
    with pytest.raises(ValueError, match=message):
        Plan(**fields)


def test_a_replica_joins_the_bodies_of_a_batch_into_one_message():
    from cllm.scaleout.ray_app import _joined
    start = {"type": "http.response.start", "status": 200, "headers": []}
    batch = [start, {"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True},
             {"type": "http.response.body", "body": b"data: 2\n\n", "more_body": True},
             {"type": "http.response.body", "body": b"", "more_body": False}]
    assert _joined(batch) == [start, {"type": "http.response.body",
                                      "body": b"data: 1\n\ndata: 2\n\n", "more_body": False}]
    assert batch[1]["body"] == b"data: 1\n\n"  # the app's own messages are left as they were
    assert _joined(batch[1:3]) == [{"type": "http.response.body",
                                    "body": b"data: 1\n\ndata: 2\n\n", "more_body": True}]


def test_shutdown_leaves_no_ray_process(server, mark):
    assert len(ray_processes(mark)) > 3  # the driver, Ray's processes, the replicas
    assert server.stop(timeout=120) == 0
    deadline = time.monotonic() + 30
    while ray_processes(mark) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray_processes(mark) == []

