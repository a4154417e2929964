#!/usr/bin/env bash
# Foundation benchmark: FSDP on 2 ranks against the compute-only and DDP baselines, plus the
# OpenBLAS-vs-reference-BLAS check. Usage: scripts/bench.sh [BUILD_DIR]   (or `make bench`)
#
# Timings need a quiet machine: every run here shares the same 2 cores.
#
# Sizes and steps can be overridden for a quick smoke run, e.g.
#   BENCH_D_MODEL=64 BENCH_LAYERS=2 BENCH_VOCAB=256 BENCH_SEQ=32 BENCH_BATCH=4 BENCH_STEPS=2 \
#   BENCH_WARMUP=1 BENCH_MATMUL_N=256 scripts/bench.sh build
# BENCH_REF_STEPS / BENCH_REF_WARMUP shorten only the reference-BLAS model run, which at full size
# takes tens of seconds per step. Results go to BENCH_OUT (default runs/bench).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-build}
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
BIN="$BUILD/bin"
OUT=${BENCH_OUT:-$ROOT/runs/bench}

D_MODEL=${BENCH_D_MODEL:-512}
LAYERS=${BENCH_LAYERS:-6}
HEADS=${BENCH_HEADS:-8}
VOCAB=${BENCH_VOCAB:-8192}
SEQ=${BENCH_SEQ:-128}
BATCH=${BENCH_BATCH:-8}
STEPS=${BENCH_STEPS:-5}
WARMUP=${BENCH_WARMUP:-2}
REF_STEPS=${BENCH_REF_STEPS:-$STEPS}
REF_WARMUP=${BENCH_REF_WARMUP:-$WARMUP}
MATMUL_N=${BENCH_MATMUL_N:-1024}
MATMUL_REPS=${BENCH_MATMUL_REPS:-5}
PYTHON=${BENCH_PYTHON:-/usr/bin/python3}
# Reference BLAS lives beside the OpenBLAS alternative; putting its directory first on the search
# path makes the dynamic loader pick its libblas.so.3 for libtorch.
REF_BLAS_DIR=${BENCH_REF_BLAS_DIR:-/usr/lib/x86_64-linux-gnu/blas}

for f in "$BIN/shardrl" "$BIN/bench_fsdp"; do
  [ -x "$f" ] || { echo "bench: $f is missing; build first (make build)" >&2; exit 1; }
done
[ -x "$PYTHON" ] || { echo "bench: $PYTHON not found (apt-get install python3-torch)" >&2; exit 1; }
[ -e "$REF_BLAS_DIR/libblas.so.3" ] || { echo "bench: no reference BLAS in $REF_BLAS_DIR (apt-get install libblas3)" >&2; exit 1; }
if [ $((BATCH % 2)) -ne 0 ]; then
  echo "bench: BENCH_BATCH must be even (it is split over 2 ranks)" >&2
  exit 1
fi
HALF=$((BATCH / 2))
# Every run, baselines included, gets the allocator policy ShardRL's runtime sets for itself: large
# blocks stay in the heap instead of being mmap'd and returned per allocation. Without it, each
# step's fresh activation and buffer pages cost ~20% in page faults and zeroing here, for all runs.
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296}
mkdir -p "$OUT"

MODEL=(--d-model "$D_MODEL" --layers "$LAYERS" --heads "$HEADS" --vocab "$VOCAB" --seq "$SEQ")
TIMING=(--steps "$STEPS" --warmup "$WARMUP")
LAUNCH2=("$BIN/shardrl" launch -n 2 --threads 1 --)

# One process with T compute threads, the same variables the launcher sets for a rank.
local_run() {
  local threads=$1
  shift
  env OMP_NUM_THREADS="$threads" OPENBLAS_NUM_THREADS="$threads" MKL_NUM_THREADS="$threads" \
    "$@" --threads "$threads"
}

echo "bench: model d=$D_MODEL L=$LAYERS H=$HEADS V=$VOCAB T=$SEQ, batch $BATCH, $WARMUP+$STEPS steps," \
  "load average $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores -> $OUT"

# libgomp threads spin while waiting: with another busy process on these 2 cores, run c can come
# out many times slower than on a quiet machine, so say so up front.
if awk '{ exit !($1 > 0.5) }' /proc/loadavg; then
  echo "bench: WARNING: load average $(cut -d' ' -f1 /proc/loadavg) > 0.5; timings will be noisy" >&2
