#!/usr/bin/env bash
# The SmolLM2 job's update with and without its padding (actor_rollout_ref.model.use_remove_padding),
# and with gradient checkpointing on top: examples/configs/smollm2_grpo.yaml for STEPS steps
# (default 3; no validation, no checkpoint), each variant in its own run folder under OUT.
#   bench/results/2026-11-29-remove-padding/run.sh OUT [STEPS]     (from the repository root,
#   after `make build` and scripts/smollm2-model.sh; run it alone: its figures are timings)
set -euo pipefail
out=$1 steps=${2:-3}
bin=${BUILD:-build}/bin/shardrl
mkdir -p "$out"
declare -A variants=(
  [padded]="actor_rollout_ref.model.use_remove_padding=false"
  [packed]="actor_rollout_ref.model.use_remove_padding=true"
  [packed_checkpointed]="actor_rollout_ref.model.use_remove_padding=true actor_rollout_ref.model.enable_gradient_checkpointing=true"
  [padded_checkpointed]="actor_rollout_ref.model.use_remove_padding=false actor_rollout_ref.model.enable_gradient_checkpointing=true"
)
for name in padded packed padded_checkpointed packed_checkpointed; do
  rm -rf "$out/$name"
  echo "== $name"
  # shellcheck disable=SC2086
  OMP_WAIT_POLICY=PASSIVE "$bin" train examples/configs/smollm2_grpo.yaml \
    trainer.default_local_dir="$out/$name" trainer.total_training_steps="$steps" \
    trainer.val_before_train=false trainer.test_freq=-1 trainer.save_freq=-1 \
    ${variants[$name]} >"$out/$name.log" 2>&1
  grep -E "step [0-9]+/" "$out/$name.log" | tail -n "$steps"
done
