"""Failure accounting against a tiny HTTP server on 127.0.0.1 that answers by the prompt's text.

Not a model stand-in: it exercises the load generator's handling of what servers send back."""
import asyncio
import contextlib
import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cllm.bench.loadgen import (
    EMPTY_RESPONSE,
    Connections,
    HttpTarget,
    LoadSettings,
    first_model,
    run_level,
)
from cllm.bench.stats import summarize


def _sse(*chunks: dict, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in chunks] + (["data: [DONE]\n\n"] if done else [])
    return "".join(lines).encode()


_TEXT = {"choices": [{"index": 0, "text": "tok", "finish_reason": None}]}
_USAGE = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}


_MEETING = threading.Barrier(40, timeout=5)


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        self._send(200, "application/json", json.dumps({"data": [{"id": "fake-model"}]}).encode())

    dropped: set[str] = set()  # "drop once ..." prompts whose first connection was closed

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt, stream = body["prompt"], body["stream"]
        if prompt == "drop always" or (prompt.startswith("drop once")
                                       and prompt not in self.dropped):
            self.dropped.add(prompt)
            self.close_connection = True  # as a server closing a kept-alive connection
        elif prompt == "meet":  # answers once all its peers are in flight too
            _MEETING.wait()
            self._send(200, "text/event-stream", _sse(_TEXT, _TEXT, _USAGE))
        elif prompt in ("500", "429"):
            error = {"error": {"message": f"status {prompt}", "code": int(prompt)}}
            self._send(int(prompt), "application/json", json.dumps(error).encode())
        elif prompt == "empty":
            self._send(200, "text/event-stream", _sse({**_USAGE, "usage": {"completion_tokens": 0}})
                       if stream else json.dumps({"choices": [{"text": ""}],
                                                  "usage": {"completion_tokens": 0}}).encode())
        elif prompt == "cut" and stream:
            self._send(200, "text/event-stream", _sse(_TEXT, done=False))
        elif stream:
            self._send(200, "text/event-stream", _sse(_TEXT, _TEXT, _USAGE))
        else:
            self._send(200, "application/json", json.dumps(
                {"choices": [{"text": "toktok", "finish_reason": "length"}], "usage": _USAGE["usage"]}
            ).encode())

    def _send(self, status: int, content_type: str, payload: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class _ClosingAfterEachResponse(_Handler):
    """Keeps connections alive (HTTP/1.1, no Connection: close) yet closes each one after its
    response, as llama-server does after every stream."""
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        super().do_POST()
        self.wfile.flush()
        self.connection.shutdown(socket.SHUT_WR)  # right after the response, as llama-server
        self.close_connection = True


@contextlib.contextmanager
def _serving(handler: type[BaseHTTPRequestHandler]):
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def url():
    with _serving(_Handler) as url:
        yield url


async def _run(url: str, prompts: list[str], stream: bool, concurrency: int = 3):
    async with Connections(concurrency, timeout=10) as connections:
        target = HttpTarget(url, await first_model(connections, url), LoadSettings(stream=stream),
                            connections)
        assert target.model == "fake-model"
        return await run_level(target.send, prompts, concurrency)


@pytest.mark.parametrize("stream", [True, False])
def test_every_request_ends_in_tokens_or_a_reason(url, stream):
    prompts = ["ok", "500", "ok", "429", "empty", "ok", "cut"]
    results, duration = asyncio.run(_run(url, prompts, stream))
    assert len(results) == len(prompts) and duration > 0
    by_prompt = dict(zip(prompts, results))
    assert by_prompt["500"].error == "HTTP 500: status 500"
    assert by_prompt["429"].error == "HTTP 429: status 429"
    assert by_prompt["empty"].error == EMPTY_RESPONSE
    assert by_prompt["ok"].ok and by_prompt["ok"].output_tokens == 2
    metrics = summarize(results, duration)
    assert metrics["completed"] + metrics["failed"] == len(prompts)
    assert metrics["total_output_tokens"] == 2 * metrics["completed"]
    if stream:
        assert by_prompt["cut"].error == "stream ended without [DONE]"
        assert metrics["completed"] == 3
    else:
        assert metrics["completed"] == 4  # "cut" is an ordinary answer without streaming


def test_connection_refused_is_recorded():
    async def run():
        async with Connections(1, timeout=5) as connections:
            target = HttpTarget("http://127.0.0.1:9", "m", LoadSettings(), connections)
            return await run_level(target.send, ["x"], 1)

    results, _ = asyncio.run(run())
    assert results[0].error.startswith("ClientConnectorError")


@pytest.mark.parametrize("stream", [True, False])
def test_a_connection_closed_before_the_answer_is_sent_again_once(url, stream):
    prompts = [f"drop once {stream}", "drop always", "ok"]
    results, duration = asyncio.run(_run(url, prompts, stream))
    again, always, ok = results
    assert again.ok and again.output_tokens == 2 and again.resent
    assert always.error.startswith("ServerDisconnectedError") and not always.ok
    assert ok.ok and not ok.resent
    assert summarize(results, duration)["resent"] == 1


def test_every_request_in_flight_has_its_own_connection(url):
    """A level of N streams keeps N requests at the server at once: none waits for a
    connection, which would count in its TTFT."""
    prompts = ["meet"] * _MEETING.parties
    results, _ = asyncio.run(_run(url, prompts, stream=True, concurrency=_MEETING.parties))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_server_that_closes_after_each_response_gets_each_request_on_a_new_connection(
        stream, concurrency):
    prompts = ["ok"] * 8 * concurrency
    with _serving(_ClosingAfterEachResponse) as url:
        results, _ = asyncio.run(_run(url, prompts, stream, concurrency))
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    # Sent again where the close came later than one pass of the event loop: now and then.
    assert sum(r.resent for r in results) < len(prompts) // 2
