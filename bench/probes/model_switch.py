"""Switching to a model that is not loaded: a server of two models, one of them unloaded before
each round (POST /models/unload), then a streamed chat request to it, timed from its sending to
its first token; the server's own load time (cllm_model_load_seconds) beside it. The model files
are read once first, so they sit in the page cache, as for a model used earlier that day.

    python bench/probes/model_switch.py --rounds 5 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from cllm.models import resolve_model

MODELS = {"smol": "smollm2-135m-instruct", "gemma": "gemma3-270m"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--port", type=int, default=8357)
    args = parser.parse_args()
    for alias in MODELS.values():
        Path(resolve_model(alias)).read_bytes()  # into the page cache
    command = [sys.executable, "-m", "cllm.serve", "--port", str(args.port), "--keep-alive",
               "-1", "--threads", str(args.threads), "--log-level", "warning",
               *(f"--model={name}={alias}" for name, alias in MODELS.items())]
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{args.port}"
    try:
        with httpx.Client(base_url=url, timeout=120) as http:
            _wait_up(http)
            for name in MODELS:
                firsts, loads = [], []
                for _ in range(args.rounds):
                    http.post("/models/unload", json={"model": name}).raise_for_status()
                    firsts.append(_first_token(http, name))
                    loads.append(_load_seconds(http, name))
                print(json.dumps({"model": name, "rounds": args.rounds,
                                  "first_token_s": {"median": statistics.median(firsts),
                                                    "max": max(firsts)},
                                  "load_s": {"median": statistics.median(loads),
                                             "max": max(loads)}}))
    finally:
        server.terminate()
        server.wait(60)
    return 0


def _wait_up(http: httpx.Client) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if http.get("/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not start")


def _first_token(http: httpx.Client, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": 8, "stream": True}
    started, first = time.perf_counter(), None
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():  # to the end: a request in flight keeps its model
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("no token came")
    return first


def _load_seconds(http: httpx.Client, model: str) -> float:
    prefix = f'cllm_model_load_seconds{{model="{model}"}} '
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(prefix):
            return float(line[len(prefix):])
    raise RuntimeError("no load time in the metrics")


if __name__ == "__main__":
    sys.exit(main())
