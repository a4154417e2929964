#!/usr/bin/env bash
# `make demo`: the main job on 2 local ranks. Pretrains a class-conditional DiT and a reward
# classifier on Fashion-MNIST (both cached in runs/demo/cache), then Flow-GRPO-tunes the DiT
# with LoRA; pictures, metrics.jsonl and summary.json land in runs/demo.
set -euo pipefail
build=${1:-build}
exec "$build/bin/shardrl" launch -n 2 -- "$build/bin/fmnist_flow_grpo" --run-dir runs/demo "${@:2}"
