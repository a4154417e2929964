#!/usr/bin/env bash
# actor_rollout_ref.actor.use_prefix_grouper on the SmolLM2 GRPO job (`make smollm2`'s config, 2 ranks
# x 1 thread): the same run with each group's prompt packed once (on) and with every answer's row
# packed whole (off), interleaved, on then off in odd rounds and off then on in even ones. Take the
# exclusive lock: the seconds are what it measures.
#
#   flock -x /tmp/shardrl-cpu.lock bash bench/prefix_grouper.sh [STEPS] [ROUNDS] [OUT]
#
# STEPS (default 5) steps a run, the first not counted; ROUNDS (default 2). BUILD (default build)
# holds bin/shardrl; the model is runs/smollm2/model (scripts/smollm2-model.sh imports it). Per run
# OUT (default runs/prefix_grouper) keeps its metrics.jsonl and log, the memory plan of each setting
# (`shardrl plan --json`), and summary.json: per setting the median time_update, step_time and
# time_ref over the timed steps, the largest memory_peak_rss_gb (the largest rank's resident set)
# beside the plan's peak per rank, and the ratios off / on.
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-5}
rounds=${2:-2}
out=${3:-runs/prefix_grouper}
build=${BUILD:-build}
python=${SHARDRL_VENV:-$HOME/.cache/shardrl/venv}/bin/python
model=runs/smollm2/model
config=examples/configs/smollm2_grpo.yaml
bash scripts/smollm2-model.sh "$build"
mkdir -p "$out"
lscpu >"$out/lscpu.txt"
echo "start $(date -u +%FT%TZ) $(git rev-parse HEAD) steps=$steps rounds=$rounds $(uptime)" >>"$out/uptime.txt"

for setting in on off; do
  grouper=true
  [[ $setting == off ]] && grouper=false
  "$build/bin/shardrl" plan --json "$config" actor_rollout_ref.model.path="$model" \
    actor_rollout_ref.actor.use_prefix_grouper=$grouper >"$out/plan.$setting.json"
done

run() {  # run SETTING ROUND
  local grouper=true dir="$out/$1.r$2"
  [[ $1 == off ]] && grouper=false
  rm -rf "$dir"
  OMP_WAIT_POLICY=PASSIVE "$build/bin/shardrl" train "$config" actor_rollout_ref.model.path="$model" \
    actor_rollout_ref.actor.use_prefix_grouper=$grouper trainer.default_local_dir="$dir" \
    trainer.total_training_steps="$steps" trainer.val_before_train=false trainer.test_freq=1000000 \
    trainer.save_freq=-1 data.val_size=0 >"$out/$1.r$2.log" 2>&1
  rm -rf "$dir/checkpoints"  # the final step's save, not part of the measurement
  echo "$1 round $2 done $(date -u +%T) $(uptime)" >>"$out/uptime.txt"
}

for ((r = 1; r <= rounds; ++r)); do
  if ((r % 2)); then
    run on "$r"
    run off "$r"
  else
    run off "$r"
    run on "$r"
  fi
done
"$python" - "$out" "$rounds" >"$out/summary.json" <<'EOF'
import json, os, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
summary = {}
for setting in ("on", "off"):
    steps = []
    for r in range(1, rounds + 1):
        lines = [json.loads(l) for l in open(os.path.join(out, f"{setting}.r{r}", "metrics.jsonl"))
                 if l.strip()]
        steps += [m for m in lines if m.get("step", 0) >= 2 and "step_time" in m]
    plan = json.load(open(os.path.join(out, f"plan.{setting}.json")))
    summary[setting] = {
        "timed_steps": len(steps),
        "median_time_update_s": statistics.median(m["time_update"] for m in steps),
        "median_step_time_s": statistics.median(m["step_time"] for m in steps),
        "median_time_ref_s": statistics.median(m.get("time_ref", 0.0) for m in steps),
        "peak_rss_gb_largest_rank": max(m["memory_peak_rss_gb"] for m in steps),
        "plan_peak_per_rank_gb": plan["peak_per_rank_bytes"] / 1e9,
        "plan_update_peak_gb": plan["update_peak_bytes"] / 1e9,
    }
summary["ratio_off_over_on"] = {
    k: summary["off"][k] / summary["on"][k]
    for k in ("median_time_update_s", "median_step_time_s")}
print(json.dumps(summary, indent=1))
EOF
cat "$out/summary.json"
