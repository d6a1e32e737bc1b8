#!/bin/bash
# Run once for each part of SmolLM2-135M brought to the machine (.device/m1, m2, m3): stages it;
# the run that finds all three joins them into cllm's cache, stamped as cllm.models expects.
# The model comes in three parts of about 33 MB, each small enough to travel beside the tree.
W=/root/w; mkdir -p $W/cache/models
for part in .device/m*/part0*; do [ -f "$part" ] && cp "$part" $W/; done
ls -la $W/part0* 2>/dev/null
if [ -f $W/part00 ] && [ -f $W/part01 ] && [ -f $W/part02 ]; then
  f=$W/cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
  cat $W/part00 $W/part01 $W/part02 > $f
  echo "$(sha256sum $f | cut -d' ' -f1) $(stat -c %s $f)" > $f.sha256
  echo "model sha256 $(cut -d' ' -f1 $f.sha256)"
fi
