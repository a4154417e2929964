#!/usr/bin/env bash
# verl's advantage estimators on the SmolLM2 job, the same samples a step (4 prompts x 8 answers,
# 16 steps, seed 0): grpo, rloo, reinforce_plus_plus and remax on examples/configs/smollm2_grpo.yaml,
# gae (PPO with a critic) on examples/configs/smollm2_ppo.yaml. Held-out greedy accuracy on 50
# problems before, at step 8 and at step 16; s/step and its phases from metrics.jsonl
# (summarize.py). Each run in its own folder under OUT.
#   bench/results/2026-11-29-smollm2-estimators/run.sh OUT [ESTIMATOR ...]   (from the repository
#   root, after `make build` and scripts/smollm2-model.sh)
set -euo pipefail
out=$1
shift
estimators=("${@:-grpo rloo reinforce_plus_plus remax gae}")
# shellcheck disable=SC2206
estimators=(${estimators[*]})
bin=${BUILD:-build}/bin/shardrl
mkdir -p "$out"
for est in "${estimators[@]}"; do
  config=examples/configs/smollm2_grpo.yaml
  [ "$est" = gae ] && config=examples/configs/smollm2_ppo.yaml
  rm -rf "${out:?}/$est"
  echo "== $est ($config)"
  OMP_WAIT_POLICY=PASSIVE "$bin" train "$config" algorithm.adv_estimator="$est" \
    trainer.default_local_dir="$out/$est" trainer.save_freq=-1 >"$out/$est.log" 2>&1
  grep -E "accuracy" "$out/$est.log" | tail -n 2
done
python3 "$(dirname "$0")/summarize.py" "$out" "${estimators[@]}"
