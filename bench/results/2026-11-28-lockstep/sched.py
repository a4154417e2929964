# Poll /proc schedstat of every bench_fsdp thread; report per-thread on-cpu, runqueue-wait, and wall,
# over the window between 35% and 95% of the run, plus machine steal.
import os, sys, time, subprocess, json
cmd = sys.argv[1:]
p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
samples = []  # (t, {tid: (comm, oncpu, wait)}, steal)
def steal():
    f = open('/proc/stat').readline().split()
    return int(f[8])  # jiffies
while p.poll() is None:
    snap = {}
    for pid in os.listdir('/proc'):
        if not pid.isdigit(): continue
        try:
            if open(f'/proc/{pid}/comm').read().strip() != 'bench_fsdp': continue
            for tid in os.listdir(f'/proc/{pid}/task'):
                s = open(f'/proc/{pid}/task/{tid}/schedstat').read().split()
                c = open(f'/proc/{pid}/task/{tid}/comm').read().strip()
                snap[(pid, tid)] = (c, int(s[0]), int(s[1]))
        except (FileNotFoundError, ProcessLookupError):
            pass
    samples.append((time.time(), snap, steal()))
    time.sleep(0.2)
out = p.stdout.read()
print(''.join(l + '\n' for l in out.splitlines() if 'median' in l), end='')
samples = [s for s in samples if s[1]]
t0, t1 = samples[0][0], samples[-1][0]
A = min(samples, key=lambda s: abs(s[0] - (t0 + 0.35 * (t1 - t0))))
B = min(samples, key=lambda s: abs(s[0] - (t0 + 0.95 * (t1 - t0))))
W = B[0] - A[0]
print(f'window {W:.1f}s  steal {(B[2]-A[2])/100/W*100:.1f}% of one cpu')
for k, (c, oc, wt) in sorted(B[1].items()):
    if k not in A[1]: continue
    d_on = (oc - A[1][k][1]) / 1e9 / W; d_w = (wt - A[1][k][2]) / 1e9 / W
    if d_on + d_w < 0.005: continue
    print(f'  pid {k[0]} tid {k[1]} {c:<16} on-cpu {d_on*100:5.1f}%  runq-wait {d_w*100:5.1f}%  other(sleep) {(1-d_on-d_w)*100:5.1f}%')
