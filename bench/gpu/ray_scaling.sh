#!/bin/bash
# Scale-out on Ray Serve, measured on the GPU machine: one cllm replica per GPU.
#
# Run from the repository root on the device, after the CUDA build (bench/gpu/stage-and-build.sh:
# cllm in the system site, the wheels in $W/site) and bench/gpu/join-model.sh (the model in
# $W/cache), one phase per call, chained while the machine is warm:
#   bash bench/gpu/ray_scaling.sh stage              carry .device/ray/r1  (Ray's wheel, half 1)
#   bash bench/gpu/ray_scaling.sh stage              carry .device/ray/r3  (its dependencies)
#   bash bench/gpu/ray_scaling.sh install            carry .device/ray/r2  (half 2, installs)
#   bash bench/gpu/ray_scaling.sh throughput [GPUS]  1..GPUS replicas at saturating concurrency
#                                 (REPLICA_COUNTS="1 2 4" picks the counts, FRONTS="1 R" the
#                                 front replicas tried with each, R: as many as replicas;
#                                 PLAIN=0 leaves out the plain server; CLIENTS=K drives each
#                                 level from K benchmark processes, each a Kth of the streams;
#                                 CLIENTS_PER_REPLICA=1: K for each replica, as `independent`
#                                 gives each server; with K > 1 each replica's engine step
#                                 split over the level is printed too, from /metrics scraped
#                                 before and after it, metrics-TAG-before/after.txt)
#   bash bench/gpu/ray_scaling.sh independent [GPUS] 1..GPUS plain servers, one per card, no
#                                 Ray, loaded at once: the host's own scaling (PEER=1: llama-server
#                                 of the same build instead, PEER_ARGS and PEER_MODEL; PIN=1:
#                                 each server on PIN_CORES physical cores of its own near its
#                                 card, the benchmark clients on the other cores)
#   bash bench/gpu/ray_scaling.sh prefix             2 replicas: prefix-aware vs random routing
#                                 (DOCUMENTS=N PREFIX_TOKENS=T: the shared-prefix workload over
#                                 N documents of T tokens, default 1 of 1,400; WORKLOADS="sp mt"
#                                 picks shared-prefix, multi-turn or both, ROUTINGS="prefix
#                                 random" the routings)
#   bash bench/gpu/ray_scaling.sh proxy              the plain server vs Ray, one stream
# GPUS defaults to the GPUs nvidia-smi lists. JSON (and each server's log) go to $OUT, with
# watch-TAG.txt for each Ray run: the busiest processes and each replica's running/waiting
# requests every 2-3 s, and py-spy profiles of Ray's proxy, the fronts and the replicas (where
# py-spy is).
# A CPU trial of the same path (SITE: the PYTHONPATH where cllm and Ray are, CACHE: the models):
#   SITE=... CACHE=~/.cache/cllm GPUS=2 SERVE_ARGS="--threads 1 --ctx-size 4096 --parallel 4"
#   PER_REPLICA=4 MAX_TOKENS=8 REQUESTS_PER=2 bash bench/gpu/ray_scaling.sh throughput
set -u
PHASE=${1:?phase: stage, install, throughput, independent, prefix or proxy}
W=${W:-/root/w}
GPUS=${2:-${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}}
OUT=${OUT:-/tmp/ray-scaling}
PY=${PY:-python3}
SERVE_ARGS=${SERVE_ARGS:---parallel 64 --ctx-size 65536 --flash-attn on}
PER_REPLICA=${PER_REPLICA:-64}   # concurrency that saturates one replica (its --parallel)
MAX_TOKENS=${MAX_TOKENS:-128}
REQUESTS_PER=${REQUESTS_PER:-4}  # requests per level, per concurrent stream
FRONTS=${FRONTS:-R}  # R: as many fronts as replicas, the server's default
PEER_ARGS=${PEER_ARGS:--np 64 -c 65536 -fa on -bs}  # PEER=1 independent: llama-server's flags
PY_SPY=${PY_SPY:-$W/site/bin/py-spy}
RAY_WHEEL=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
RAY_SHA256=b951b40965947a63615830916be04f26440d234de1e9a29dbf2155d03fa9ad2a
export CLLM_CACHE_DIR=${CACHE:-$W/cache} PYTHONPATH=${SITE:-$W/site}
CLLM_PEER_BIN=${CLLM_PEER_BIN:-$W/build/bin}
PEER_MODEL=${PEER_MODEL:-$CLLM_CACHE_DIR/models/SmolLM2-135M-Instruct.Q4_1.gguf}
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
mkdir -p "$OUT"
SERVER_PIDS=()

