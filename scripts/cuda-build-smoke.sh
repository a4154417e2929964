#!/usr/bin/env bash
# The CUDA build on a machine without a GPU: `shardrl train` falls back to the CPU and Gloo, so the
# user path runs here too. Four steps of lm_pretrain with a checkpoint every step (rotation deletes
# the older ones), then a resume to six steps and an export: the file handling of a CUDA-linked
# binary, where a shared library's own std::filesystem once won symbol lookup and crashed.
# Usage: scripts/cuda-build-smoke.sh [CUDA_BUILD_DIR]
set -euo pipefail
build=${1:-build-cuda}
bin="$build/bin/shardrl"
[ -x "$bin" ] || { echo "cuda-build-smoke: $bin is missing (make build-cuda)" >&2; exit 1; }
readelf -d "$bin" | grep -q 'NEEDED.*libtorch_cuda' || {
  echo "cuda-build-smoke: $bin does not link libtorch_cuda: $build was configured without" \
    "SHARDRL_CUDA=ON" >&2
  exit 1
}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
run() {
  "$bin" train examples/configs/lm_pretrain.yaml trainer.nproc_per_node=1 trainer.save_freq=1 \
    trainer.max_actor_ckpt_to_keep=1 "trainer.default_local_dir=$dir" "$@" >"$dir/log" 2>&1 || {
    tail -n 20 "$dir/log" >&2
    echo "cuda-build-smoke: shardrl train $* failed" >&2
    exit 1
  }
}
run trainer.total_training_steps=4
run trainer.total_training_steps=6
grep -q "resumed from .*global_step_4" "$dir/log" || { echo "cuda-build-smoke: no resume" >&2; exit 1; }
"$bin" export "$dir/checkpoints/global_step_6" "$dir/hf" >"$dir/log" 2>&1
[ -s "$dir/hf/config.json" ] || { echo "cuda-build-smoke: export wrote no config.json" >&2; exit 1; }
kept=$(ls -d "$dir"/checkpoints/global_step_* | wc -l)
[ "$kept" -eq 1 ] || { echo "cuda-build-smoke: $kept checkpoints kept, expected 1" >&2; exit 1; }
echo "cuda-build-smoke: train, rotate, resume and export ran with $bin"
