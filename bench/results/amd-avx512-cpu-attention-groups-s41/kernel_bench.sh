#!/bin/bash
# Times the patch's attention kernels at REV (default HEAD) against the pinned llama.cpp's
# headers, one thread: bash kernel_bench.sh [REV] [extra g++ flags, e.g. -mavx2 -mfma -mf16c].
# Needs the cached source (~/.cache/cllm/llama.cpp-0c1e57098, unpacked by `pip install .`).
set -e
REV=${1:-HEAD}; shift || true
FLAGS=${*:--march=native}
SRC=${CLLM_LLAMA_TREE:-$HOME/.cache/cllm/llama.cpp-0c1e57098}
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(git -C "$HERE" rev-parse --show-toplevel)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# The kernels: the patch's added lines from its AVX2 guard to CLLM_FA_BLOCKED.
git -C "$REPO" show "$REV:vendor/patches/ggml-cpu-flash-attn-blocks.patch" \
    | sed -n 's/^+//p' | sed -n '/^#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)/,/^#define CLLM_FA_BLOCKED 1/p' \
    > "$WORK/kernel.inc"
echo '#endif' >> "$WORK/kernel.inc"
grep -q cllm_fa_row_f16 "$WORK/kernel.inc" && FLAGS="$FLAGS -DROW_KERNEL"
g++ -O3 -std=c++17 $FLAGS -I"$WORK" -I"$SRC/ggml/include" -I"$SRC/ggml/src" -I"$SRC/ggml/src/ggml-cpu" \
    -o "$WORK/kernel_bench" "$HERE/kernel_bench.cpp"
for shape in "64 9 3 12" "64 9 3 1" "80 8 2 12" "96 8 2 12" "128 8 2 12" "256 4 1 12" "256 4 1 1"; do
    "$WORK/kernel_bench" $shape 1446
done
