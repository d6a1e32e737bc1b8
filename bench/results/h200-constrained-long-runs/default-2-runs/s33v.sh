#!/bin/bash
# Session 33: issue 13's GPU cost at 64 streams measured with long runs on one server alone on
# the card (the default flags), so that a run's denominator (free replies of the same lengths)
# is not one of several servers sharing the host: 1,536 requests a phase, 2 runs.
W=/root/w; REPO=$PWD
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site PYTHONUNBUFFERED=1
R=$W/s33v; rm -rf $R; mkdir -p $R
up() { for p in "$@"; do for i in $(seq 180); do curl -sf http://127.0.0.1:$p/health > /dev/null && break; sleep 1; done; done; }
cd /tmp
M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
python3 -m cllm.serve --model $M --parallel 64 --ctx-size 65536 --flash-attn on --port 8101 > $R/server.log 2>&1 &
up 8101
timeout ${LIMIT:-450} python3 -m cllm.bench --url http://127.0.0.1:8101 --model $M --workload structured --max-tokens 160 --warmup 2 --concurrency 64 --requests ${REQUESTS:-1536} --runs 2 --tag verdict --out $R > $R/structured.txt 2>&1
grep -aE "\] 127|decode runs" $R/structured.txt | sed 's/.*\[cllm.bench\]/[cllm.bench]/' | cut -c1-200
kill $(pgrep -f "m cllm[.]serve") 2>/dev/null; sleep 2
grep -av "it/s\]\|s/it\]" $R/structured.txt > $R/s.txt; mv $R/s.txt $R/structured.txt
cp $REPO/.device/exp/s33v.sh $R/; rm -f $R/*.png $R/server.log; tar -czf $OUT/s33v.tgz -C $W s33v
