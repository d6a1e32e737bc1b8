#!/bin/bash
# Session 32: masks in one llguidance call a step (LLExecutor, the GIL let go once) with a
# tokenizer that calls llama.cpp directly, against HEAD's structured.py/engine.py (a call a row,
# a Python tokenizer) on the same build: engine probe at 64 rows (one pool), then over HTTP, two
# servers on the card alternated by cllm.bench (structured workload, 64 streams, 512 requests, 2 runs).
W=/root/w; REPO=$PWD
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site PYTHONUNBUFFERED=1
R=$W/s32d; rm -rf $R; mkdir -p $R
t0=$(date +%s); el() { echo "[+$(( $(date +%s) - t0 ))s] $*"; }
up() { for p in "$@"; do for i in $(seq 180); do curl -sf http://127.0.0.1:$p/health > /dev/null && break; sleep 1; done; done; }
PKG=$(cd /tmp && python3 -c "import cllm, os; print(os.path.dirname(cllm.__file__))")
rm -rf $W/base; mkdir -p $W/base && cp -r $PKG $W/base/cllm && cp .device/exp/structured_base.py $W/base/cllm/structured.py && cp .device/exp/engine_base.py $W/base/cllm/engine.py
cd /tmp
M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
for v in new base; do
  P=$W/site; [ $v = base ] && P=$W/base:$W/site
  el "probe $v"
  PYTHONPATH=$P timeout 150 python3 $REPO/bench/probe_structured_step.py --model $M --levels 64 --kv-unified > $R/probe-$v.txt 2>&1
  tail -3 $R/probe-$v.txt
done
S="--model $M --parallel 64 --ctx-size 65536 --flash-attn on"
python3 -m cllm.serve $S --port 8101 > $R/new.log 2>&1 &
PYTHONPATH=$W/base:$W/site python3 -m cllm.serve $S --port 8102 > $R/base.log 2>&1 &
up 8101 8102
el "HTTP"
timeout 400 python3 -m cllm.bench --url http://127.0.0.1:8101 --url http://127.0.0.1:8102 --model $M --workload structured --max-tokens 160 --warmup 2 --concurrency 64 --requests 512 --runs 2 --tag structured --out $R > $R/structured.txt 2>&1
grep -E "^ *127|decode runs" $R/structured.txt | cut -c1-200
kill $(pgrep -f "m cllm[.]serve") 2>/dev/null; sleep 2
el done
cp $REPO/.device/exp/s32d.sh $R/; rm -f $R/*.png; tar -czf $OUT/s32d.tgz -C $W s32d
