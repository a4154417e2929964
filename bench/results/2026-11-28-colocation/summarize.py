"""Per run: on-CPU samples (2.004 ms each, perf -F 499) of each rank's main thread, of the
sgemm kernel in it, of the rest of bench_fsdp's threads (a: the shared-memory transport's), and
the median step. Rank figures are per rank (mean of the two ranks)."""
import collections, json, re, statistics, subprocess


def samples(path):
    out = subprocess.run(["perf", "report", "-i", path, "--sort", "pid,comm,sym", "--stdio", "-n"],
                         capture_output=True, text=True).stdout
    per = collections.defaultdict(collections.Counter)
    for line in out.splitlines():
        m = re.match(r"\s*[\d.]+%\s+(\d+)\s+(\d+):\S+\s+(\S+)\s+\[.\]\s+(.*)", line)
        if m and m[3] == "bench_fsdp":
            per[int(m[2])][m[4].strip()] += int(m[1])
    return per


def main():
    rows = collections.defaultdict(list)
    for mode, ranks in (("a", 2), ("b", 1), ("b3", 2)):
        for r in (1, 2, 3, 4):
            per = samples(f"{mode}.{r}.data")
            pids = sorted(per, key=lambda p: -sum(per[p].values()))
            mains, others = pids[:ranks], pids[ranks:]
            on_cpu = sum(sum(per[p].values()) for p in mains) / ranks
            sgemm = sum(per[p]["mkl_blas_def_sgemm_kernel_0_zen"] for p in mains) / ranks
            other = sum(sum(per[p].values()) for p in others) / ranks
            step = json.load(open(f"{mode}.{r}.json"))["median_step_s"]
            rows[mode].append((on_cpu, sgemm, other, step))
            print(f"{mode:3} round {r}: main {on_cpu:7.0f}  sgemm {sgemm:7.0f}  other threads {other:5.0f}  median step {step:.3f} s")
    print()
    med = {m: [statistics.median(x[i] for x in v) for i in range(4)] for m, v in rows.items()}
    for m, (on_cpu, sgemm, other, step) in med.items():
        print(f"median {m:3}: main {on_cpu:7.0f}  sgemm {sgemm:7.0f}  other {other:5.0f}  step {step:.3f} s")
    a, b, b3 = med["a"], med["b"], med["b3"]
    print(f"a/b {a[3]/b[3]:.3f}  b3/b {b3[3]/b[3]:.3f}  a/b3 {a[3]/b3[3]:.3f}")
    print(f"main-thread samples a/b3 {a[0]/b3[0]:.3f}  sgemm a/b3 {a[1]/b3[1]:.3f}  sgemm b3/b {b3[1]/b[1]:.3f}")
    for i, name in ((3, "step"), (0, "main samples")):
        print(f"paired per round ({name}): a/b",
              [round(x[i]/y[i], 3) for x, y in zip(rows['a'], rows['b'])], "a/b3",
              [round(x[i]/y[i], 3) for x, y in zip(rows['a'], rows['b3'])], "b3/b",
              [round(x[i]/y[i], 3) for x, y in zip(rows['b3'], rows['b'])])


if __name__ == "__main__":
    main()
