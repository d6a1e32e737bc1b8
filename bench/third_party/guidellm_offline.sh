#!/usr/bin/env bash
# guidellm 0.8 (PyPI) against cllm, unchanged, on a machine that reaches nothing but itself and
# its package index: guidellm gets a virtualenv of its own under the user cache (its dependencies,
# torch among them, never enter cllm's environment), its tokenizer is written from the GGUF
# (python -m cllm.bench.tokenizer), its prompts are synthetic (cut to the asked token counts with
# that tokenizer), and it finds the model by asking the server (GET /v1/models). Run from the
# repository root, with cllm installed and `pip install gguf tokenizers`. Extra arguments replace
# the default load (profile, constraints, data); the report, guidellm's JSON and its console
# tables, lands in bench/results/third-party/ (OUT=... elsewhere). Fails unless every benchmark
# completed requests with output tokens and none errored.
#
# torch cannot be left out: guidellm imports it at start (its data loader is torch's DataLoader).
# The smallest install that works is a CPU build; TORCH (default torch==2.13.0) is what pip puts
# beside guidellm. Where pip finds a CPU build for it (on this project's machines a file on disk;
# elsewhere PyTorch's own CPU wheel index, given to pip as PIP_EXTRA_INDEX_URL) the virtualenv
# takes 1.5 GB and one to two minutes; from the package index alone, torch on Linux x86_64 is a
# CUDA build: 6 GB with its nvidia-* wheels, and without them it does not import (libcudnn missing).
set -euo pipefail
source "$(dirname "$0")/cllm_server.sh"

VENV=${GUIDELLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/cllm/guidellm-venv}
TORCH=${TORCH:-torch==2.13.0}
OUT=${OUT:-bench/results/third-party}
PORT=${PORT:-$(free_port)}
work=$(mktemp -d)
cleanup() {
    [ -n "${server_pid:-}" ] && kill "$server_pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

if ! "$VENV/bin/guidellm" --version 2>/dev/null | grep -q ' 0\.8\.1$'; then
    python -m venv "$VENV"
    start=$SECONDS
    "$VENV/bin/pip" install --quiet "guidellm==0.8.1" "$TORCH"
    echo "guidellm 0.8.1 and $TORCH installed in $VENV in $((SECONDS - start)) s"
fi

mkdir "$work/tokenizer"  # a directory, as transformers' AutoTokenizer loads it
python -m cllm.bench.tokenizer "$work/tokenizer/tokenizer.json" >/dev/null
start_cllm "$work/server.log" "$PORT" --threads 2

# About 70 s: closed loops of 1, 2 and 4 streams, 20 s each, 128 prompt and 64 output tokens.
(( $# )) || set -- --profile kind=concurrent,streams=1 --override profile.streams 1,2,4 \
    --constraint kind=max_duration,seconds=20 \
    --data kind=synthetic_text,prompt_tokens=128,output_tokens=64
mkdir -p "$OUT"
report="$OUT/guidellm-$(date -u +%Y%m%dT%H%M%S).json"
{
    echo "cllm $(git describe --always --dirty 2>/dev/null || echo '?'), guidellm 0.8.1, $TORCH;" \
        "$(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores usable;" \
        "load average before the run: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "guidellm run $*"
} >"${report%.json}.txt"
# sample_size=0: per-request timings and token counts stay in the JSON, prompt and output texts not.
HF_HUB_OFFLINE=1 "$VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$PORT" \
    --tokenizer "kind=huggingface_auto,model=$work/tokenizer" \
    --metrics kind=generative,sample_size=0 --output "kind=json,path=$report" \
    --output kind=console --disable-console-interactive "$@" | tee -a "${report%.json}.txt"

kill "$server_pid"
wait "$server_pid" || { cat "$work/server.log"; exit 1; }
server_pid=

python - "$report" <<'PY'
import json, sys

benchmarks = json.load(open(sys.argv[1]))["benchmarks"]
failed = not benchmarks
for bench in benchmarks:
    strategy, metrics = bench["config"]["strategy"], bench["metrics"]
    totals = metrics["request_totals"]
    tokens = metrics["output_token_count"]["successful"]["total_sum"]
    print(f"{strategy['type_']}@{strategy.get('streams', strategy.get('rate', ''))}: "
          f"{totals['successful']} completed, {totals['errored']} errored, "
          f"{tokens:.0f} output tokens, "
          f"TTFT p50 {metrics['time_to_first_token_ms']['successful']['median']:.0f} ms, "
          f"ITL p50 {metrics['inter_token_latency_ms']['successful']['median']:.1f} ms")
    failed |= not totals["successful"] or not tokens or bool(totals["errored"])
print(sys.argv[1], "FAILED" if failed else "ok")
sys.exit(failed)
PY
