#!/usr/bin/env bash
# /proc/stat's CPU time split over one benchmark command: user nice system idle iowait irq softirq steal (jiffies).
a=($(head -1 /proc/stat)); ctx1=$(awk '/^ctxt/{print $2}' /proc/stat); intr1=$(awk '/^intr/{print $2}' /proc/stat)
"$@" 2>&1 | grep -o "\[cllm.bench\] [^\[]*tok/s" 
b=($(head -1 /proc/stat)); ctx2=$(awk '/^ctxt/{print $2}' /proc/stat); intr2=$(awk '/^intr/{print $2}' /proc/stat)
echo "user $((b[1]-a[1])) nice $((b[2]-a[2])) system $((b[3]-a[3])) idle $((b[4]-a[4])) iowait $((b[5]-a[5])) irq $((b[6]-a[6])) softirq $((b[7]-a[7])) steal $((b[8]-a[8])) ctxt $((ctx2-ctx1)) intr $((intr2-intr1))"
