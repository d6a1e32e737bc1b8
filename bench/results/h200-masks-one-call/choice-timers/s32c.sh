#!/bin/bash
# Session 32: where a constrained 64-row step's device masked choice spends its time, over HTTP
# against the engine probe (issue 13: ~1.4 ms a step over HTTP, 0.39 in the probe). The build
# carries the temporary timers of s32-probe.patch (stderr every 2,000 calls: staging the
# halves, the graph's allocation, the upload, the compute, the tokens' download).
W=/root/w; REPO=$PWD
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site PYTHONUNBUFFERED=1
R=$W/s32c; rm -rf $R; mkdir -p $R
up() { for p in "$@"; do for i in $(seq 180); do curl -sf http://127.0.0.1:$p/health > /dev/null && break; sleep 1; done; done; }
cd /tmp
M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
echo "== engine probe, one pool, 64 rows"
timeout 150 python3 $REPO/bench/probe_structured_step.py --model $M --levels 64 --kv-unified > $R/probe.txt 2> $R/probe.err
tail -12 $R/probe.txt; grep masked-choice $R/probe.err | tail -4
echo "== HTTP, 64 streams"
python3 -m cllm.serve --model $M --parallel 64 --ctx-size 65536 --flash-attn on --port 8101 > $R/server.log 2>&1 &
up 8101
timeout 200 python3 -m cllm.bench --url http://127.0.0.1:8101 --model $M --workload structured --max-tokens 160 --warmup 2 --concurrency 64 --requests 512 --tag structured --out $R > $R/structured.txt 2>&1
grep -E "^ *127|engine thread|sample" $R/structured.txt | cut -c1-220
grep masked-choice $R/server.log | tail -8
kill $(pgrep -f "m cllm[.]serve") 2>/dev/null; sleep 2
cp $REPO/.device/exp/s32c.sh $REPO/.device/exp/s32-probe.patch $R/; rm -f $R/*.png
tar -czf $OUT/s32c.tgz -C $W s32c
