#!/bin/bash
# Ray replica niceness under a competing CPU load: Ray's default (15) against the server's (0).
cd /work/main
port=8731
for nice in 15 0; do
  RAY_worker_niceness=$nice python -m cllm.serve --replicas 1 --threads 2 --parallel 8 --ctx-size 4096 --port $port > /tmp/nice/serve-$nice.log 2>&1 &
  SP=$!
  until grep -q "serving on" /tmp/nice/serve-$nice.log; do sleep 2; kill -0 $SP || exit 1; done
  ps -eo pid,ni,comm,args | grep "ServeReplica:cllm" | grep -v grep | awk '{print "niceness", $2, $5}' >> /tmp/nice/ps.txt
  python -m cllm.bench --url http://127.0.0.1:$port --concurrency 4 --requests 24 --max-tokens 32 --warmup 2 --out /tmp/nice --tag quiet-nice$nice > /tmp/nice/quiet-$nice.log 2>&1
  for i in 1 2; do python -c "while True: pass" & done
  python -m cllm.bench --url http://127.0.0.1:$port --concurrency 4 --requests 24 --max-tokens 32 --warmup 2 --timeout 300 --out /tmp/nice --tag busy-nice$nice > /tmp/nice/busy-$nice.log 2>&1
  pkill -f "while True: pass"
  kill -TERM $SP; wait $SP
  sleep 5
done
