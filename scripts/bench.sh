#!/usr/bin/env bash
# ShardRL's FSDP beside PyTorch FSDP2, DDP and the unsharded baseline, on the same model, batch,
# precision and threads, in one run. Usage: scripts/bench.sh [BUILD_DIR]   (or `make bench`)
#
#   a)  ShardRL FSDP, 2 ranks x 1 thread, global batch B (fp32); FSDP's bytes go through shared
#       memory, ShardRL's transport for ranks of one host
#   a5) a with --no-host-shared-params: each rank gathers into unsharded params of its own, and
#       backward gathers the blocks again (ShardRL before the host-shared image)
#   a4) a with SHARDRL_SHM_DISABLE=1: the same bytes through Gloo's TCP loopback, the transport
#       between hosts
#   b)  ShardRL, 1 process x 1 thread, batch B/2 (one rank's share, no communication)
#   b2) two b processes at once: run a's compute with the cores shared as in a, no communication
#   b3) b2 in lock-step (bench_fsdp --mode lockstep under shardrl launch): each rank trains a copy
#       of its own on its B/2 rows, exchanging nothing, between the same per-step barriers as a, so
#       a step waits for the slower core as a's does. Data parallel with free communication: a / b3
#       is what communication costs, without what the cores' uneven speeds cost
#   d)  PyTorch DDP, 2 x 1
#   f)  PyTorch FSDP2, 2 x 1 (fully_shard per block, then the root)
#   a2) / f3) ShardRL and FSDP2 with reshard_after_forward=false on the blocks (ZeRO-2: params
#       gathered once a step, DDP's traffic; grads and optimizer state still 1/N)
#   a3) / f2) ShardRL and FSDP2 with bf16 params and fp32 reduce (fewer steps: this CPU has no
#       bf16 arithmetic, a step takes ~25x the fp32 one)
#   a1) / f1) ShardRL FSDP and PyTorch FSDP2 at world size 1, batch B/2: nothing to shard over,
#       so what each costs over plain training (b, and l: PyTorch 1 x 1 without FSDP). The GPU
#       comparison (scripts/bench-cuda.sh) runs at this world size.
#
# a, b, b3, a1, b2, a5, a4, d, f, a2, f3, f1 and l run interleaved in that order, BENCH_ROUNDS times,
# the runs of the closest comparisons next to each other: this VM's speed drifts over minutes. The
# summary takes the median over rounds of each run's median step; each ratio is the ratio of those
# medians, and beside it the median over rounds of the same ratio within a round (paired). Timings
# need a quiet machine: every run shares the same 2 cores.
#
# Sizes and steps can be overridden for a quick smoke run, e.g.
#   BENCH_D_MODEL=64 BENCH_LAYERS=2 BENCH_VOCAB=256 BENCH_SEQ=32 BENCH_BATCH=4 BENCH_STEPS=2 \
#   BENCH_WARMUP=1 BENCH_ROUNDS=1 scripts/bench.sh build
# Results go to BENCH_OUT (default runs/bench).
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
ROUNDS=${BENCH_ROUNDS:-2}
BF16_STEPS=${BENCH_BF16_STEPS:-3}
BF16_WARMUP=${BENCH_BF16_WARMUP:-1}
VENV=${SHARDRL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/shardrl/venv}
PYTHON=${BENCH_PYTHON:-$VENV/bin/python}

for f in "$BIN/shardrl" "$BIN/bench_fsdp" "$BIN/bench_collectives"; do
  [ -x "$f" ] || { echo "bench: $f is missing; build first (make build)" >&2; exit 1; }
done
[ -x "$PYTHON" ] || { echo "bench: $PYTHON not found (scripts/install-deps.sh makes it)" >&2; exit 1; }
if [ $((BATCH % 2)) -ne 0 ]; then
  echo "bench: BENCH_BATCH must be even (it is split over 2 ranks)" >&2
  exit 1