free_port() { $PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# start NAME ARGS...: `python -m cllm.serve` in its own session, from /tmp (the source tree has
# no built extension); sets URL and PID once it serves.
start() {
  local name=$1; shift
  launch "$name" ${SERVER_CPUS:+taskset -c $SERVER_CPUS} $PY -m cllm.serve $SERVE_ARGS "$@"
}

# start_peer NAME: llama-server of the same build (CLLM_PEER_BIN) with PEER_ARGS, as start does.
start_peer() {
  launch "$1" "$CLLM_PEER_BIN/llama-server" -m "$PEER_MODEL" -ngl all \
      --no-webui $PEER_ARGS
}

# launch NAME CMD...: CMD --port P in its own session; sets URL and PID once it serves.
launch() {
  local name=$1; shift
  local port; port=$(free_port)
  (cd /tmp && exec setsid "$@" --port "$port" > "$OUT/$name.log" 2>&1) &
  PID=$!; URL=http://127.0.0.1:$port; SERVER_PIDS+=("$PID")
  local t0; t0=$(date +%s)
  # Under Ray, /health answers once a front and one replica are up; the load waits for every
  # replica (cllm.scaleout.cluster's "serving on"), or its first seconds run on part of them.
  until $PY -c "import urllib.request as u; u.urlopen('$URL/health', timeout=2)" 2>/dev/null \
        && { [[ " $* " != *" --replicas "* ]] || grep -q "serving on" "$OUT/$name.log"; }; do
    if ! kill -0 "$PID" 2>/dev/null || [ $(( $(date +%s) - t0 )) -gt 240 ]; then
      echo "$name did not start:"; tail -20 "$OUT/$name.log"; return 1
    fi
    sleep 1
  done
  echo "$name ready in $(( $(date +%s) - t0 )) s at $URL"
}

# stop PID: SIGTERM to the server process alone (not its group: Ray's own processes must be left
# to its shutdown); what is left after 90 s is ended, Ray's with `ray stop` (this machine runs
# nothing else of Ray).
stop() {
  kill -TERM "$1" 2>/dev/null
  for _ in $(seq 90); do kill -0 "$1" 2>/dev/null || break; sleep 1; done
  if kill -0 "$1" 2>/dev/null; then
    echo "server $1 still up after 90 s: killing it and Ray"
    kill -KILL "$1"; $PY -m ray.scripts.scripts stop --force > /dev/null 2>&1
  fi
}
trap 'for p in "${SERVER_PIDS[@]}"; do stop "$p"; done' EXIT

# bench TAG ARGS...: cllm.bench against $URL (more --url in ARGS), its table's last lines.
bench() {
  local tag=$1; shift
  (cd /tmp && ${CLIENT_CPUS:+taskset -c $CLIENT_CPUS} $PY -m cllm.bench --url "$URL" "$@" \
       --tag "$tag" --out "$OUT") 2>&1 \
      | grep -v "^\s*$" | tail -6  # from /tmp: the source tree has no built extension
}

# watch TAG: while the benchmark runs (until watch_end), the 12 busiest processes and each
# replica's running/waiting requests (from the front's /metrics) every 2-3 s; after 6 s, 8 s of
# py-spy of Ray's proxy, the fronts and the replicas, so a ceiling names its process.
watch() {
  local file="$OUT/watch-$1.txt"
  (while true; do
     echo "== $(date +%T)"; top -c -b -n 2 -d 1 -w 160 | awk '/^top -/{n++} n==2' | sed -n '7,19p'
     $PY -c "import urllib.request as u
print(''.join(l for l in u.urlopen('$URL/metrics', timeout=2).read().decode().splitlines(True)
              if l.startswith(('cllm_requests_running', 'cllm_requests_waiting'))))" 2>&1
     sleep 1
   done > "$file") &
  WATCH_PID=$!
  if [ -x "$PY_SPY" ]; then
    (sleep 6
     for pid in $(pgrep -f "ProxyActor|ServeReplica:cllm:(Front|Engine)"); do
       "$PY_SPY" record --pid "$pid" --duration 8 --rate 200 --format raw --nonblocking \
           --output "$OUT/prof-$1-$pid.txt" > /dev/null 2>&1 &
       echo "$pid $(tr '\0' ' ' < /proc/$pid/cmdline | cut -c1-120)" >> "$OUT/prof-$1-pids.txt"
     done; wait) &
    SPY_PID=$!
  fi
}
watch_end() { kill "$WATCH_PID" 2>/dev/null; wait "${SPY_PID:-}" 2>/dev/null; SPY_PID=; }

# load TAG C ARGS...: C streams of 128-token prompts, REQUESTS_PER requests each, from CLIENTS
# processes at once (tags TAG-k1..), so that one client process is not the ceiling.
load() {
  local tag=$1 c=$2 k=${CLIENTS:-1}; shift 2
  if [ "$k" = 1 ]; then
    bench "$tag" --concurrency "$c" --requests $((c * REQUESTS_PER)) --warmup "$c" \
          --prompt-tokens 128 --max-tokens $MAX_TOKENS "$@"
    return
  fi
  scrape "$tag-before"
  CLIENTS_PIDS=(); start_clients "$tag" "$c" "$k" "$@"
  wait "${CLIENTS_PIDS[@]}"  # not the servers, which are background jobs too
  # Behind a Ray front the replicas report every REPORT_PERIOD: wait for one after the load.
  sleep "$($PY -c 'from cllm.scaleout.ray_app import REPORT_PERIOD; print(REPORT_PERIOD + 1)')"
  scrape "$tag-after"
  aggregate "$tag"
  replica_steps "$tag"
}

# scrape NAME: $URL's /metrics into $OUT/metrics-NAME.txt (behind a Ray front, every replica's,
# labelled by replica), for replica_steps.
scrape() {
  $PY -c "import urllib.request as u, sys
sys.stdout.write(u.urlopen('$URL/metrics', timeout=5).read().decode())" > "$OUT/metrics-$1.txt" 2>/dev/null
}

# replica_steps TAG: each replica's engine step split over the level (calls, rows and forward
# steps a call, graph reuse, ms a call, seconds in calls, tokens made), from the scrapes before
# and after it.
replica_steps() {
  $PY - "$OUT/metrics-$1-before.txt" "$OUT/metrics-$1-after.txt" <<'EOF2'
import sys
from prometheus_client.parser import text_string_to_metric_families
from cllm.engine import steptimer
from cllm.http.metrics import step_timer_counts
def by_replica(path):
    text = open(path).read()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples
               if "replica" in s.labels]
    tokens = {s.labels["replica"]: s.value for s in samples
              if s.name == "cllm_generation_tokens_total"}
    return {n: (step_timer_counts(text, replica=n), tokens.get(n, 0.0))
            for n in sorted({s.labels["replica"] for s in samples})}
before, after = (by_replica(p) for p in sys.argv[1:3])
for name, (counts, tokens) in after.items():
    if counts is None or before.get(name, (None,))[0] is None:
        continue
    s = steptimer.summarize(steptimer.since(counts, before[name][0]))
    ms = sum(v for k, v in s.items() if k.endswith("_ms"))
    print(f"  replica {name}: {s['steps']} calls, {s['rows_per_step']:.1f} rows and "
          f"{s['forward_steps_per_step']:.2f} forward steps a call, graph reused "
          f"{s['graphs_reused_share']:.2f}, {ms:.1f} ms a call, {ms * s['steps'] / 1000:.1f} s "
          f"in calls, {tokens - before[name][1]:.0f} tokens")
EOF2
}

