#!/bin/bash
# Session 36, call H: the 8B shape at 1 and 8 streams against llama-server, llama-batched-bench
# TG at every level, and the table.
W=/root/w; REAL_OUT=$OUT
export OUT=$W/out
LEVELS="1 8" bash bench/gpu/model_sizes.sh bench llama-3.1-8b
LEVELS="1 8 64 128" bash bench/gpu/model_sizes.sh batched llama-3.1-8b
bash bench/gpu/model_sizes.sh summary | tee $OUT/model-sizes/summary.md
rm -f $OUT/*/*/*.png
tar -czf $REAL_OUT/s36h.tgz -C $W out
