#!/bin/bash
# Model sizes people run, on the GPU machine: synthetic GGUFs with the exact shapes of
# Llama-3.2-1B, Qwen2.5-3B and Llama-3.1-8B (bench/gpu/synth_models.py: random weights, a
# tokenizer of the real vocabulary's size), quantized to Q4_K_M with the pinned llama-quantize;
# then cllm against llama-server at its best flags, and llama-batched-bench, at 1 / 8 / 64 / 128
# streams. One phase per device call (each well under 600 s); state lives in /root/w between them:
#
#   model_sizes.sh make MODEL...    generate and quantize (the first call also installs the gguf
#                                   wheels: carry .device/gpu14/whl)
#   model_sizes.sh bench MODEL...   python -m cllm.bench: cllm, llama-server split and unified KV
#   model_sizes.sh batched MODEL... llama-batched-bench TG at the same batch sizes
#   model_sizes.sh summary          the table: cllm, the faster llama-server, TG, TTFT;
#                                   a plot a model (by-streams.png)
#
# MODEL: llama-3.2-1b, qwen2.5-3b, llama-3.1-8b. Needs the CUDA build of stage-and-build.sh
# (cllm installed, llama-server, llama-batched-bench and llama-quantize in /root/w/build/bin) and
# its wheels in /root/w/site. Results go under $OUT/model-sizes/MODEL/; the step
# times are printed. Each bench run uses -np = --parallel = the concurrency (one server start per
# level), FA on, greedy, ignore_eos, 128 tokens, about two rounds of requests per level, and
# llama-server with backend sampling (-bs); at one stream split and unified KV are the same.
set -u
# The environment may change these for a smoke test elsewhere (e.g. on a CPU, with LEVELS="1 2").
W=${W:-/root/w}
BIN=${BIN:-$W/build/bin}
MODELS=$W/models
RESULTS=${OUT:-/tmp/out}/model-sizes
MAX_TOKENS=${MAX_TOKENS:-128}
CTX=${CTX:-65536}
LEVELS=${LEVELS:-1 8 64 128}
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site${PYTHONPATH:+:$PYTHONPATH} CLLM_PEER_BIN=$BIN
export PYTHONUNBUFFERED=1
REPO=$(cd "$(dirname "$0")/../.." && pwd)

now() { date +%s%N; }
since() { local ms=$(( ($(now) - $1) / 1000000 )); printf "%d.%d" $(( ms / 1000 )) $(( ms % 1000 / 100 )); }
card() { local name; name=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); echo "${name:-no GPU}"; }

install_wheels() {
    python3 -c "import gguf" 2>/dev/null && return
    python3 -m pip install -q --no-index --no-deps --no-compile --target $W/site \
        "$REPO"/.device/gpu14/whl/*.whl || { echo "carry .device/gpu14/whl"; exit 1; }
}

make_model() {  # generate the F16 file, quantize it, keep only the Q4_K_M one
    local m=$1 f16=$MODELS/$1-f16.gguf q=$MODELS/$1-q4_k_m.gguf t
    [ -f "$q" ] && { echo "$m: $q exists"; return; }
    t=$(now)
    python3 "$REPO"/bench/gpu/synth_models.py "$m" "$f16" --threads "$(nproc)" || exit 1
    echo "$m: generated in $(since "$t") s"
    t=$(now)
    "$BIN"/llama-quantize "$f16" "$q.part" Q4_K_M "$(nproc)" > "$MODELS/$m-quantize.log" 2>&1 \
        || { tail -5 "$MODELS/$m-quantize.log"; exit 1; }
    mv "$q.part" "$q" && rm -f "$f16"
    echo "$m: quantized in $(since "$t") s: $(grep 'quant size' "$MODELS/$m-quantize.log")"
}

bench_model() {  # one cllm.bench run per level: the servers start with -np = the level
    local m=$1 q=$MODELS/$1-q4_k_m.gguf c t kv requests log
    [ -f "$q" ] || { echo "$m: run make first"; exit 1; }
    mkdir -p "$RESULTS/$m"
    for c in $LEVELS; do
        t=$(now)
        kv="split unified"
        [ "$c" = 1 ] && kv="split"  # one slot: both layouts are the same
        requests=$(( c < 2 ? 4 : 2 * c ))
        log=$RESULTS/$m/bench-c$c.log
        timeout 280 python3 -m cllm.bench --cllm --peer llama-server --peer-kv $kv \
            --peer-args=-bs --model "$q" --concurrency "$c" --parallel "$c" --ctx-size $CTX \
            --flash-attn on --max-tokens $MAX_TOKENS --requests "$requests" \
            --warmup $(( c < 4 ? 1 : 4 )) --tag "$m-c$c" --out "$RESULTS/$m" > "$log" 2>&1 \
            || { echo "$m c=$c failed:"; tail -5 "$log"; }
        grep -aE "\[cllm.bench\] (cllm|llama-server)[-a-z]* c=|^ *(cllm|llama-server)" "$log" \
            | sed 's/.*\[cllm.bench\]/[cllm.bench]/'
        echo "$m c=$c: $(since "$t") s"
    done
}

batched_model() {
    local m=$1 q=$MODELS/$1-q4_k_m.gguf t
    mkdir -p "$RESULTS/$m"
    t=$(now)
    "$BIN"/llama-batched-bench -m "$q" -c $CTX -b 512 -ub 512 -npp 16 -ntg $MAX_TOKENS \
        -npl ${LEVELS// /,} -ngl 99 -fa on -kvu --output-format jsonl \
        > "$RESULTS/$m/batched-bench.jsonl" 2> "$RESULTS/$m/batched-bench.log" \
        || { tail -5 "$RESULTS/$m/batched-bench.log"; exit 1; }
    echo "$m batched-bench ($(since "$t") s), TG tok/s by batch:" \
        "$(python3 -c 'import json, sys
rows = [json.loads(line) for line in sys.stdin if line.startswith("{")]
print(", ".join("%d: %.0f" % (r["pl"], r["speed_tg"]) for r in rows))' \
        < "$RESULTS/$m/batched-bench.jsonl")"
}

phase=${1:-}
shift || true
echo "$(card); phase $phase $*"
mkdir -p "$MODELS" "$RESULTS"
case "$phase" in
    make) install_wheels; for m in "$@"; do make_model "$m"; done ;;
    bench) cd /tmp && for m in "$@"; do bench_model "$m"; done ;;
    batched) for m in "$@"; do batched_model "$m"; done ;;
    summary) python3 "$REPO"/bench/gpu/model_sizes_table.py "$RESULTS"
        for d in "$RESULTS"/*/; do  # a plot a model: its levels came from servers started anew
            ls "$d"bench-*.json > /dev/null 2>&1 || continue
            python3 -m cllm.bench.report plot --join "$d"bench-*.json --out "$d"by-streams.png
        done ;;
    *) echo "usage: $0 make|bench|batched MODEL... | summary"; exit 2 ;;
esac