# start_clients TAG C K ARGS...: K benchmark processes against $URL in the background, each with
# a Kth of C streams (tags TAG-k1..TAG-kK) and prompts of its own (--seed: with one seed they
# all sent the same prompt at once, a burst of one routing key); their pids are appended to
# CLIENTS_PIDS.
CLIENTS_PIDS=()
start_clients() {
  local tag=$1 c=$2 k=$3; shift 3
  for i in $(seq "$k"); do
    bench "$tag-k$i" --concurrency $((c / k)) --requests $((c * REQUESTS_PER / k)) \
          --warmup $((c / k)) --prompt-tokens 128 --max-tokens $MAX_TOKENS --seed "$i" "$@" \
          > /dev/null &
    CLIENTS_PIDS+=($!)
  done
}

# aggregate TAG: one line over every client run whose tag starts with TAG-: all their tokens
# over the longest client's time.
aggregate() {
  $PY - "$OUT" "$1" <<'EOF2'
import json, pathlib, sys
runs = [json.loads(p.read_text())["runs"][0]["metrics"]
        for p in pathlib.Path(sys.argv[1]).glob(f"bench-{sys.argv[2]}-*.json")]
tokens = sum(m["total_output_tokens"] for m in runs)
ttfts = ", ".join("%.0f" % m["ttft_ms"]["p50"] for m in runs)
print(f"{sys.argv[2]}: {len(runs)} clients, {tokens / max(m['duration_s'] for m in runs):.1f} "
      f"tok/s (all tokens over the longest client's time), TTFT p50 by client {ttfts} ms")
EOF2
}

