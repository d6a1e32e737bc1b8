#!/usr/bin/env bash
# Per-thread context switches of the server on port $1 over one level of 144 requests at 32
# streams: bash sw.sh PORT [OUT_DIR]. Threads with over 5 s of CPU in the level are printed.
set -u
P=$(pgrep -f "port $1" | head -1)
before=$(mktemp) after=$(mktemp)
snap() { for t in /proc/$P/task/*; do echo "$(basename $t) $(grep -E '^(voluntary|nonvoluntary)_ctxt' $t/status | awk '{print $2}' | tr '\n' ' ') $(awk '{print $14+$15}' $t/stat)"; done; }
snap > "$before"
python -m cllm.bench --url http://127.0.0.1:$1 --threads 2 --max-tokens 50 --concurrency 32 --requests 144 --warmup 2 --out "${2:-.}" --tag sw-$1 2>&1 | grep -o "\[cllm.bench\] [^\[]*" | grep -v "^\[cllm.bench\] *$" | tr '\n' ' '
echo
snap > "$after"
join "$before" "$after" | awk -v port=$1 '{dc=$7-$4; if (dc>500) print "port",port,"tid",$1,"vol",$5-$2,"invol",$6-$3,"cpu_ticks",dc}'
rm -f "$before" "$after"
