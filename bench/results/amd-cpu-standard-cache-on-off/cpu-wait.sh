#!/bin/bash
# c=1 and c=8 on an idle 2-core machine: cllm's --cpu-wait auto (GOMP_SPINCOUNT=3000), 30000, spin (libgomp default), llama-server
cd /work/main; mkdir -p /tmp/spin
export CLLM_PEER_BIN=$(ls -d ~/.cache/cllm/llama-server-build-*/bin | head -1)
S="--threads 2 --parallel 32 --ctx-size 32768"
python -m cllm.serve $S --port 8741 > /tmp/spin/auto.log 2>&1 &
GOMP_SPINCOUNT=30000 python -m cllm.serve $S --port 8742 > /tmp/spin/30k.log 2>&1 &
python -m cllm.serve $S --cpu-wait spin --port 8743 > /tmp/spin/spin.log 2>&1 &
for p in 8741 8742 8743; do until curl -sf localhost:$p/health >/dev/null; do sleep 1; done; done
python -m cllm.bench --url http://127.0.0.1:8741 --url http://127.0.0.1:8742 --url http://127.0.0.1:8743 --peer llama-server $S \
  --concurrency 1 8 --requests 72 --max-tokens 50 --ignore-eos --warmup 2 --runs 2 --out /tmp/spin --tag cpu-wait-c1-c8 > /tmp/spin/run.log 2>&1
pkill -f "cllm.serve.*--port 874"
