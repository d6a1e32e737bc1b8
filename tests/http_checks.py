"""Checks of what the HTTP server sends, shared by the tests that drive a real server: SSE
framing, OpenAI-shaped error bodies, /metrics samples, and whether streams keep flowing."""
from __future__ import annotations

import json
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families


def sse_payloads(body: bytes) -> list:
    """The JSON payloads of an SSE body, checking its framing: only `data: <json>\\n\\n`
    events, the last of them `data: [DONE]\\n\\n`."""
    assert body.endswith(b"data: [DONE]\n\n"), body[-200:]
    events = body.split(b"\n\n")
    assert events.pop() == b""
    for event in events:
        assert event.startswith(b"data: ") and b"\n" not in event, event
    payloads = [event[len(b"data: "):] for event in events]
    assert payloads.pop() == b"[DONE]"
    assert b"[DONE]" not in payloads
    return [json.loads(p) for p in payloads]


def post_stream(http: httpx.Client, path: str, body: dict) -> tuple[httpx.Response, bytes]:
    with http.stream("POST", path, json=body) as r:
        return r, r.read()


def assert_error(response: httpx.Response, status: int, *, generate: bool = False,
                 type_: str | None = None, code: str | None = None) -> dict:
    """An error response: the status, and {"error": {"message", "type", "code"}} (with
    "success": false for /generate, the original API)."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == ({"success", "error"} if generate else {"error"}), body
    if generate:
        assert body["success"] is False
    error = body["error"]
    assert {"message", "type", "code"} <= set(error), error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if type_ is not None:
        assert error["type"] == type_, error
    if code is not None:
        assert error["code"] == code, error
    return error


def metrics(http_or_url) -> dict[str, float]:
    """Every sample of GET /metrics, keyed `name{label="value",...}` (labels sorted)."""
    if isinstance(http_or_url, str):
        r = httpx.get(http_or_url + "/metrics", timeout=30)
    else:
        r = http_or_url.get("/metrics")
    assert r.status_code == 200
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def read_until_closed(sock, timeout: float) -> bytes:
    """What a raw socket receives until the server closes it."""
    sock.settimeout(timeout)
    out = b""
    while chunk := sock.recv(4096):
        out += chunk
    return out


def wait_for_metric(url: str, name: str, predicate, timeout: float = 10.0) -> float:
    """Poll /metrics until predicate(value of name) holds; the last value either way."""
    deadline = time.monotonic() + timeout
    while True:
        value = metrics(url).get(name)
        if (value is not None and predicate(value)) or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


class StreamGaps:
    """A long streamed completion, read in a thread while the test does something else: its
    largest gap between reads says how long the server stopped serving it. Use as a context
    manager; entering waits for the stream's first event, leaving for the server to be idle
    again (the stream aborted), so later tests count only their own tokens."""

    def __init__(self, url: str, *, max_tokens: int = 1500) -> None:
        self._body = {"prompt": "Once upon a time", "max_tokens": max_tokens,
                      "ignore_eos": True, "stream": True}
        self._url = url
        self._times: list[float] = []
        self._started, self._stop = threading.Event(), threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._read, daemon=True)

    def __enter__(self) -> StreamGaps:
        self._thread.start()
        assert self._started.wait(60), "the stream did not start"
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)
        assert wait_for_metric(self._url, "cllm_requests_running", lambda v: v == 0) == 0

    def _read(self) -> None:
        with httpx.stream("POST", self._url + "/v1/completions", json=self._body,
                          timeout=120) as r:
            for _ in r.iter_raw():
                self._times.append(time.monotonic())
                self._started.set()
                if self._stop.is_set():
                    return
        self._ended = True

    def largest(self) -> float:
        """The longest wait so far, the one going on now included."""
        assert not self._ended, "the stream ended before the work did: give it more tokens"
        times = [*self._times, time.monotonic()]
        return max(b - a for a, b in zip(times, times[1:]))
