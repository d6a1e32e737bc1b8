"""How many streamed events a second `python -m cllm.bench` itself can take: a stand-in for an
OpenAI completions server that answers at once, every request with the same canned stream of
N one-token events (plus the usage chunk), written W events at a time (servers write each event
as it comes: W=1), so the client, not a model, is what is measured:

    python bench/probes/client_capacity.py 8499 128 1 &
    python -m cllm.bench --url http://127.0.0.1:8499 --concurrency 64 256 --requests 1024 \\
        --warmup 64 --prompt-tokens 128 --max-tokens 128 --tag client-capacity

A server benchmarked at a rate near the client's capacity is measured wrongly; the Ray
scale-out results (docs/benchmarks.md) compare against it."""
import asyncio
import json
import sys

PORT = int(sys.argv[1]) if len(sys.argv) > 1 else 8499
EVENTS_PER_STREAM = int(sys.argv[2]) if len(sys.argv) > 2 else 128
EVENTS_PER_WRITE = int(sys.argv[3]) if len(sys.argv) > 3 else 1
GAP = 0.002  # seconds between writes, so a stream arrives in parts as from a server


def _event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


def _chunk(data: bytes) -> bytes:  # HTTP/1.1 chunked transfer coding
    return b"%x\r\n%s\r\n" % (len(data), data)


TOKEN = _event({"id": "probe", "object": "text_completion",
                "choices": [{"index": 0, "text": " tok", "finish_reason": None}]})
USAGE = _event({"id": "probe", "choices": [], "usage": {
    "prompt_tokens": 128, "completion_tokens": EVENTS_PER_STREAM,
    "total_tokens": 128 + EVENTS_PER_STREAM}})
EVENTS = [TOKEN] * EVENTS_PER_STREAM + [USAGE, b"data: [DONE]\n\n"]
WRITES = [b"".join(_chunk(e) for e in EVENTS[i:i + EVENTS_PER_WRITE])
          for i in range(0, len(EVENTS), EVENTS_PER_WRITE)] + [b"0\r\n\r\n"]
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
               b"transfer-encoding: chunked\r\n\r\n")
MODELS = json.dumps({"object": "list", "data": [{"id": "probe"}]}).encode()
MODELS_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n%s" % (len(MODELS), MODELS))


async def serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:  # keep-alive: one request after another
            head = await reader.readuntil(b"\r\n\r\n")
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    await reader.readexactly(int(line.split(b":")[1]))
            if head.startswith(b"GET"):  # /v1/models, which the client asks first
                writer.write(MODELS_RESPONSE)
                continue
            writer.write(STREAM_HEAD)
            for part in WRITES:
                writer.write(part)
                await writer.drain()
                await asyncio.sleep(GAP)
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def main() -> None:
    server = await asyncio.start_server(serve_connection, "127.0.0.1", PORT, backlog=1024)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
