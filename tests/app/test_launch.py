"""The server's launch and shutdown (cllm/app/launch.py) with work in flight that cannot be
interrupted: a real `python -m cllm.serve` process with the real default model."""
from __future__ import annotations

import json
import threading
import time

import httpx
from server_process import ServerProcess

SPECIAL = "<|im_end|>a"  # a special token and a letter: two tokens
PLAIN = "The sea, the sea. "  # plain text: about a second a megabyte on a 2-core CPU
GRACE = 3.0


def _send(url: str, path: str, body: dict, results: list) -> threading.Thread:
    def run():
        try:
            r = httpx.post(url + path, json=body, timeout=120)
            results.append((r.status_code, r.text))
        except httpx.TransportError as exc:
            results.append(("transport", repr(exc)))
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_sigterm_exits_within_the_grace_with_tokenizing_and_chat_prompts_in_flight():
    """Texts whose tokenizing runs past the grace (minutes of it in all): at the grace every
    client gets its 503, the queued work is dropped, and the process exits at once, leaving what
    runs in C; exit status 0."""
    texts = [SPECIAL * 300_000, PLAIN * 200_000]  # 3.3 and 3.6 MB
    load = [("/tokenize", {"content": text}) for text in texts] * 3
    load += [("/v1/chat/completions", {"messages": [{"role": "user", "content": text}],
                                       "max_tokens": 1}) for text in texts] * 3
    with ServerProcess("--shutdown-grace", str(GRACE)) as srv:
        results: list = []
        threads = [_send(srv.url, path, body, results) for path, body in load]
        time.sleep(2)  # the bodies arrive and their tokenizing starts
        started = time.monotonic()
        srv.terminate()
        rc = srv.wait(timeout=120)
        elapsed = time.monotonic() - started
        for t in threads:
            t.join(120)
        assert rc == 0, srv.log
        assert elapsed < GRACE + 4, (elapsed, srv.log)
        for status, text in results:
            # Each client hears a stated end: served, too long for the context (a chat prompt
            # whose tokenizing ended before the grace), or shut down.
            assert status in (200, 400, 503), (status, text[:300])
            if status != 200:
                code = json.loads(text)["error"]["code"]
                assert code == ("shutting_down" if status == 503 else "context_length_exceeded")
        assert "Traceback" not in srv.log
