#!/usr/bin/env bash
# ShardRL (`shardrl train examples/configs/smollm2_grpo.yaml`) beside TRL's GRPOTrainer
# (bench/trl_grpo/trl_grpo.py) on the same SmolLM2 GRPO job, interleaved, the same number of steps
# each. Take the exclusive lock: the seconds are what it measures.
#
#   flock -x /tmp/shardrl-cpu.lock bash bench/trl_grpo/run.sh [STEPS] [WARMUP] [ROUNDS] [OUT]
#
# STEPS (default 6) steps a run, the first WARMUP (default 1) not counted; ROUNDS (default 2)
# rounds of one ShardRL run and one TRL run, ShardRL first in odd rounds, TRL first in even ones.
# BUILD (default build) holds bin/shardrl. The model is runs/smollm2/model, imported from the
# GGUF as scripts/smollm2.sh does when it is missing. Both sides skip validation
# (data.val_size=0; TRL's script draws the same problems, step for step). OUT (default
# runs/trl_grpo) receives per run a JSON (shardrl.rR.json: its metrics.jsonl's steps;
# trl.rR.json), its log, uptime and lscpu, and summary.json (bench/trl_grpo/summarize.py).
set -euo pipefail
cd "$(dirname "$0")/../.."
steps=${1:-6}
warmup=${2:-1}
rounds=${3:-2}
out=${4:-runs/trl_grpo}
build=${BUILD:-build}
python=${SHARDRL_VENV:-$HOME/.cache/shardrl/venv}/bin/python
model=runs/smollm2/model
bash scripts/smollm2-model.sh "$build"
mkdir -p "$out"
lscpu >"$out/lscpu.txt"
{
  echo "start $(date -u +%FT%TZ) $(uptime)"
  echo "shardrl $(git rev-parse HEAD) build=$build steps=$steps warmup=$warmup rounds=$rounds"
} >>"$out/uptime.txt"

run_shardrl() {
  local r=$1 dir="$out/shardrl.r$1"
  rm -rf "$dir"
  # 2 ranks x 1 thread, as `make smollm2` runs it.
  OMP_WAIT_POLICY=PASSIVE "$build/bin/shardrl" train examples/configs/smollm2_grpo.yaml \
    actor_rollout_ref.model.path="$model" trainer.default_local_dir="$dir" \
    trainer.total_training_steps="$steps" trainer.val_before_train=false trainer.test_freq=1000000 \
    trainer.save_freq=-1 data.val_size=0 \
    >"$out/shardrl.r$r.log" 2>&1
  "$python" -c 'import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump({"impl": "shardrl", "processes": 2, "threads": 1,
           "steps": [s for s in steps if s.get("step", 0) >= 1]}, open(sys.argv[2], "w"), indent=1)' \
    "$dir/metrics.jsonl" "$out/shardrl.r$r.json"
  rm -rf "$dir/checkpoints"  # the final step's save (600 MB), not part of the measurement
  echo "round $r shardrl done $(date -u +%T) $(uptime)" >>"$out/uptime.txt"
}
run_trl() {
  local r=$1
  "$python" bench/trl_grpo/trl_grpo.py --model "$model" --steps "$steps" --threads 2 --val-size 0 \
    --out "$out/trl.r$r.json" --work-dir "$out/trl_out.r$r" >"$out/trl.r$r.log" 2>&1
  rm -rf "$out/trl_out.r$r"
  echo "round $r trl done $(date -u +%T) $(uptime)" >>"$out/uptime.txt"
}

for ((r = 1; r <= rounds; ++r)); do
  if ((r % 2)); then
    run_shardrl "$r"
    run_trl "$r"
  else
    run_trl "$r"
    run_shardrl "$r"
  fi
  # After every round, so that a run cut short still leaves the rounds it finished summarized.
  "$python" bench/trl_grpo/summarize.py "$out" --warmup "$warmup" >"$out/summary.json"
done
echo "end $(date -u +%FT%TZ) $(uptime)" >>"$out/uptime.txt"
cat "$out/summary.json"
