#!/bin/bash
# Device call 2 (carry .device/m2 .device/whl): the wheels its Python lacks, finish the build (incremental), join the model, place it in cllm's cache.
W=/root/w
ls $W >/dev/null || exit 1
cp .device/m2/part01 $W/ 2>/dev/null
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target $W/site .device/whl/*.whl || exit 1
if [ -f $W/part00 ] && [ -f $W/part01 ]; then
  cat $W/part00 $W/part01 > $W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
  sha=$(sha256sum $W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf | cut -d' ' -f1)
  size=$(stat -c %s $W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf)
  echo "$sha $size" > $W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf.sha256
  echo "model sha256 $sha"
fi
export CLLM_LLAMA_SOURCE=$W/llama-src.tar.xz
export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90 -DCLLM_BUILD_PEER=ON"
export CMAKE_BUILD_PARALLEL_LEVEL=16
start=$(date +%s); rm -f $W/build.rc
setsid nohup bash -c "python3 -m pip install --no-build-isolation --no-deps -v -C build-dir=$W/build . > $W/build.log 2>&1; echo \$? > $W/build.rc" > /dev/null 2>&1 &
while [ ! -f $W/build.rc ] && [ $(( $(date +%s) - start )) -lt 540 ]; do sleep 3; done
echo "build seconds: $(( $(date +%s) - start )) rc=$(cat $W/build.rc 2>/dev/null)"
grep -E "CMake Error|error:" $W/build.log | head -5; tail -2 $W/build.log
ls -la $W/build/bin/ 2>/dev/null
cd /tmp && CLLM_CACHE_DIR=$W/cache PYTHONPATH=$W/site python3 -c "
from cllm import _core; print(_core.system_info()); print('gpu offload', _core.supports_gpu_offload())"