fi
HALF=$((BATCH / 2))
# Every run, baselines included, gets the allocator policy ShardRL's runtime sets for itself: large
# blocks stay in the heap instead of being mmap'd and returned per allocation.
export GLIBC_TUNABLES=${GLIBC_TUNABLES:-glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
mkdir -p "$OUT"

MODEL=(--d-model "$D_MODEL" --layers "$LAYERS" --heads "$HEADS" --vocab "$VOCAB" --seq "$SEQ")
TIMING=(--steps "$STEPS" --warmup "$WARMUP")
BF16_TIMING=(--steps "$BF16_STEPS" --warmup "$BF16_WARMUP")
LAUNCH2=("$BIN/shardrl" launch -n 2 --threads 1 --)
TORCH=("$PYTHON" "$ROOT/bench/torch_baseline.py")

echo "bench: model d=$D_MODEL L=$LAYERS H=$HEADS V=$VOCAB T=$SEQ, batch $BATCH, $WARMUP+$STEPS steps," \
  "$ROUNDS rounds, load average $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores -> $OUT"
if awk '{ exit !($1 > 0.5) }' /proc/loadavg; then
  echo "bench: WARNING: load average $(cut -d' ' -f1 /proc/loadavg) > 0.5; timings will be noisy" >&2
fi

echo "== collectives: every Gloo method for FSDP's all-gather and reduce-scatter, 2 x 1"
"${LAUNCH2[@]}" "$BIN/bench_collectives" --json-out "$OUT/collectives.json"

for round in $(seq 1 "$ROUNDS"); do
  echo "== round $round: a) ShardRL FSDP 2x1"
  "${LAUNCH2[@]}" "$BIN/bench_fsdp" --mode fsdp "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
    --json-out "$OUT/a_fsdp_2x1.r$round.json"
  echo "== round $round: b) ShardRL local 1x1, batch $HALF"
  env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$BIN/bench_fsdp" --mode local "${MODEL[@]}" \
    "${TIMING[@]}" --batch "$HALF" --threads 1 --json-out "$OUT/b_local_1x1_half.r$round.json"
  echo "== round $round: b3) ShardRL local B/2 on each of 2 ranks in lock-step, nothing exchanged"
  "${LAUNCH2[@]}" "$BIN/bench_fsdp" --mode lockstep "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
    --json-out "$OUT/b3_lockstep_2x1.r$round.json"
  echo "== round $round: a1) ShardRL FSDP 1x1, batch $HALF"
  "$BIN/shardrl" launch -n 1 --threads 1 -- "$BIN/bench_fsdp" --mode fsdp "${MODEL[@]}" \
    "${TIMING[@]}" --batch "$HALF" --json-out "$OUT/a1_fsdp_1x1_half.r$round.json"
  echo "== round $round: b2) two ShardRL local 1x1 processes at once, batch $HALF each"
  # a's compute without its communication: both cores busy, sharing caches and memory bandwidth
  # as the two ranks do, but each process at its own pace (b3 makes them keep in step).
  for p in 0 1; do
    env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "$BIN/bench_fsdp" --mode local "${MODEL[@]}" \
      "${TIMING[@]}" --batch "$HALF" --threads 1 \
      --json-out "$OUT/b2_local_1x1_half_concurrent_p$p.r$round.json" &
  done
  wait
  echo "== round $round: a5) ShardRL FSDP 2x1, private unsharded params"
  "${LAUNCH2[@]}" "$BIN/bench_fsdp" --mode fsdp "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
    --no-host-shared-params --json-out "$OUT/a5_fsdp_2x1_private.r$round.json"
  echo "== round $round: a4) ShardRL FSDP 2x1 over Gloo's TCP loopback"
  SHARDRL_SHM_DISABLE=1 "${LAUNCH2[@]}" "$BIN/bench_fsdp" --mode fsdp "${MODEL[@]}" "${TIMING[@]}" \
    --batch "$BATCH" --json-out "$OUT/a4_fsdp_2x1_gloo.r$round.json"
  echo "== round $round: d) PyTorch DDP 2x1"
  "${LAUNCH2[@]}" "${TORCH[@]}" --mode ddp "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
    --threads 1 --json-out "$OUT/d_ddp_2x1.r$round.json"
  echo "== round $round: f) PyTorch FSDP2 2x1"
  "${LAUNCH2[@]}" "${TORCH[@]}" --mode fsdp2 "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
    --threads 1 --json-out "$OUT/f_fsdp2_2x1.r$round.json"
  echo "== round $round: a2) ShardRL FSDP 2x1, reshard_after_forward=false"
  "${LAUNCH2[@]}" "$BIN/bench_fsdp" --mode fsdp "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
    --no-reshard-after-forward --json-out "$OUT/a2_fsdp_2x1_no_reshard.r$round.json"
  echo "== round $round: f3) PyTorch FSDP2 2x1, reshard_after_forward=False"
  "${LAUNCH2[@]}" "${TORCH[@]}" --mode fsdp2 "${MODEL[@]}" "${TIMING[@]}" --batch "$BATCH" \
    --threads 1 --no-reshard-after-forward --json-out "$OUT/f3_fsdp2_2x1_no_reshard.r$round.json"
  echo "== round $round: f1) PyTorch FSDP2 1x1, batch $HALF"
  "$BIN/shardrl" launch -n 1 --threads 1 -- "${TORCH[@]}" --mode fsdp2 "${MODEL[@]}" \
    "${TIMING[@]}" --batch "$HALF" --threads 1 --json-out "$OUT/f1_fsdp2_1x1_half.r$round.json"
  echo "== round $round: l) PyTorch 1x1 without FSDP, batch $HALF"
  env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 "${TORCH[@]}" --mode local "${MODEL[@]}" \
    "${TIMING[@]}" --batch "$HALF" --threads 1 --json-out "$OUT/l_torch_local_1x1_half.r$round.json"
done
echo "== a3) ShardRL FSDP 2x1, bf16 params, fp32 reduce"
"${LAUNCH2[@]}" "$BIN/bench_fsdp" --mode fsdp "${MODEL[@]}" "${BF16_TIMING[@]}" --batch "$BATCH" \
  --param-dtype bf16 --json-out "$OUT/a3_fsdp_2x1_bf16.json"
echo "== f2) PyTorch FSDP2 2x1, bf16 params, fp32 reduce"
"${LAUNCH2[@]}" "${TORCH[@]}" --mode fsdp2 --param-dtype bf16 "${MODEL[@]}" "${BF16_TIMING[@]}" \
  --batch "$BATCH" --threads 1 --json-out "$OUT/f2_fsdp2_2x1_bf16.json"

"$PYTHON" - "$OUT" "$ROUNDS" <<'PYEOF'
import json, os, statistics, sys

out, rounds = sys.argv[1], int(sys.argv[2])
def load(name):
    with open(os.path.join(out, name + ".json")) as f:
        return json.load(f)

runs = {k: [load(f"{n}.r{r}") for r in range(1, rounds + 1)]
        for k, n in [("a", "a_fsdp_2x1"), ("a5", "a5_fsdp_2x1_private"), ("a4", "a4_fsdp_2x1_gloo"), ("b", "b_local_1x1_half"),
                     ("b3", "b3_lockstep_2x1"), ("d", "d_ddp_2x1"),
                     ("f", "f_fsdp2_2x1"), ("a2", "a2_fsdp_2x1_no_reshard"),
                     ("f3", "f3_fsdp2_2x1_no_reshard"), ("a1", "a1_fsdp_1x1_half"),
                     ("f1", "f1_fsdp2_1x1_half"), ("l", "l_torch_local_1x1_half")]}
a3, f2 = load("a3_fsdp_2x1_bf16"), load("f2_fsdp2_2x1_bf16")
t = {k: statistics.median(r["median_step_s"] for r in v) for k, v in runs.items()}
# b2: per round the slower of the two concurrent processes (a step of run a waits for both ranks).
b2 = [max(load(f"b2_local_1x1_half_concurrent_p{p}.r{r}")["median_step_s"] for p in (0, 1))
      for r in range(1, rounds + 1)]
t["b2"] = statistics.median(b2)
t["a3"], t["f2"] = a3["median_step_s"], f2["median_step_s"]

def sent(r):
    comm = r.get("comm", {})
    return comm.get("bytes_sent_per_step", comm.get("loopback_tx_bytes_per_rank_per_step"))

print(f"\n{'run':<4} {'setup':<28} {'median s (per round)':<28} {'MB/rank/step':>12}")
names = {"a": "ShardRL FSDP 2x1", "a5": "ShardRL 2x1 private copies", "a4": "ShardRL 2x1 over Gloo", "b": "ShardRL local 1x1 B/2",
         "b3": "2 x local B/2 in lock-step", "d": "PyTorch DDP 2x1",
         "f": "PyTorch FSDP2 2x1", "a2": "ShardRL 2x1 no reshard", "f3": "FSDP2 2x1 no reshard",
         "a1": "ShardRL FSDP 1x1 B/2", "f1": "PyTorch FSDP2 1x1 B/2", "l": "PyTorch local 1x1 B/2"}
for k, v in runs.items():
    per_round = ", ".join(f"{r['median_step_s']:.3f}" for r in v)
    s = sent(v[0])
    print(f"{k:<4} {names[k]:<28} {t[k]:.4f} ({per_round}){'':<4} "
          f"{'' if s is None else f'{s / 1e6:.2f}':>12}")
print(f"{'b2':<4} {'2 x ShardRL local B/2 at once':<28} {t['b2']:.4f} "
      f"({', '.join(f'{x:.3f}' for x in b2)})")
for k, name, r in [("a3", "ShardRL FSDP bf16 2x1", a3), ("f2", "PyTorch FSDP2 bf16 2x1", f2)]:
    s = sent(r)
    print(f"{k:<4} {name:<28} {t[k]:.4f}{'':<22} {'' if s is None else f'{s / 1e6:.2f}':>12}")

# Per round too, where both sides ran every round: a round's runs ran minutes apart at most.
per_round = {k: [r["median_step_s"] for r in v] for k, v in runs.items()}
per_round["b2"] = b2

def ratio(x, y, target=None):
    r = {"value": t[x] / t[y], "target": target}
    if x in per_round and y in per_round:
        r["per_round"] = [p / q for p, q in zip(per_round[x], per_round[y])]
        r["paired_median"] = statistics.median(r["per_round"])
    return r

ratios = {
    "shardrl_over_fsdp2": ratio("a", "f", "<= 0.70"),
    "shardrl_over_ddp": ratio("a", "d", "<= 1.0"),
    "cost_of_sharding_a_over_b": ratio("a", "b", "<= 1.05"),
    "shm_over_gloo_loopback_a_over_a4": ratio("a", "a4"),
    "host_shared_over_private_a_over_a5": ratio("a", "a5"),
    "fsdp2_cost_of_sharding_f_over_b": ratio("f", "b"),
    "shared_cores_b2_over_b": ratio("b2", "b"),
    "communication_a_over_b2": ratio("a", "b2"),
    "lock_step_b3_over_b": ratio("b3", "b"),
    "communication_a_over_b3": ratio("a", "b3"),
    "shardrl_bf16_over_fsdp2_bf16": ratio("a3", "f2"),
    "no_reshard_shardrl_over_fsdp2_a2_over_f3": ratio("a2", "f3"),
    "no_reshard_shardrl_over_ddp_a2_over_d": ratio("a2", "d"),
    "world_size_1_shardrl_over_fsdp2_a1_over_f1": ratio("a1", "f1"),
    "world_size_1_shardrl_fsdp_over_local_a1_over_b": ratio("a1", "b"),
    "world_size_1_fsdp2_over_torch_local_f1_over_l": ratio("f1", "l"),
}
print(f"\n{'ratio':<48} {'medians':>7}  {'paired':>7}  {'target':<8}")
for name, r in ratios.items():
    target = r["target"]
    r["pass"] = None if target is None else r["value"] <= float(target[2:])
    verdict = "" if r["pass"] is None else ("PASS" if r["pass"] else "FAIL")
    paired = f"{r['paired_median']:>7.4f}" if "paired_median" in r else f"{'':>7}"
    print(f"{name:<48} {r['value']:>7.4f}  {paired}  {target or '':<8} {verdict}")

with open(os.path.join(out, "collectives.json")) as f:
    coll = json.load(f)
print("\ncollectives (median ms, 2 ranks x 1 thread):")
for row in coll["results"]:
    print(f"  {row['op']:<15} {row['dtype']:<5} {row['payload_mib']:>6.1f} MiB  "
          f"{row['method']:<24} {row['median_ms']:>9.2f}")

summary = {"median_step_s": t, "ratios": ratios, "rounds": rounds,
           "load_average_end": os.getloadavg()}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2)
    f.write("\n")
print(f"\nwrote {out}/*.json and {out}/summary.json")
PYEOF
