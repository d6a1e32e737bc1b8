#!/bin/bash
# Staging folders that no longer fit beside the working tree, in chunks: a device call carries
# 64 MiB with the tree, so the model's 32 MiB parts
# (.device/m1-m3) and Ray's 38 MiB halves (.device/ray/r1-r3) go as 21 MiB chunks instead.
#
#   bash bench/gpu/carry.sh split [FOLDER...]  here: tar the folders (default: .device/m1 m2 m3
#                                             and .device/ray) into .device/k0, k1, ... one
#                                             chunk each, with the count
#   bash bench/gpu/carry.sh take               on the device, one call per chunk, carrying
#                                             .device/kN: keeps it in /root/w/chunks; the call
#                                             that completes the set unpacks it, joins the
#                                             model (join-model.sh) and installs Ray
#                                             (ray_scaling.sh stage, install) if it came
set -u
W=${W:-/root/w}
CHUNK=${CHUNK:-21M}
REPO=$PWD
case ${1:?split or take} in
split)
  shift
  folders=${*:-.device/m1 .device/m2 .device/m3 .device/ray}
  rm -rf .device/k[0-9]* /tmp/cllm-chunks && mkdir -p /tmp/cllm-chunks
  tar -cf - $folders | split -b "$CHUNK" -d - /tmp/cllm-chunks/chunk
  n=$(ls /tmp/cllm-chunks | wc -l)
  for i in $(seq 0 $((n - 1))); do
    mkdir -p .device/k$i && mv /tmp/cllm-chunks/chunk$(printf %02d $i) .device/k$i/ && echo "$n" > .device/k$i/total
  done
  echo "$n chunks: carry .device/k0 .. .device/k$((n - 1)), one a call"
  ;;
take)
  mkdir -p $W/chunks && cp .device/k[0-9]*/chunk* $W/chunks/ || exit 1
  n=$(cat .device/k[0-9]*/total | head -1); have=$(ls $W/chunks | wc -l)
  echo "$(ls .device/k[0-9]*/chunk*): $have of $n chunks"
  [ "$have" -lt "$n" ] && exit 0
  rm -rf $W/stg && mkdir -p $W/stg && cat $W/chunks/chunk* | tar -xf - -C $W/stg || exit 1
  cd $W/stg || exit 1
  ls -d .device/m* > /dev/null 2>&1 && bash $REPO/bench/gpu/join-model.sh | tail -1
  if [ -d .device/ray ]; then
    W=$W bash $REPO/bench/gpu/ray_scaling.sh stage > /dev/null && W=$W bash $REPO/bench/gpu/ray_scaling.sh install
  fi
  ;;
*) echo "unknown phase $1"; exit 2 ;;
esac
