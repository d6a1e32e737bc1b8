"""Per-thread context switches and CPU of a process between two snapshots: threads.py PID SECONDS"""
import os, sys, time
def snap(pid):
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            comm = open(f"/proc/{pid}/task/{tid}/comm").read().strip()
            st = open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()
            cpu = (int(st[11]) + int(st[12]))
            status = dict(l.split(":\t") for l in open(f"/proc/{pid}/task/{tid}/status").read().splitlines() if ":\t" in l)
            out[tid] = (comm, cpu, int(status["voluntary_ctxt_switches"]), int(status["nonvoluntary_ctxt_switches"]))
        except FileNotFoundError:
            pass
    return out
pid, secs = int(sys.argv[1]), float(sys.argv[2])
a = snap(pid); time.sleep(secs); b = snap(pid)
for tid, (comm, cpu, v, nv) in sorted(b.items(), key=lambda kv: -(kv[1][2] + kv[1][3] - a.get(kv[0], (0, 0, 0, 0))[2] - a.get(kv[0], (0, 0, 0, 0))[3])):
    c0, cpu0, v0, nv0 = a.get(tid, (comm, 0, 0, 0))
    if v - v0 + nv - nv0 + cpu - cpu0:
        print(f"{tid:>8} {comm:<16} cpu {cpu - cpu0:5d} ticks  vol {v - v0:6d}  invol {nv - nv0:6d}")
