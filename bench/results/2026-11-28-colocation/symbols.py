"""A rank's main thread, per symbol: on-CPU samples of b, b3 and a (mean of the 4 runs), and what
the other threads of a rank of a (the shared-memory transport's, Gloo's) spend."""
import collections, re, subprocess


def samples(path):
    out = subprocess.run(["perf", "report", "-i", path, "--sort", "pid,comm,sym", "--stdio", "-n"],
                         capture_output=True, text=True).stdout
    per = collections.defaultdict(collections.Counter)
    for line in out.splitlines():
        m = re.match(r"\s*[\d.]+%\s+(\d+)\s+(\d+):\S+\s+(\S+)\s+\[.\]\s+(.*)", line)
        if m and m[3] == "bench_fsdp":
            per[int(m[2])][m[4].strip()[:80]] += int(m[1])
    return per


main, other = {}, {}
for mode, ranks in (("a", 2), ("b", 1), ("b3", 2)):
    main[mode], other[mode] = collections.Counter(), collections.Counter()
    for r in (1, 2, 3, 4):
        per = samples(f"{mode}.{r}.data")
        pids = sorted(per, key=lambda p: -sum(per[p].values()))
        for p in pids[:ranks]:
            main[mode].update({k: v / ranks / 4 for k, v in per[p].items()})
        for p in pids[ranks:]:
            other[mode].update({k: v / ranks / 4 for k, v in per[p].items()})

print("# on-CPU samples (2.004 ms) a rank's main thread, mean of 4 runs (13 steps and start-up each), per symbol")
print("# columns: b (one process alone), b3 (two b in lock-step), a (FSDP 2x1), b3-b, a-b3")
b, b3, a = main["b"], main["b3"], main["a"]
total = {m: sum(c.values()) for m, c in main.items()}
print(f"{total['b']:8.0f} {total['b3']:8.0f} {total['a']:8.0f} {total['b3'] - total['b']:+7.0f} "
      f"{total['a'] - total['b3']:+7.0f} TOTAL")
for k in sorted(set(a) | set(b) | set(b3), key=lambda k: -max(abs(b3[k] - b[k]), abs(a[k] - b3[k])))[:30]:
    print(f"{b[k]:8.0f} {b3[k]:8.0f} {a[k]:8.0f} {b3[k] - b[k]:+7.0f} {a[k] - b3[k]:+7.0f} {k}")
print("\n# a: the other threads of a rank (the shared-memory transport's, Gloo's), top symbols")
print(f"{sum(other['a'].values()):8.0f} TOTAL")
for k, v in other["a"].most_common(12):
    print(f"{v:8.0f} {k}")
