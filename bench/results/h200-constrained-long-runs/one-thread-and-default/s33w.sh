#!/bin/bash
# Session 33, the lease's last minutes: one more 1,024-request run each of the default server
# (LLExecutor on 8 threads) and of one with 1 thread, one server at a time on the card.
W=/root/w; REPO=$PWD
export CLLM_CACHE_DIR=$W/cache PYTHONUNBUFFERED=1
R=$W/s33w; rm -rf $R; mkdir -p $R
up() { for i in $(seq 180); do curl -sf http://127.0.0.1:$1/health > /dev/null && break; sleep 1; done; }
M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
cd /tmp
for v in t1 t8; do
  P=$W/site; [ $v = t1 ] && P=$W/v-t1:$W/site
  PYTHONPATH=$P python3 -m cllm.serve --model $M --parallel 64 --ctx-size 65536 --flash-attn on --port 8101 > $R/$v.log 2>&1 &
  pid=$!; up 8101
  PYTHONPATH=$W/site timeout 90 python3 -m cllm.bench --url http://127.0.0.1:8101 --model $M --workload structured --max-tokens 160 --warmup 2 --concurrency 64 --requests 1024 --runs 1 --tag $v --out $R > $R/$v.txt 2>&1
  grep -aE "\] 127|decode runs" $R/$v.txt | sed "s/.*\[cllm.bench\]/[$v]/" | cut -c1-160
  kill $pid; sleep 3
done
for f in $R/t*.txt; do grep -av "it/s\]\|s/it\]" $f > $f.x; mv $f.x $f; done
cp $REPO/.device/exp/s33w.sh $R/; rm -f $R/*.png $R/*.log; tar -czf $OUT/s33w.tgz -C $W s33w
