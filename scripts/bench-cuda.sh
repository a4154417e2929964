#!/usr/bin/env bash
# ShardRL's FSDP beside PyTorch FSDP2 on one GPU (NCCL, world size 1): step time and peak GPU
# memory of the same model, batch, precision and optimizer, from one run. Needs the CUDA build of
# shardrl and bench_fsdp (`make bench-cuda` builds them) and a Python whose torch has CUDA
# (BENCH_PYTHON, default python3).
# Usage: scripts/bench-cuda.sh [BUILD_DIR]   (or `make bench-cuda`)
#
# Two models, each in fp32 and with bf16 params (fp32 reduce):
#   bench: the CPU benchmark's model (d=512, 6 layers, batch 8 x 128 tokens): launch-bound on a GPU
#   large: d=2048, 8 layers, vocab 32768, batch 8 x 512 tokens (538M params): compute-bound
#   decoder1.5b: d=2048, 28 layers, the same vocab and batch (1.54B params, as Qwen2.5-1.5B)
# MFU: model FLOPs a step (6 N T + 12 L d s T, T tokens of s a row) over the step time and the
# GPU's dense peak for the dtype (BENCH_PEAK_TFLOPS_BF16 989, BENCH_PEAK_TFLOPS_FP32 67: H100 and
# H200 SXM).
# FSDP2 runs twice: with torch.optim.AdamW's default (foreach on CUDA) and with fused=True, the
# kernel ShardRL's AdamW steps with. ShardRL and FSDP2 run interleaved, BENCH_ROUNDS times; the
# summary takes the median over rounds of each run's median step, and the largest peak. Results go
# to BENCH_OUT (default runs/bench-cuda). BENCH_PROFILE=1: in the last round each run also profiles
# 2 steps after its timed ones (host ops, kernels and allocator events; the timed steps and the
# peak are read before) into trace_IMPL_MODEL_DTYPE.json, for chrome://tracing or Perfetto.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-build-cuda}
case "$BUILD" in /*) ;; *) BUILD="$ROOT/$BUILD" ;; esac
BIN="$BUILD/bin"
OUT=${BENCH_OUT:-$ROOT/runs/bench-cuda}
ROUNDS=${BENCH_ROUNDS:-2}
STEPS=${BENCH_STEPS:-10}
WARMUP=${BENCH_WARMUP:-3}
PYTHON=${BENCH_PYTHON:-python3}
MODELS=${BENCH_MODELS:-bench large}
DTYPES=${BENCH_DTYPES:-fp32 bf16}

for f in "$BIN/shardrl" "$BIN/bench_fsdp"; do
  [ -x "$f" ] || { echo "bench-cuda: $f is missing; build first (make build-cuda)" >&2; exit 1; }
done
"$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' || {
  echo "bench-cuda: $PYTHON has no CUDA torch, or no GPU is visible" >&2
  exit 1
}
mkdir -p "$OUT"

model_args() {
  case "$1" in
    bench) echo --d-model 512 --layers 6 --heads 8 --vocab 8192 --seq 128 --batch 8 ;;
    large) echo --d-model 2048 --layers 8 --heads 16 --vocab 32768 --seq 512 --batch 8 ;;
    # Qwen2.5-1.5B's parameter count (1.54B) in the bench's decoder.
    decoder1.5b) echo --d-model 2048 --layers 28 --heads 16 --vocab 32768 --seq 512 --batch 8 ;;
    *) echo "bench-cuda: unknown model $1 (bench, large or decoder1.5b)" >&2; exit 1 ;;
  esac
}

LAUNCH1=("$BIN/shardrl" launch -n 1 --)
for round in $(seq 1 "$ROUNDS"); do
  for model in $MODELS; do
    for dtype in $DTYPES; do
      # shellcheck disable=SC2207
      args=($(model_args "$model") --steps "$STEPS" --warmup "$WARMUP" --param-dtype "$dtype")
      tag="${model}_${dtype}"
      profiled=""
      if [ "${BENCH_PROFILE:-0}" = 1 ] && [ "$round" = "$ROUNDS" ]; then profiled=1; fi
      echo "== round $round: $tag ShardRL"
      "${LAUNCH1[@]}" "$BIN/bench_fsdp" --mode fsdp "${args[@]}" \
        --json-out "$OUT/shardrl_$tag.r$round.json" \
        ${profiled:+--profile-out "$OUT/trace_shardrl_$tag.json"}
      echo "== round $round: $tag FSDP2"
      "${LAUNCH1[@]}" "$PYTHON" "$ROOT/bench/torch_baseline.py" --mode fsdp2 --device cuda \
        "${args[@]}" --json-out "$OUT/fsdp2_$tag.r$round.json" \
        ${profiled:+--profile-out "$OUT/trace_fsdp2_$tag.json"}
      echo "== round $round: $tag FSDP2, AdamW(fused=True)"
      "${LAUNCH1[@]}" "$PYTHON" "$ROOT/bench/torch_baseline.py" --mode fsdp2 --device cuda \
        --fused-adamw "${args[@]}" --json-out "$OUT/fsdp2fused_$tag.r$round.json" \
        ${profiled:+--profile-out "$OUT/trace_fsdp2fused_$tag.json"}
    done
  done
done

"$PYTHON" - "$OUT" <<'EOF'
import glob, json, os, statistics, sys

out = sys.argv[1]
# d_model, layers, vocab, seq, batch of each model_args entry above.
DIMS = {"bench": (512, 6, 8192, 128, 8), "large": (2048, 8, 32768, 512, 8),
        "decoder1.5b": (2048, 28, 32768, 512, 8)}
PEAK = {"bf16": float(os.environ.get("BENCH_PEAK_TFLOPS_BF16", 989)) * 1e12,
        "fp32": float(os.environ.get("BENCH_PEAK_TFLOPS_FP32", 67)) * 1e12}


def model_flops(tag):
    model, dtype = tag.rsplit("_", 1)
    d, layers, vocab, seq, batch = DIMS[model]
    params = 12 * layers * d * d + 2 * vocab * d + seq * d
    tokens = batch * seq
    return 6 * params * tokens + 12 * layers * d * seq * tokens, PEAK[dtype]


rows = {}
for path in sorted(glob.glob(os.path.join(out, "*.r*.json"))):
    impl, tag = os.path.basename(path).split(".r")[0].split("_", 1)
    with open(path) as f:
        j = json.load(f)
    row = rows.setdefault(tag, {}).setdefault(impl, {"step": [], "peak": [], "loss_first": []})
    row["step"].append(j["median_step_s"])
    row["peak"].append(j["device_memory"]["peak_allocated_bytes"])
    row["loss_first"].append(j["loss_first"])
    row["device"] = j["device"]
summary = {}
for tag, impls in sorted(rows.items()):
    s, f, ff = impls.get("shardrl"), impls.get("fsdp2"), impls.get("fsdp2fused")
    if not s or not f:
        continue
    entry = {
        "shardrl_step_s": statistics.median(s["step"]),
        "fsdp2_step_s": statistics.median(f["step"]),
        "shardrl_peak_bytes": max(s["peak"]),
        "fsdp2_peak_bytes": max(f["peak"]),
        "shardrl_loss_first": s["loss_first"][0],
        "fsdp2_loss_first": f["loss_first"][0],
    }
    entry["ratio_step"] = entry["shardrl_step_s"] / entry["fsdp2_step_s"]
    flops, peak = model_flops(tag)
    entry["model_flops_per_step"] = flops
    entry["shardrl_mfu"] = flops / entry["shardrl_step_s"] / peak
    entry["fsdp2_mfu"] = flops / entry["fsdp2_step_s"] / peak
    entry["ratio_peak"] = entry["shardrl_peak_bytes"] / entry["fsdp2_peak_bytes"]
    fused = ""
    if ff:
        # FSDP2 with the optimizer kernel ShardRL uses: the comparison of the FSDP machinery alone.
        entry["fsdp2_fused_step_s"] = statistics.median(ff["step"])
        entry["fsdp2_fused_peak_bytes"] = max(ff["peak"])
        entry["ratio_step_fused"] = entry["shardrl_step_s"] / entry["fsdp2_fused_step_s"]
        entry["ratio_peak_fused"] = entry["shardrl_peak_bytes"] / entry["fsdp2_fused_peak_bytes"]
        entry["fsdp2_fused_mfu"] = flops / entry["fsdp2_fused_step_s"] / peak
        fused = (f"  | FSDP2 fused AdamW {entry['fsdp2_fused_step_s'] * 1e3:.2f} ms "
                 f"(x{entry['ratio_step_fused']:.3f}), peak x{entry['ratio_peak_fused']:.3f}")
    summary[tag] = entry
    print(f"{tag:<12} step {entry['shardrl_step_s'] * 1e3:8.2f} ms vs FSDP2 "
          f"{entry['fsdp2_step_s'] * 1e3:8.2f} ms (x{entry['ratio_step']:.3f})  peak "
          f"{entry['shardrl_peak_bytes'] / 2**20:9.1f} MiB vs {entry['fsdp2_peak_bytes'] / 2**20:9.1f} "
          f"MiB (x{entry['ratio_peak']:.3f})  first loss {entry['shardrl_loss_first']:.5f} vs "
          f"{entry['fsdp2_loss_first']:.5f}  MFU {entry['shardrl_mfu']:.3f}{fused}")
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2, sort_keys=True)
    f.write("\n")
EOF
