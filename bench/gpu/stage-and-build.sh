#!/bin/bash
# Device call 1 (carry .device/llama-src.tar.xz .device/whl): the wheels its Python lacks into
# /root/w/site, llama.cpp's source, and one CMake tree that builds cllm (CUDA) and
# llama-server, llama-batched-bench and llama-quantize from the same ggml (~4 min; PEER=OFF
# builds cllm alone, for runs that need no peer, such as ray_scaling.sh throughput).
set -x
W=/root/w; mkdir -p $W/cache/models
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 --version; nproc
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target $W/site .device/whl/*.whl || exit 1
cp .device/llama-src.tar.xz $W/ || exit 1
export CLLM_LLAMA_SOURCE=$W/llama-src.tar.xz
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DCLLM_BUILD_PEER=${PEER:-ON}"
export CMAKE_BUILD_PARALLEL_LEVEL=16
start=$(date +%s)
setsid nohup bash -c "python3 -m pip install --no-build-isolation --no-deps -v -C build-dir=$W/build . > $W/build.log 2>&1; echo \$? > $W/build.rc" > /dev/null 2>&1 &
while [ ! -f $W/build.rc ] && [ $(( $(date +%s) - start )) -lt 540 ]; do sleep 5; done
echo "build seconds: $(( $(date +%s) - start )) rc=$(cat $W/build.rc 2>/dev/null)"
tail -5 $W/build.log
ls -la $W/build/bin/ 2>/dev/null
cp $W/build.log $OUT/ 2>/dev/null
