#!/bin/bash
# Next session (nvidia-h200), after stage-and-build.sh and `carry.sh take` (model chunks:
# `bash bench/gpu/carry.sh split .device/m1 .device/m2 .device/m3`, 4 calls):
#   bash .device/exp/s33.sh fill      bench/probe_mask_fill.py on the host (no server, ~30 s);
#   bash .device/exp/s33.sh threads   LLExecutor's threads for the masks, 1 / 4 / 8 (the default
#                                     on a 16-core host), three servers on the card alternated;
#   bash .device/exp/s33.sh early     (tree built with s33-stage-early.patch) the masked choice
#                                     staged while the step decodes, against after it;
#   bash .device/exp/s33.sh switch    the GIL switch interval 1 ms against 5, two servers swapped;
#   bash .device/exp/s33.sh 1b        (after `bash bench/gpu/model_sizes.sh make llama-3.2-1b`,
#                                     carrying .device/gpu14) the 1B shape (128k vocabulary):
#                                     engine probe and HTTP, the build against a16b29e's
#                                     structured.py/engine.py (structured_base.py, engine_base.py).
W=/root/w; REPO=$PWD
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site PYTHONUNBUFFERED=1
export CLLM_EXP_EARLY_STAGING=0  # the patch's switch: off but in `early`, which sets it a server
R=$W/s33-$1; rm -rf $R; mkdir -p $R
up() { for p in "$@"; do for i in $(seq 180); do curl -sf http://127.0.0.1:$p/health > /dev/null && break; sleep 1; done; done; }
PKG=$(cd /tmp && python3 -c "import cllm, os; print(os.path.dirname(cllm.__file__))")
variant() {  # variant NAME FILE-EDITS...: a copy of the installed package in $W/v-NAME
  rm -rf $W/v-$1; mkdir -p $W/v-$1 && cp -r $PKG $W/v-$1/cllm; local d=$W/v-$1/cllm; shift; eval "$@"; }
cd /tmp
case $1 in
fill)  # no server: the fill alone and beside busy Python, one call on 1..16 threads
  M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
  timeout 200 python3 $REPO/bench/probe_mask_fill.py --model $M --threads 1 2 4 8 16 | tee $R/fill.txt
  ;;
threads)
  M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf; S="--model $M --parallel 64 --ctx-size 65536 --flash-attn on"
  for n in 1 4; do variant t$n "sed -i 's/return max(1, min(8, (os.cpu_count() or 2) \/\/ 2))/return $n/' \$d/engine.py"; grep -n "^    return $n$" $W/v-t$n/cllm/engine.py; done
  python3 -m cllm.serve $S --port 8101 > $R/t8.log 2>&1 &
  PYTHONPATH=$W/v-t1:$W/site python3 -m cllm.serve $S --port 8102 > $R/t1.log 2>&1 &
  PYTHONPATH=$W/v-t4:$W/site python3 -m cllm.serve $S --port 8103 > $R/t4.log 2>&1 &
  up 8101 8102 8103
  timeout 500 python3 -m cllm.bench --url http://127.0.0.1:8101 --url http://127.0.0.1:8102 --url http://127.0.0.1:8103 --model $M --workload structured --max-tokens 160 --warmup 2 --concurrency 64 --requests 384 --runs 2 --tag threads --out $R > $R/structured.txt 2>&1
  ;;
early)  # needs the build of a tree with s33-stage-early.patch applied: the masked choice staged
        # while the step decodes (CLLM_EXP_EARLY_STAGING=1) or after it (0), two servers, swapped
  M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf; S="--model $M --parallel 64 --ctx-size 65536 --flash-attn on"
  for round in 1 2; do
    a=1; b=0; [ $round = 2 ] && { a=0; b=1; }
    CLLM_EXP_EARLY_STAGING=$a python3 -m cllm.serve $S --port 8101 > $R/early$a-r$round.log 2>&1 &
    CLLM_EXP_EARLY_STAGING=$b python3 -m cllm.serve $S --port 8102 > $R/early$b-r$round.log 2>&1 &
    up 8101 8102
    echo "round $round: 8101 early=$a, 8102 early=$b"
    timeout 250 python3 -m cllm.bench --url http://127.0.0.1:8101 --url http://127.0.0.1:8102 --model $M --workload structured --max-tokens 160 --warmup 2 --concurrency 64 --requests 512 --runs 1 --tag early-r$round --out $R >> $R/structured.txt 2>&1
    kill $(pgrep -f "m cllm[.]serve") 2>/dev/null; sleep 3
  done
  ;;
switch)  # Python's GIL switch interval 1 ms (a sitecustomize) against its 5 ms, now that a
         # constrained step takes the GIL back a few times, not once a row: schema workload
  M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf; S="--model $M --parallel 64 --ctx-size 65536 --flash-attn on"
  mkdir -p $W/sw1 && echo "import sys; sys.setswitchinterval(0.001)" > $W/sw1/sitecustomize.py
  for round in 1 2; do
    a=$W/sw1:$W/site; b=$W/site; [ $round = 2 ] && { a=$W/site; b=$W/sw1:$W/site; }
    PYTHONPATH=$a python3 -m cllm.serve $S --port 8101 > $R/a-r$round.log 2>&1 &
    PYTHONPATH=$b python3 -m cllm.serve $S --port 8102 > $R/b-r$round.log 2>&1 &
    up 8101 8102
    echo "round $round: 8101 PYTHONPATH=$a, 8102 PYTHONPATH=$b"
    timeout 250 python3 -m cllm.bench --url http://127.0.0.1:8101 --url http://127.0.0.1:8102 --model $M --workload structured --max-tokens 160 --warmup 2 --concurrency 64 --requests 512 --runs 1 --tag switch-r$round --out $R >> $R/structured.txt 2>&1
    kill $(pgrep -f "m cllm[.]serve") 2>/dev/null; sleep 3
  done
  ;;
1b)
  M=$W/cache/models/llama-3.2-1b-q4_k_m.gguf; ls -la $M || exit 1
  variant base "cp $REPO/.device/exp/structured_base.py \$d/structured.py && cp $REPO/.device/exp/engine_base.py \$d/engine.py"
  for v in new base; do
    P=$W/site; [ $v = base ] && P=$W/v-base:$W/site
    PYTHONPATH=$P timeout 200 python3 $REPO/bench/probe_structured_step.py --model $M --levels 64 --kv-unified > $R/probe-$v.txt 2>&1; tail -3 $R/probe-$v.txt
  done
  S="--model $M --parallel 64 --ctx-size 65536 --flash-attn on"
  python3 -m cllm.serve $S --port 8101 > $R/new.log 2>&1 &
  PYTHONPATH=$W/v-base:$W/site python3 -m cllm.serve $S --port 8102 > $R/base.log 2>&1 &
  up 8101 8102
  timeout 380 python3 -m cllm.bench --url http://127.0.0.1:8101 --url http://127.0.0.1:8102 --model $M --workload structured --max-tokens 160 --warmup 2 --concurrency 64 --requests 384 --runs 2 --tag 1b --out $R > $R/structured.txt 2>&1
  ;;
esac
grep -aE "\] 127|decode runs" $R/structured.txt | sed 's/.*\[cllm.bench\]/[cllm.bench]/' | cut -c1-200
kill $(pgrep -f "m cllm[.]serve") 2>/dev/null; sleep 2
cp $REPO/.device/exp/s33.sh $R/; rm -f $R/*.png $R/*.log; tar -czf $OUT/s33-$1.tgz -C $W s33-$1