# cpu_sets N CORES: N lines, the CPUs of CORES physical cores near each of the first N cards
# (its PCI device's local_cpulist; any CPU where that is unknown), no core given twice; then a
# line of the CPUs left, for the clients.
cpu_sets() {
  $PY - "$1" "$2" <<'EOF'
import os, subprocess, sys
n, per = int(sys.argv[1]), int(sys.argv[2])
usable = os.sched_getaffinity(0)
def cpu_list(text):
    cpus = set()
    for part in text.strip().split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus
def physical_core(cpu):
    topology = f"/sys/devices/system/cpu/cpu{cpu}/topology/"
    return tuple(open(topology + name).read().strip() for name in ("physical_package_id", "core_id"))
buses = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                       capture_output=True, text=True).stdout.split()
taken = set()
for card in range(n):
    path = f"/sys/bus/pci/devices/{buses[card][4:].lower()}/local_cpulist" if card < len(buses) else ""
    near = cpu_list(open(path).read()) & usable if os.path.exists(path) else usable
    cores = {}
    for cpu in sorted(near - taken):
        cores.setdefault(physical_core(cpu), []).append(cpu)
    chosen = [cpu for core in list(cores)[:per] for cpu in cores[core]]
    taken.update(chosen)
    print(",".join(map(str, chosen)))
print(",".join(map(str, sorted(usable - taken))))
EOF
}

summary() {  # one line per server and level of this phase's JSON files
  $PY - "$OUT" "$@" <<'EOF'
import json, sys, pathlib
for path in sorted(pathlib.Path(sys.argv[1]).glob("bench-*.json")):
    d = json.loads(path.read_text())
    if not any(d["tag"].startswith(p) for p in sys.argv[2:]):
        continue
    for r in d["runs"]:
        m = r["metrics"]
        print(f"{d['tag']:<28} {r['server']:<24} c={r['concurrency']:<4} "
              f"{m['output_throughput']:9.1f} tok/s  TTFT p50 {m['ttft_ms']['p50']:8.2f} ms  "
              f"p90 {m['ttft_ms']['p90']:8.2f} ms  failed {m['failed']}")
EOF
}

