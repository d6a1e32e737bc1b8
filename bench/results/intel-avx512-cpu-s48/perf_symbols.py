import subprocess, bisect, collections, sys
B='/work/main/build/cp311-cp311-linux_x86_64/_core.cpython-311-x86_64-linux-gnu.so'
syms=[]
for l in subprocess.run(['nm','-C','--defined-only',B],capture_output=True,text=True).stdout.splitlines():
    p=l.split(' ',2)
    if len(p)==3 and p[1].lower() in 'tw': syms.append((int(p[0],16),p[2]))
syms.sort(); addrs=[a for a,_ in syms]
out=subprocess.run(['perf','report','-i',sys.argv[1],'--no-children','--sort','dso,symbol','--stdio','-g','none'],capture_output=True,text=True).stdout
c=collections.Counter()
for l in out.splitlines():
    l=l.strip()
    if not l or l[0]=='#' or '%' not in l: continue
    parts=l.split()
    pct=float(parts[0].rstrip('%')); dso=parts[1]; sym=parts[3]
    if '_core' in dso and sym.startswith('0x'):
        a=int(sym,16); i=bisect.bisect_right(addrs,a)-1
        c[syms[i][1][:100] if i>=0 else '?']+=pct
    else: c[(dso+' '+' '.join(parts[3:]))[:100]]+=pct
for k,v in c.most_common(int(sys.argv[2]) if len(sys.argv)>2 else 12): print(f"{v:6.2f} {k}")
