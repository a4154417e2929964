#!/usr/bin/env bash
# `make demo`: the main job on 2 local ranks. Pretrains a class-conditional DiT and a reward
# classifier on Fashion-MNIST (both cached in runs/demo/cache), then Flow-GRPO-tunes the DiT
# with LoRA; pictures, metrics.jsonl and summary.json land in runs/demo. Extra arguments are
# config overrides (key=value).
set -euo pipefail
build=${1:-build}
exec "$build/bin/shardrl" train examples/configs/fmnist_flow_grpo.yaml "${@:2}"