fi

echo "== e0) BLAS probe: ${MATMUL_N}^3 fp32 matmul, 1 thread"
local_run 1 "$BIN/bench_fsdp" --mode matmul --matmul-n "$MATMUL_N" --steps "$MATMUL_REPS" --warmup 1 \
  --json-out "$OUT/matmul_openblas.json"
LD_LIBRARY_PATH="$REF_BLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" local_run 1 "$BIN/bench_fsdp" \
  --mode matmul --matmul-n "$MATMUL_N" --steps "$MATMUL_REPS" --warmup 1 \
  --json-out "$OUT/matmul_reference.json"

echo "== a) FSDP, 2 ranks x 1 thread, global batch $BATCH"
"${LAUNCH2[@]}" "$BIN/bench_fsdp" --mode fsdp "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
  --json-out "$OUT/a_fsdp_2x1.json"
echo "== a2) FSDP with the root resharded after forward (textbook 3P traffic)"
"${LAUNCH2[@]}" "$BIN/bench_fsdp" --mode fsdp "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
  --reshard-root --json-out "$OUT/a2_fsdp_2x1_reshard_root.json"
echo "== a3) FSDP with mixed_precision.param_dtype=bf16 (reduce fp32, fp32 masters)"
"${LAUNCH2[@]}" "$BIN/bench_fsdp" --mode fsdp "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
  --param-dtype bf16 --json-out "$OUT/a3_fsdp_2x1_bf16.json"
echo "== b) local, 1 process x 1 thread, batch $HALF (one rank's share, no communication)"
local_run 1 "$BIN/bench_fsdp" --mode local "${MODEL[@]}" "${TIMING[@]}" --batch "$HALF" \
  --json-out "$OUT/b_local_1x1_half.json"
echo "== c) local, 1 process x 2 threads, batch $BATCH"
local_run 2 "$BIN/bench_fsdp" --mode local "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
  --json-out "$OUT/c_local_1x2.json"
echo "== d) PyTorch DDP, 2 ranks x 1 thread, global batch $BATCH"
"${LAUNCH2[@]}" "$PYTHON" "$ROOT/bench/ddp_baseline.py" "${MODEL[@]}" "${TIMING[@]}" \
  --batch "$BATCH" --threads 1 --json-out "$OUT/d_ddp_2x1.json"
echo "== d2) PyTorch DDP with torch.autocast(cpu, bf16), 2 ranks x 1 thread"
"${LAUNCH2[@]}" "$PYTHON" "$ROOT/bench/ddp_baseline.py" "${MODEL[@]}" "${TIMING[@]}" \
  --batch "$BATCH" --threads 1 --autocast-bf16 --json-out "$OUT/d2_ddp_2x1_autocast_bf16.json"
echo "== e) local, 1 x 1 thread, batch $HALF, reference BLAS (the 'before' of b)"
LD_LIBRARY_PATH="$REF_BLAS_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" local_run 1 "$BIN/bench_fsdp" \
  --mode local "${MODEL[@]}" --steps "$REF_STEPS" --warmup "$REF_WARMUP" --batch "$HALF" \
  --json-out "$OUT/e_local_1x1_half_refblas.json"

"$PYTHON" - "$OUT" "$REF_BLAS_DIR" <<'EOF'
import json, os, sys

out, ref_dir = sys.argv[1], sys.argv[2]
def load(name):
    with open(os.path.join(out, name + ".json")) as f:
        return json.load(f)

a, a2, a3 = load("a_fsdp_2x1"), load("a2_fsdp_2x1_reshard_root"), load("a3_fsdp_2x1_bf16")
d2 = load("d2_ddp_2x1_autocast_bf16")
b, c, d, e = load("b_local_1x1_half"), load("c_local_1x2"), load("d_ddp_2x1"), load("e_local_1x1_half_refblas")
mo, mr = load("matmul_openblas"), load("matmul_reference")

rows = [("a", "FSDP", "2x1", a), ("a2", "FSDP reshard-root", "2x1", a2),
        ("a3", "FSDP bf16 params", "2x1", a3), ("d2", "DDP autocast bf16", "2x1", d2),
        ("b", "local (B/2)", "1x1", b), ("c", "local", "1x2", c), ("d", "DDP (PyTorch)", "2x1", d),
        ("e", "local (B/2) ref BLAS", "1x1", e)]
