#!/bin/bash
# Session 36, call F: the GPU tests (the device's "no token" path first), then SmolLM2-135M at
# 64 streams over HTTP against llama-batched-bench TG and against llama-server at its best flags.
W=/root/w
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site PYTHONUNBUFFERED=1 CLLM_PEER_BIN=$W/build/bin
R=$W/out/s36; mkdir -p $R; REAL_OUT=$OUT
nvidia-smi --query-gpu=name --format=csv,noheader; lscpu | grep "Model name"
timeout 120 pytest -q -p no:cacheprovider tests/test_structured.py -k fails_while_generating 2>&1 | tail -4 | tee $R/gpu-test-fails-while-generating.txt
timeout 200 pytest -q -p no:cacheprovider tests/test_core.py tests/test_engine.py tests/test_structured.py -k "not gemma and not sliding" > $R/gpu-tests.txt 2>&1; tail -4 $R/gpu-tests.txt
M=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=$R bash bench/gpu/http_vs_engine.sh $M
cd /tmp
timeout 200 python3 -m cllm.bench --cllm --peer llama-server --peer-kv split unified --peer-args=-bs \
  --model $M --concurrency 64 --parallel 64 --ctx-size 65536 --flash-attn on --max-tokens 256 \
  --requests 384 --warmup 4 --tag 135m-c64 --out $R/135m-peer > $R/135m-peer.txt 2>&1
grep -aE "\[cllm.bench\] (cllm|llama-server)[-a-z]* c=|^ *(cllm|llama-server)" $R/135m-peer.txt | sed 's/.*\[cllm.bench\]/[cllm.bench]/'
rm -f $R/*/*.png $R/*/*/*.png
tar -czf $REAL_OUT/s36f.tgz -C $W/out s36
