#!/bin/bash
# GPU benchmark: cllm and llama-server (same llama.cpp build) alternating on the same machine.
W=/root/w
export CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site CLLM_PEER_BIN=$W/build/bin PYTHONUNBUFFERED=1
export CLLM_LLAMA_SOURCE=$W/llama-src.tar.xz CMAKE_BUILD_PARALLEL_LEVEL=16
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DCLLM_BUILD_PEER=ON"
python3 -m pip install -q --no-build-isolation --no-deps -C build-dir=$W/build . > $W/build.log 2>&1 || { tail -20 $W/build.log; exit 1; }
cd /tmp
python3 -m cllm.bench "$@" --out $OUT 2>&1 | grep -v "^\s*$" | tail -45
