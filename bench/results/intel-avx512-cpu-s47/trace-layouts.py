import sys, collections, statistics
fn=sys.argv[1]
d=collections.defaultdict(list)
for l in open(fn):
    p=l.split()
    if not p or p[0]!='step': continue
    try: fwd, ms, rows, runs = int(p[2]), float(p[3]), int(p[4]), int(p[5])
    except: continue
    if 14<=rows<=16:
        ids=tuple(map(int,p[7:]))
        runs_=[]; start=ids[0]; prev=ids[0]
        for x in ids[1:]:
            if x!=prev+1: runs_.append((start,prev)); start=x
            prev=x
        runs_.append((start,prev))
        d[tuple(runs_)].append(ms/fwd)
for k,v in sorted(d.items(), key=lambda kv:-len(kv[1]))[:25]:
    print(k, len(v), 'median %.1f'%statistics.median(v))
