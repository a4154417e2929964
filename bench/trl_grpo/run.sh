#!/usr/bin/env bash
# ShardRL (`shardrl train examples/configs/smollm2_grpo.yaml`) beside TRL's GRPOTrainer
# (bench/trl_grpo/trl_grpo.py) on the same SmolLM2 GRPO job. Take the exclusive lock: the seconds
# are what it measures. Two modes:
#
#   flock -x /tmp/shardrl-cpu.lock bash bench/trl_grpo/run.sh [STEPS] [WARMUP] [ROUNDS] [OUT]
#   flock -x /tmp/shardrl-cpu.lock bash bench/trl_grpo/run.sh accuracy [STEPS] [OUT]
#
# Timing: STEPS (default 6) steps a run, the first WARMUP (default 1) not counted; ROUNDS
# (default 2) rounds of one ShardRL run and one TRL run, ShardRL first in odd rounds, TRL first in
# even ones. Both sides skip validation (data.val_size=0; TRL's script draws the same problems,
# step for step). OUT (default runs/trl_grpo) receives per run a JSON (shardrl.rR.json: its
# metrics.jsonl's steps; trl.rR.json), its log, uptime and lscpu, and summary.json
# (bench/trl_grpo/summarize.py).
#
# Accuracy: one ShardRL run and one TRL run of STEPS (default 16) steps, training on the same
# problems with the data.val_size=50 held-out ones left out; each side's adapter (ShardRL's by
# `shardrl export --adapter default`, TRL's by save_pretrained) and the base model are scored by
# eval_heldout.py (transformers + PEFT, greedy); compare_val.py sets the scorer's answers for
# ShardRL's adapter beside the ones ShardRL's own validation logged. OUT (default
# runs/trl_grpo_accuracy) gets accuracy.json (bench/trl_grpo/summarize.py --accuracy).
#
# SEED (default 0) is trainer.seed on both sides. BUILD (default build) holds bin/shardrl. The
# model is runs/smollm2/model, imported from the GGUF as scripts/smollm2.sh does when it is
# missing. Gradient checkpointing is off on both sides (TRL's GRPO default turns it on; the
# SmolLM2 config turns it on for memory).
set -euo pipefail
cd "$(dirname "$0")/../.."
mode=timing
if [[ ${1:-} == accuracy ]]; then
  mode=accuracy
  steps=${2:-16}
  warmup=0
  rounds=1
  out=${3:-runs/trl_grpo_accuracy}
else
  steps=${1:-6}
  warmup=${2:-1}
  rounds=${3:-2}
  out=${4:-runs/trl_grpo}
fi
seed=${SEED:-0}
build=${BUILD:-build}
python=${SHARDRL_VENV:-$HOME/.cache/shardrl/venv}/bin/python
model=runs/smollm2/model
bash scripts/smollm2-model.sh "$build"
mkdir -p "$out"
lscpu >"$out/lscpu.txt"
{
  echo "start $(date -u +%FT%TZ) $(uptime)"
  echo "shardrl $(git rev-parse HEAD) build=$build mode=$mode steps=$steps warmup=$warmup rounds=$rounds seed=$seed"
} >>"$out/uptime.txt"

# Accuracy runs validate on the held-out problems; timing runs skip them on both sides.
val_size=0
[[ $mode == accuracy ]] && val_size=50

run_shardrl() {
  local r=$1 dir="$out/shardrl.r$1"
  local -a val=(data.val_size=0 trainer.val_before_train=false trainer.test_freq=1000000)
  if [[ $mode == accuracy ]]; then
    # ShardRL's own validation at the last step, its answers logged to TensorBoard for compare_val.py.
    val=(data.val_size=$val_size trainer.val_before_train=false trainer.test_freq="$steps"
      trainer.log_val_generations=$val_size "trainer.logger=[console, file, tensorboard]")
  fi
  rm -rf "$dir" "$out/tb.shardrl.r$r"
  # 2 ranks x 1 thread, as `make smollm2` runs it.
  TENSORBOARD_DIR="$out/tb.shardrl.r$r" OMP_WAIT_POLICY=PASSIVE "$build/bin/shardrl" train \
    examples/configs/smollm2_grpo.yaml \
    actor_rollout_ref.model.path="$model" trainer.default_local_dir="$dir" \
    actor_rollout_ref.model.enable_gradient_checkpointing=false trainer.seed="$seed" \
    trainer.total_training_steps="$steps" trainer.save_freq=-1 "${val[@]}" \
    >"$out/shardrl.r$r.log" 2>&1
  "$python" -c 'import json, sys
steps = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
json.dump({"impl": "shardrl", "processes": 2, "threads": 1,
           "steps": [s for s in steps if s.get("step", 0) >= 1 and "step_time" in s]},
          open(sys.argv[2], "w"), indent=1)' \
    "$dir/metrics.jsonl" "$out/shardrl.r$r.json"
  if [[ $mode == accuracy ]]; then
    rm -rf "$out/shardrl.adapter"
    "$build/bin/shardrl" export "$dir/checkpoints/global_step_$steps" "$out/shardrl.adapter" \
      --adapter default >>"$out/shardrl.r$r.log" 2>&1
  fi
  rm -rf "$dir/checkpoints"  # the final step's save (600 MB), not part of the measurement
  echo "round $r shardrl done $(date -u +%T) $(uptime)" >>"$out/uptime.txt"
}
run_trl() {
  local r=$1
  local -a save=()
  [[ $mode == accuracy ]] && save=(--adapter-out "$out/trl.adapter")
  "$python" bench/trl_grpo/trl_grpo.py --model "$model" --steps "$steps" --threads 2 \
    --val-size "$val_size" --seed "$seed" --out "$out/trl.r$r.json" --work-dir "$out/trl_out.r$r" \
    "${save[@]}" >"$out/trl.r$r.log" 2>&1
  rm -rf "$out/trl_out.r$r"
  echo "round $r trl done $(date -u +%T) $(uptime)" >>"$out/uptime.txt"
}
heldout() {  # heldout NAME [ADAPTER]
  "$python" bench/trl_grpo/eval_heldout.py --model "$model" ${2:+--adapter "$2"} \
    --val-size "$val_size" --seed "$seed" --out "$out/$1.heldout.json" >>"$out/heldout.log" 2>&1
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
if [[ $mode == accuracy ]]; then
  heldout base
  heldout shardrl "$out/shardrl.adapter"
  heldout trl "$out/trl.adapter"
  "$python" bench/trl_grpo/compare_val.py --heldout "$out/shardrl.heldout.json" \
    --run "$out/shardrl.r1" --tensorboard "$out/tb.shardrl.r1" --out "$out/compare_val.json"
  "$python" bench/trl_grpo/summarize.py "$out" --warmup 1 --accuracy >"$out/accuracy.json"
fi
echo "end $(date -u +%FT%TZ) $(uptime)" >>"$out/uptime.txt"
cat "$out/summary.json"
[[ $mode == accuracy ]] && cat "$out/accuracy.json"
exit 0
