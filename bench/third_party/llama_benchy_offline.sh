#!/usr/bin/env bash
# llama-benchy (PyPI) against cllm, unchanged, on a machine that reaches nothing but itself:
# the tokenizer comes from the GGUF (python -m cllm.bench.tokenizer), the "book" the prompts are
# cut from is local text served on 127.0.0.1, and the model is named as the server lists it
# (GET /v1/models: id and root). Run from the repository root, with cllm installed and
# `pip install "llama-benchy>=0.4,<0.5" gguf tokenizers`. Extra arguments go to llama-benchy.
set -euo pipefail
source "$(dirname "$0")/cllm_server.sh"

PORT=${PORT:-8080}
BOOK_PORT=${BOOK_PORT:-8765}
work=$(mktemp -d)
cleanup() {
    for pid in ${server_pid:-} ${book_pid:-}; do kill "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT

python -m cllm.bench.tokenizer "$work/tokenizer.json"
python - "$work/book.txt" <<'PY'
import random, sys
from cllm.bench.prompts import text
open(sys.argv[1], "w").write(text(random.Random(0), 60000))  # English-like, seeded
PY
python -m http.server "$BOOK_PORT" --bind 127.0.0.1 --directory "$work" >/dev/null 2>&1 &
book_pid=$!
start_cllm "$work/server.log" "$PORT"

models=$(curl -sf "http://127.0.0.1:$PORT/v1/models")
served=$(python -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])' <<<"$models")
repo=$(python -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["root"])' <<<"$models")

# The default model is too small to pass the coherence probe (the capital of France).
(( $# )) || set -- --pp 128 512 --tg 32 --runs 2 --concurrency 1 4 --skip-coherence
llama-benchy --base-url "http://127.0.0.1:$PORT/v1" --model "$repo" \
    --served-model-name "$served" --tokenizer "$work/tokenizer.json" \
    --book-url "http://127.0.0.1:$BOOK_PORT/book.txt" "$@"
