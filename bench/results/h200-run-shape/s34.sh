#!/bin/bash
# Session 34: decode runs that keep their shape (rows that stop stay in the batch until the run
# ends; arrivals wait for the run) against the default, one server alone on the card at a time,
# the structured workload at 64 streams, 1,024 requests a phase; CLLM_EXP_HOLD=0/1/2/3 alternated.
W=/root/w; REPO=$PWD
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site PYTHONUNBUFFERED=1
R=$W/s34; rm -rf $R; mkdir -p $R
up() { for i in $(seq 180); do curl -sf http://127.0.0.1:$1/health > /dev/null && break; sleep 1; done; }
cd /tmp
M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
for hold in ${ORDER:-0 1 2 3 3 2 1 0}; do
  n=$(ls $R | grep -c "^h") 
  tag=h$hold-$n
  CLLM_EXP_HOLD=$hold python3 -m cllm.serve --model $M --parallel 64 --ctx-size 65536 --flash-attn on --port 8101 > $R/server-$tag.log 2>&1 &
  up 8101
  timeout ${LIMIT:-130} python3 -m cllm.bench --url http://127.0.0.1:8101 --model $M --workload ${WORKLOAD:-structured} --max-tokens 160 --warmup 2 --concurrency 64 --requests ${REQUESTS:-1024} --runs 1 --tag $tag --out $R/$tag > $R/$tag.txt 2>&1
  echo "== hold=$hold ($tag)"
  grep -aE "\] 127|decode runs|tok/s|TTFT" $R/$tag.txt | sed 's/.*\[cllm.bench\]/[cllm.bench]/' | cut -c1-220 | tail -12
  kill $(pgrep -f "m cllm[.]serve") 2>/dev/null; sleep 3
  grep -av "it/s\]\|s/it\]" $R/$tag.txt > $R/s.txt; mv $R/s.txt $R/$tag.txt
done
cp $REPO/.device/exp/s34.sh $R/; rm -f $R/*/*.png $R/server-*.log; tar -czf $OUT/s34.tgz -C $W s34
