#!/usr/bin/env bash
# Full fine-tuning beyond RAM, resumed bitwise, within one disk's room: fp32 params, grads and
# AdamW state in the file tier (bench/realsize/lm_full_offload.yaml), with a checkpoint (params
# and AdamW state, 12 bytes a param) beside them. Two such checkpoints and the file tier do not fit
# this machine's disk at 1.7B params, so the three runs keep one at a time:
#   straight   3 steps (saved at the last), the checkpoint's files hashed, then removed;
#   to_2       steps 1-2, saved at step 2;
#   resume_to_3  resumes from step 2 and trains step 3 (saved); the step-2 checkpoint is removed
#              once the run has loaded it (its "resumed from" line), as a user short of disk would.
# The step-3 checkpoint of the resumed run must hash as the straight run's, file by file, and its
# step-3 metrics equal. Then `shardrl export` of it.
#   bench/realsize/full_offload_bitwise.sh MODEL_DIR OUT [key=value ...]
# Run it alone (its figures are timings and memory peaks).
set -euo pipefail
[ $# -ge 2 ] || { sed -n '2,14p' "$0" >&2; exit 2; }
model=$1 out=$2
shift 2
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${BUILD:-$root/build}/bin/shardrl
config=$root/bench/realsize/lm_full_offload.yaml
mkdir -p "$out"
out=$(cd "$out" && pwd)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
common=("actor_rollout_ref.model.path=$model" "$@")
hashes() {  # hashes CHECKPOINT_DIR: sha256 of every file, by path inside it
  (cd "$1" && find . -type f | sort | xargs sha256sum)
}
# shellcheck source=bench/realsize/timed.sh
source "$root/bench/realsize/timed.sh"
run() {  # run NAME COMMAND...: timed, then the run's step, save and resume lines
  timed "$@"
  grep -E "step [0-9]+/|saved|resumed from" "$out/$1.log" | cut -c1-200 || true
}
df -h "$out" | tee "$out/df_before.txt"
"$bin" plan "$config" "${common[@]}" trainer.default_local_dir="$out/straight" --json >"$out/plan.json"
if [ ! -f "$out/straight.sha256" ]; then
  rm -rf "$out/straight"
  run straight "$bin" train "$config" "${common[@]}" trainer.default_local_dir="$out/straight" \
    trainer.save_freq=-1
  hashes "$out/straight/checkpoints/global_step_3" >"$out/straight.sha256"
  rm -rf "$out/straight/checkpoints"
fi
rm -rf "$out/run"
run to_2 "$bin" train "$config" "${common[@]}" trainer.default_local_dir="$out/run" \
  trainer.total_training_steps=2
du -sb "$out/run/checkpoints/global_step_2" | tee "$out/checkpoint_bytes.txt"
# The resumed run, with the step-2 checkpoint removed once loaded.
(
  while ! grep -q "resumed from" "$out/resume_to_3.log" 2>/dev/null; do sleep 2; done
  rm -rf "$out/run/checkpoints/global_step_2"
  echo "removed global_step_2 after the load: $(date -u +%T)" >"$out/removed.txt"
) &
watcher=$!
run resume_to_3 "$bin" train "$config" "${common[@]}" trainer.default_local_dir="$out/run"
wait "$watcher" || true
hashes "$out/run/checkpoints/global_step_3" >"$out/resumed.sha256"
if cmp -s "$out/straight.sha256" "$out/resumed.sha256"; then
  echo "bitwise: the resumed run's step-3 checkpoint hashes as the straight run's ($(wc -l <"$out/resumed.sha256") files)" | tee "$out/bitwise.txt"
else
  echo "NOT bitwise: the step-3 checkpoints differ" | tee "$out/bitwise.txt"
  diff "$out/straight.sha256" "$out/resumed.sha256" | head
fi
run export "$bin" export "$out/run/checkpoints/global_step_3" "$out/export"
du -sb "$out/export" | tee "$out/export_bytes.txt"
rm -rf "$out/run/checkpoints"
