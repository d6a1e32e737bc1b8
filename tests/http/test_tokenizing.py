"""Client text into tokens (cllm/http/common.py, tokenize_text and chat_prompt): linear in the
text's special tokens (vendor/patches/llama-vocab-special-partition-linear.patch), on the
tokenizer's own threads with a deadline, and dropped when its client left before its turn. Real
`python -m cllm.serve` processes with the real default model."""
from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from http_checks import assert_error
from server_process import ServerProcess

SPECIAL = "<|im_end|>a"  # a special token and a letter: two tokens
PLAIN = "The sea, the sea. "  # plain text: about a second a megabyte on a 2-core CPU


@pytest.fixture(scope="module")
def server():
    with ServerProcess() as srv:
        yield srv


def _tokenize_seconds(http, repeats: int) -> float:
    """The fastest of two /tokenize calls on SPECIAL * repeats."""
    best = float("inf")
    for _ in range(2):
        started = time.monotonic()
        r = http.post("/tokenize", json={"content": SPECIAL * repeats})
        best = min(best, time.monotonic() - started)
        assert r.status_code == 200, r.text
        assert len(r.json()["tokens"]) == 2 * repeats
    return best


def test_special_token_text_costs_time_linear_in_its_length(http):
    """Four times the text (110 KB, then 440 KB of special tokens) may cost about four times the
    time; partitioning in quadratic time cost thirteen. The margin is generous: six times, plus
    half a second for a machine busy with other work."""
    small = _tokenize_seconds(http, 10_000)
    large = _tokenize_seconds(http, 40_000)
    assert large <= 6 * small + 0.5, (small, large)


def _abandon(port: int, path: str, body: dict) -> None:
    """Send a whole request and leave without reading its answer."""
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                     f"\r\nContent-Length: {len(raw)}\r\n\r\n".encode() + raw)
        time.sleep(0.5)  # the server reads the body and queues its work


def test_a_plain_request_is_answered_soon_beside_abandoned_heavy_ones(server, http):
    """Clients that send megabytes of text to tokenize and leave: work not yet started for them
    is dropped, so a plain request behind them waits for at most the pieces already running."""
    heavy = [("/tokenize", {"content": SPECIAL * 30_000}),
             ("/v1/completions", {"prompt": SPECIAL * 30_000, "max_tokens": 1}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": SPECIAL * 30_000}],
                                       "max_tokens": 1})] * 2
    heavy += [("/tokenize", {"content": PLAIN * 200_000})] * 6  # 3.6 MB each
    threads = [threading.Thread(target=_abandon, args=(server.port, path, body))
               for path, body in heavy]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    elapsed = time.monotonic() - started
    assert r.status_code == 200, r.text
    assert elapsed < 10, elapsed  # the abandoned texts took minutes to tokenize in all


def test_tokenizing_past_its_deadline_is_a_503_and_the_server_goes_on():
    with ServerProcess("--tokenize-timeout", "0.2") as srv, srv.http_client() as http:
        r = http.post("/tokenize", json={"content": PLAIN * 200_000})
        error = assert_error(r, 503, type_="server_error", code="tokenize_timeout")
        assert "0.2 s" in error["message"], error
        assert r.headers["retry-after"] == "1"
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert "Traceback" not in srv.log
