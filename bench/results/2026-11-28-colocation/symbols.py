"""A rank's main thread, per symbol: on-CPU samples of b, b3 and a (mean of the 4 runs), and what
the other threads of a rank of a (the shared-memory transport's, Gloo's) spend."""
import collections

from summarize import samples

main, other = {}, {}
for mode, ranks in (("a", 2), ("b", 1), ("b3", 2)):
    main[mode], other[mode] = collections.Counter(), collections.Counter()
    for r in (1, 2, 3, 4):
        per = samples(f"{mode}.{r}.data")
        pids = sorted(per, key=lambda p: -sum(per[p].values()))
        for i, p in enumerate(pids):
            # Names cut at 80 characters: LibTorch's elementwise kernels add up under one line.
            for symbol, n in per[p].items():
                (main if i < ranks else other)[mode][symbol[:80]] += n / ranks / 4

print("# on-CPU samples (2.004 ms) a rank's main thread, mean of 4 runs (13 steps and start-up each), per symbol")
print("# columns: b (one process alone), b3 (two b in lock-step), a (FSDP 2x1), b3-b, a-b3")
b, b3, a = main["b"], main["b3"], main["a"]
total = {m: sum(c.values()) for m, c in main.items()}
print(f"{total['b']:8.0f} {total['b3']:8.0f} {total['a']:8.0f} {total['b3'] - total['b']:+7.0f} "
      f"{total['a'] - total['b3']:+7.0f} TOTAL")
for k in sorted(set(a) | set(b) | set(b3), key=lambda k: (-max(abs(b3[k] - b[k]), abs(a[k] - b3[k])), k))[:30]:
    print(f"{b[k]:8.0f} {b3[k]:8.0f} {a[k]:8.0f} {b3[k] - b[k]:+7.0f} {a[k] - b3[k]:+7.0f} {k}")
print("\n# a: the other threads of a rank (the shared-memory transport's, Gloo's), top symbols")
print(f"{sum(other['a'].values()):8.0f} TOTAL")
for k, v in other["a"].most_common(12):
    print(f"{v:8.0f} {k}")