case $PHASE in
stage)  # the first half of Ray's wheel or its dependencies (whichever folder came), kept in $W
  mkdir -p "$W/ray" || exit 1
  for d in .device/ray/r1 .device/ray/r3; do [ -d "$d" ] && cp "$d"/* "$W/ray/"; done
  ls "$W/ray" | wc -l
  ;;
install)
  cp .device/ray/r2/* "$W/ray/" || exit 1
  cat "$W/ray/ray.whl.part00" "$W/ray/ray.whl.part01" > "$W/ray/$RAY_WHEEL"
  echo "$RAY_SHA256  $W/ray/$RAY_WHEEL" | sha256sum -c || exit 1
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$W/site" "$W"/ray/*.whl || exit 1
  (cd /tmp && $PY -c "import ray, ray.serve, cllm.llama._core; print('ray', ray.__version__)")
  ;;
throughput)  # tokens/s at saturating concurrency: the plain server, then Ray with 1..GPUS
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
  C=$PER_REPLICA
  if [ "${PLAIN:-1}" = 1 ]; then  # PLAIN=0: Ray only
    CUDA_VISIBLE_DEVICES=0 start plain || exit 1  # one card, as a replica has (not split)
    load plain-c$C $C
    stop "$PID"
  fi
  for R in ${REPLICA_COUNTS:-$(seq 1 "$GPUS")}; do
    for F in $(echo "${FRONTS//R/$R}" | tr ' ' '\n' | sort -nu); do
      C=$((PER_REPLICA * R)); TAG=ray-r$R-f$F-c$C
      start $TAG --replicas $R --front-replicas $F || exit 1
      watch $TAG
      CLIENTS=$(( ${CLIENTS:-1} * (${CLIENTS_PER_REPLICA:-0} ? R : 1) )) load $TAG $C
      watch_end
      stop "$PID"
    done
  done
  summary plain- ray-r
  ;;
independent)  # the host's own ceiling: N plain servers, one per card, no Ray, loaded at once
  nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null
  KIND=plain; START=start
  [ "${PEER:-0}" = 1 ] && { KIND=peer; START=start_peer; }  # llama-server instead of cllm
  if [ "${PIN:-0}" = 1 ]; then
    KIND=$KIND-pinned; { nvidia-smi topo -m; lscpu -e; } > "$OUT/topology.txt" 2>&1
  fi
  for N in ${REPLICA_COUNTS:-$(seq 1 "$GPUS")}; do
    URLS=(); PIDS=(); SETS=()
    [ "${PIN:-0}" = 1 ] && mapfile -t SETS < <(cpu_sets "$N" "${PIN_CORES:-4}")
    for g in $(seq 0 $((N - 1))); do
      SERVER_CPUS=${SETS[g]:-} CUDA_VISIBLE_DEVICES=$g $START $KIND-n$N-g$g || exit 1
      URLS+=("$URL"); PIDS+=("$PID")
      [ -n "${SETS[g]:-}" ] && echo "$KIND-n$N-g$g on CPUs ${SETS[g]}"
    done
    CLIENTS_PIDS=()
    for g in $(seq 0 $((N - 1))); do
      CLIENT_CPUS=${SETS[N]:-} URL=${URLS[g]} start_clients $KIND-n$N-g$g "$PER_REPLICA" "${CLIENTS:-1}"
    done
    wait "${CLIENTS_PIDS[@]}"
    aggregate $KIND-n$N
    for p in "${PIDS[@]}"; do stop "$p"; done
  done
  ;;
prefix)  # shared-prefix and multi-turn on 2 replicas, each routing on fresh caches
  SHARE=(); [ "$GPUS" = 1 ] && SHARE=(--gpus-per-replica 0.5)  # one card: both on it
  # on_fresh_replicas WORKLOAD ROUTING BENCH_ARGS...: 2 new replicas, the workload if WORKLOADS
  # names it, then down again (each routing starts from empty caches).
  on_fresh_replicas() {
    local workload=$1 routing=$2; shift 2
    [[ " ${WORKLOADS:-sp mt} " == *" $workload "* ]] || return 0
    start $workload-$routing --replicas 2 --routing $routing "${SHARE[@]}" || exit 1
    bench $workload-$routing --concurrency $((PER_REPLICA / 2)) --warmup 0 "$@"
    stop "$PID"
  }
  for routing in ${ROUTINGS:-prefix random}; do
    on_fresh_replicas sp $routing --workload shared-prefix --max-tokens 32 \
        --requests $((PER_REPLICA * REQUESTS_PER / 2)) \
        --documents "${DOCUMENTS:-1}" --prefix-tokens "${PREFIX_TOKENS:-1400}"
    on_fresh_replicas mt $routing --workload multi-turn --turns 6 --max-tokens 48 \
        --requests $((PER_REPLICA * REQUESTS_PER))
  done
  summary sp- mt-
  ;;
proxy)  # TTFT at one stream, the plain server and Ray (1 replica) measured in turn
  if [ "$GPUS" -ge 2 ]; then  # side by side on two identical cards
    CUDA_VISIBLE_DEVICES=0 start plain1 || exit 1; PLAIN=$URL; PLAIN_PID=$PID
    CUDA_VISIBLE_DEVICES=1 start ray1 --replicas 1 || exit 1
    echo "plain server: $PLAIN, Ray: $URL"
    bench proxy-c1 --url "$PLAIN" --concurrency 1 --requests 64 --warmup 8 --max-tokens 16
    stop "$PID"; stop "$PLAIN_PID"
  else  # one card: one after the other
    export CUDA_VISIBLE_DEVICES=0
    start plain1 || exit 1
    bench proxy-plain-c1 --concurrency 1 --requests 64 --warmup 8 --max-tokens 16
    stop "$PID"
    start ray1 --replicas 1 || exit 1
    bench proxy-ray-c1 --concurrency 1 --requests 64 --warmup 8 --max-tokens 16
    stop "$PID"
  fi
  summary proxy-
  ;;
*) echo "unknown phase $PHASE"; exit 2 ;;
esac
