#!/bin/bash
# Session 36, call G: the Llama-3.1-8B shape at 64 streams over HTTP against TG, then against
# llama-server at 64 and 128 streams (model_sizes.sh bench).
W=/root/w; REAL_OUT=$OUT
export OUT=$W/out
REQUESTS=256 bash bench/gpu/http_vs_engine.sh $W/models/llama-3.1-8b-q4_k_m.gguf
LEVELS="${LEVELS:-64 128}" bash bench/gpu/model_sizes.sh bench llama-3.1-8b
rm -f $OUT/*/*/*.png
tar -czf $REAL_OUT/s36g.tgz -C $W out