print()
print(f"{'run':<3} {'setup':<21} {'procs':>5} {'batch':>5} {'median s':>9} {'tok/s':>9} "
      f"{'MB/rank/step':>12} {'lo MB':>8}")
for key, name, procs, r in rows:
    comm = r.get("comm", {})
    sent = comm.get("bytes_sent_per_step")
    lo = comm.get("loopback_tx_bytes_per_rank_per_step")
    print(f"{key:<3} {name:<21} {procs:>5} {r['batch_global']:>5} {r['median_step_s']:>9.4f} "
          f"{r['tokens_per_s']:>9.0f} {'' if sent is None else f'{sent / 1e6:.3f}':>12} "
          f"{'' if lo is None else f'{lo / 1e6:.3f}':>8}")
print(f"    matmul {mo['n']}^3 1 thread: OpenBLAS {mo['gflops']:.2f} GFLOP/s "
      f"({mo['environment']['blas_library']}), reference {mr['gflops']:.2f} GFLOP/s "
      f"({mr['environment']['blas_library']})")

t = lambda r: r["median_step_s"]
ratios = {
    "a_over_b": {"value": t(a) / t(b), "target": "<= 1.10"},
    "a_over_c": {"value": t(a) / t(c), "target": None},
    "a_over_d": {"value": t(a) / t(d), "target": "<= 0.75"},
    "a3_bf16_over_d_fp32": {"value": t(a3) / t(d), "target": "<= 0.75"},
    "a3_bf16_over_d2_autocast_bf16": {"value": t(a3) / t(d2), "target": "<= 0.75"},
    "bytes_measured_over_schedule": {"value": a["comm"]["ratio_measured_to_schedule"],
                                     "target": "within 2%"},
    "bytes_measured_over_3p": {"value": a["comm"]["ratio_measured_to_3p"], "target": None},
    "reshard_root_bytes_measured_over_3p": {"value": a2["comm"]["ratio_measured_to_3p"],
                                            "target": "within 2%"},
    "loopback_over_measured": {"value": a["comm"]["ratio_loopback_to_measured"], "target": None},
    "blas_speedup_model_step": {"value": t(e) / t(b), "target": None},
    "blas_speedup_matmul": {"value": mo["gflops"] / mr["gflops"] if mr["gflops"] else None,
                            "target": None},
}
def passed(v, target):
    if target is None or v is None:
        return None
    if target.startswith("<="):
        return v <= float(target[2:])
    return abs(v - 1.0) <= 0.02
print()
for name, r in ratios.items():
    r["pass"] = passed(r["value"], r["target"])
    verdict = "" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
    value = "n/a" if r["value"] is None else f"{r['value']:.4f}"
    print(f"{name:<38} {value:>9}  {r['target'] or '':<10} {verdict}")

warnings = []
if not mr["environment"]["blas_library"].startswith(os.path.realpath(ref_dir)):
    warnings.append("the reference-BLAS matmul did not run on " + ref_dir)
if not e["environment"]["blas_library"].startswith(os.path.realpath(ref_dir)):
    warnings.append("run e did not run on the reference BLAS")
if ref_dir in b["environment"]["blas_library"]:
    warnings.append("run b ran on the reference BLAS")
for w in warnings:
    print("WARNING:", w)

summary = {"ratios": ratios, "warnings": warnings, "load_average_end": os.getloadavg(),
           "runs": {k: f"{n}" for k, n in [("a", "a_fsdp_2x1"), ("a2", "a2_fsdp_2x1_reshard_root"),
                                           ("a3", "a3_fsdp_2x1_bf16"),
                                           ("d2", "d2_ddp_2x1_autocast_bf16"),
                                           ("b", "b_local_1x1_half"), ("c", "c_local_1x2"),
                                           ("d", "d_ddp_2x1"), ("e", "e_local_1x1_half_refblas"),
                                           ("matmul_openblas", "matmul_openblas"),
                                           ("matmul_reference", "matmul_reference")]}}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
print(f"\nwrote {out}/*.json and {out}/summary.json")
EOF
