#!/bin/bash
# Session 35: issue 13's GPU cost with decode runs that keep their shape (the default since
# 82103b0), five more runs of the structured workload at 64 streams, one server alone.
W=/root/w; REPO=$PWD
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site PYTHONUNBUFFERED=1
R=$W/s35; mkdir -p $R
up() { for i in $(seq 180); do curl -sf http://127.0.0.1:$1/health > /dev/null && break; sleep 1; done; }
cd /tmp
M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
for run in ${RUNS:-0 1 2 3 4}; do
  tag=r$run
  python3 -m cllm.serve --model $M --parallel 64 --ctx-size 65536 --flash-attn on --port 8101 > $R/server-$tag.log 2>&1 &
  up 8101
  timeout ${LIMIT:-130} python3 -m cllm.bench --url http://127.0.0.1:8101 --model $M --workload structured --max-tokens 160 --warmup 2 --concurrency 64 --requests 1024 --runs 1 --tag $tag --out $R/$tag > $R/$tag.txt 2>&1
  echo "== $tag"
  grep -aE "\] 127|decode runs|tok/s|TTFT" $R/$tag.txt | sed 's/.*\[cllm.bench\]/[cllm.bench]/' | cut -c1-220 | tail -12
  kill $(pgrep -f "m cllm[.]serve") 2>/dev/null; sleep 3
  grep -av "it/s\]\|s/it\]" $R/$tag.txt > $R/s.txt; mv $R/s.txt $R/$tag.txt
done
cp $REPO/.device/exp/s35.sh $R/; rm -f $R/*/*.png $R/server-*.log; tar -czf $OUT/s35.tgz -C $W s35
