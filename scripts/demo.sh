#!/usr/bin/env bash
# `make demo`: the main job on 2 local ranks.
set -euo pipefail
build=${1:-build}
exec "$build/bin/shardrl" launch -n 2 -- "$build/bin/train_lm" "${@:2}"
