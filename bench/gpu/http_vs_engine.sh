#!/bin/bash
# Where HTTP loses to the engine on the GPU machine, in one call: llama-batched-bench TG of
# both layouts, the engine measured directly (split), then three servers alternated over HTTP
# (split at --stream-interval 1 and 8, one pool) against the same load, each with its engine
# thread's step split (`engine thread:` lines: calls into the core, rows and forward steps a
# call, ms a call by phase). Compare the calls and the forward steps a call of engine-direct
# and HTTP: more calls of fewer steps over HTTP means arrivals cutting decode runs short.
#
#   bash bench/gpu/http_vs_engine.sh MODEL.gguf
#
# LEVEL (64), REQUESTS (384), MAX_TOKENS (256), CTX (65536) and TG_ARGS (more batched-bench
# flags, e.g. --no-repack where AMX faults, see the README) from the environment; W, BIN and
# the results folder as model_sizes.sh (after stage-and-build.sh and the wheels in $W/site).
set -u
M=$1
W=${W:-/root/w}
BIN=${BIN:-$W/build/bin}
LEVEL=${LEVEL:-64}
REQUESTS=${REQUESTS:-384}
MAX_TOKENS=${MAX_TOKENS:-256}
CTX=${CTX:-65536}
R=${OUT:-/tmp/out}/http-vs-engine/$(basename "$M" .gguf)
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$R"
cd /tmp || exit 1
up() { for p in "$@"; do for _ in $(seq 180); do curl -sf "http://127.0.0.1:$p/health" > /dev/null && break; sleep 1; done; done; }
for kv in split -kvu; do
    "$BIN"/llama-batched-bench -m "$M" -c "$CTX" -b 2048 -ub 512 -npp 16 -ntg "$MAX_TOKENS" \
        -npl "$LEVEL" -fa on -ngl 99 ${kv#split} ${TG_ARGS:-} 2>&1 | grep "^|" | tail -1 \
        | sed "s/^/TG $kv /"
done | tee "$R/batched-bench.txt"
S="--model $M --parallel $LEVEL --ctx-size $CTX --flash-attn on"
B="--concurrency $LEVEL --requests $REQUESTS --max-tokens $MAX_TOKENS --warmup 2"
F='(engine thread|^ *(cllm-engine|127))'
timeout 200 python3 -m cllm.bench --engine-direct $S --no-kv-unified $B --tag engine --out "$R" \
    2>&1 | grep -E "$F"
python3 -m cllm.serve $S --port 8102 --no-kv-unified > "$R/split-i1.log" 2>&1 &
python3 -m cllm.serve $S --port 8103 --no-kv-unified --stream-interval 8 > "$R/split-i8.log" 2>&1 &
python3 -m cllm.serve $S --port 8101 --kv-unified > "$R/pool-i1.log" 2>&1 &
up 8101 8102 8103
echo "8102: split, interval 1; 8103: split, interval 8; 8101: pool, interval 1"
timeout 300 python3 -m cllm.bench --url http://127.0.0.1:8102 --url http://127.0.0.1:8103 \
    --url http://127.0.0.1:8101 --model "$M" $B --runs 2 --tag http --out "$R" 2>&1 | grep -E "$F"
for p in 8101 8102 8103; do kill "$(pgrep -f "cllm.serve.*--port $p")" 2>/dev/null; done
sleep 3  # not a bare wait: a server that did not stop would hold the call to its limit
rm -f "$R"/*.png
