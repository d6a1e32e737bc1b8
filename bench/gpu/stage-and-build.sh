#!/bin/bash
# Device call 1 (carry .device/m1 .device/llama-src.tar.xz): stage the model's first half and llama.cpp source; build cllm (CUDA) and
# llama-server/llama-batched-bench from the same ggml in one CMake tree.
set -x
W=/root/w; mkdir -p $W/cache/models
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 --version; nproc
cp .device/m1/part00 $W/ && cp .device/llama-src.tar.xz $W/
export CLLM_LLAMA_SOURCE=$W/llama-src.tar.xz
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DCLLM_BUILD_PEER=ON"
export CMAKE_BUILD_PARALLEL_LEVEL=16
start=$(date +%s)
setsid nohup bash -c "python3 -m pip install --no-build-isolation --no-deps -v -C build-dir=$W/build . > $W/build.log 2>&1; echo \$? > $W/build.rc" > /dev/null 2>&1 &
while [ ! -f $W/build.rc ] && [ $(( $(date +%s) - start )) -lt 540 ]; do sleep 5; done
echo "build seconds: $(( $(date +%s) - start )) rc=$(cat $W/build.rc 2>/dev/null)"
tail -5 $W/build.log
ls -la $W/build/bin/ 2>/dev/null
cp $W/build.log $OUT/ 2>/dev/null
