import sys, re, collections
v=sys.argv[1]
rows=[]
for l in open(f'/tmp/pf/{v}.txt'):
    m=re.match(r'\s*([\d.]+):\s+\S+\s+(.*?)\s+\((.*)\)\s*$', l)
    if m: rows.append((float(m.group(1)), m.group(2), m.group(3)))
last_fb=max(t for t,s,d in rows if 'fbgemm' in s)
win=[(s,d) for t,s,d in rows if t>last_fb]
c=collections.Counter()
for s,d in win:
    s=re.sub(r'\+0x[0-9a-f]+$','',s)
    key = 'sgemm' if 'sgemm' in s else ('clear_page' if 'clear_page' in s else (s[:70] if 'libtorch' in d or 'libc' in d else d.split('/')[-1]))
    c[key]+=1
n=len(win)
print(f'# {v}: samples of both ranks after the step-2 rollout (the update and the final save), perf record -F 499')
print('total', n)
for k,x in c.most_common(20): print(f'{x:6d} {100*x/n:5.1f}% {k}')
