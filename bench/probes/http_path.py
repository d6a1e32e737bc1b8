"""Where a request's time goes on the HTTP side: `python -m cllm.serve` in this process, each
completion request timed from its arrival at the app to its body read, its prompt tokenized,
its submission to the engine, its first token (the engine's clock) and its first body write.
Load it with any client, then stop it (SIGTERM or SIGINT) for the medians, e.g.

    python bench/probes/http_path.py --threads 2 --parallel 8 --ctx-size 16384 --port 8322 &
    python -m cllm.bench --url http://127.0.0.1:8322 --workload shared-prefix --concurrency 8 \\
        --requests 48 --max-tokens 50 --warmup 0 --out /tmp/p; kill %1

The client's TTFT less "arrival -> first token" is what the network and the client add."""
from __future__ import annotations

import contextvars
import statistics
import sys
import time

from cllm import serve
from cllm.app import server
from cllm.engine import engine as engine_module

TIMED_PATHS = ("/v1/completions", "/v1/chat/completions")
RECORDS: list[dict] = []
_CURRENT: contextvars.ContextVar[dict | None] = contextvars.ContextVar("request", default=None)
PARTS = (("arrival -> body read", "arrival", "body"),
         ("body read -> tokenizing", "body", "tokenizing"),
         ("tokenizing", "tokenizing", "tokenized"),
         ("tokenized -> submitted", "tokenized", "submitted"),
         ("submitted -> first token", "submitted", "first_token"),
         ("first token -> first write", "first_token", "first_write"),
         ("arrival -> first token", "arrival", "first_token"))


class TimedApp:
    """The app, with each timed request's record in a context variable its handlers see."""

    def __init__(self, app) -> None:
        self.app = app

    def __getattr__(self, name):  # .state and the rest, for cllm.serve's shutdown
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] not in TIMED_PATHS:
            return await self.app(scope, receive, send)
        record = {"arrival": time.monotonic()}
        _CURRENT.set(record)
        RECORDS.append(record)

        async def timed_send(message):
            if message["type"] == "http.response.body" and message.get("body"):
                record.setdefault("first_write", time.monotonic())
            await send(message)
        await self.app(scope, receive, timed_send)


def _stamp(name: str) -> None:
    record = _CURRENT.get()
    if record is not None:
        record[name] = time.monotonic()


def _install() -> None:
    create_app, submit = server.create_app, engine_module.Engine.submit
    read_json, tokenize_text = server.read_json, server.tokenize_text

    def timed_submit(self, *args, **kwargs):
        stream = submit(self, *args, **kwargs)
        _stamp("submitted")
        record = _CURRENT.get()
        if record is not None:
            record["seq"] = stream.seq
        return stream

    async def timed_read_json(*args, **kwargs):
        body = await read_json(*args, **kwargs)
        _stamp("body")
        return body

    async def timed_tokenize_text(*args, **kwargs):
        _stamp("tokenizing")
        tokens = await tokenize_text(*args, **kwargs)
        _stamp("tokenized")
        return tokens

    server.create_app = lambda *args, **kwargs: TimedApp(create_app(*args, **kwargs))
    engine_module.Engine.submit = timed_submit
    server.read_json, server.tokenize_text = timed_read_json, timed_tokenize_text


def _report() -> None:
    done = []
    for record in RECORDS:
        seq = record.get("seq")
        if seq is not None and seq.first_token_time is not None and "first_write" in record:
            done.append(record | {"first_token": seq.first_token_time})
    print(f"{len(done)} requests with a first token, medians and p90:", file=sys.stderr)
    for name, start, end in PARTS:
        values = sorted(1000 * (r[end] - r[start]) for r in done if start in r and end in r)
        if values:
            print(f"  {name:28s} {statistics.median(values):8.2f} "
                  f"{values[int(0.9 * (len(values) - 1))]:8.2f} ms", file=sys.stderr)


if __name__ == "__main__":
    _install()
    try:
        serve.main(sys.argv[1:])
    finally:
        _report()
