#!/bin/bash
# A/B of the GIL switch interval on the GPU machine: cllm alone at 64 streams, 50 tokens,
# streamed and not, Python's 5 ms against cllm's default, each twice, alternating.
W=/root/w
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site PYTHONUNBUFFERED=1
cd /tmp
for rep in 1 2; do
  for ms in 5 0.5; do
    for stream in --stream --no-stream; do
      CLLM_GIL_SWITCH_MS=$ms python3 -m cllm.bench --cllm --concurrency 64 --requests 128 \
          --max-tokens 50 --parallel 128 --ctx-size 65536 --warmup 8 $stream --out /tmp/ab 2>&1 \
        | grep -E "^\[cllm.bench\] cllm c=" | sed "s/^/gil_switch_ms=$ms $stream rep=$rep: /"
    done
  done
done
