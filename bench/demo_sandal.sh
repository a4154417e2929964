#!/usr/bin/env bash
# The demo's weakest class (issue 43, part 4): what the supervised stage's recipe, the sampler and the
# RL stage's reward do to the sandal row. Each variant is `make demo`'s job with overrides; its
# summary.json has eval_realism_per_class_before and _after. Recipe and sampler variants run one RL
# step (their figures are the evaluation before RL); the rl_* variants run the demo's 64 RL steps
# (their figures are after RL). Variants that keep the recipe reuse the demo's cached pretrained MMDiT
# (runs/demo/cache: run `make demo` first); those that change it pretrain their own. Take the
# exclusive lock: pretraining and RL seconds are reported.
#
#   flock -x /tmp/shardrl-cpu.lock bash bench/demo_sandal.sh [OUT] [VARIANT ...]
#
# OUT (default runs/sandal) gets one folder per variant and table.json (per variant: reward, realism,
# p(class), classifier agreement and the sandal row's realism, before and after RL; pretraining and
# RL seconds). No VARIANT: all of them.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/sandal}
shift || true
build=${BUILD:-build}
venv=${SHARDRL_VENV:-$HOME/.cache/shardrl/venv}
python=$venv/bin/python
cache=runs/demo/cache
rl="pretrain.cache_dir=$cache trainer.total_training_steps=64"  # wins over the one step below
declare -A overrides=(
  [baseline]="pretrain.cache_dir=$cache"
  [pretrain_lr_4e-3]="pretrain.lr=4.0e-3"
  [layers3_steps600]="pretrain.steps=600 actor_rollout_ref.model.config.num_layers=3"
  [batch64_steps1800]="pretrain.steps=1800 pretrain.batch_size=64"
  [eval_steps50]="pretrain.cache_dir=$cache actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps=50"
  [shift3]="pretrain.cache_dir=$cache actor_rollout_ref.rollout.pipeline.shift=3.0"
  [shift0.5]="pretrain.cache_dir=$cache actor_rollout_ref.rollout.pipeline.shift=0.5"
  [cfg3]="pretrain.cache_dir=$cache actor_rollout_ref.rollout.pipeline.true_cfg_scale=3.0"
  [cfg5]="pretrain.cache_dir=$cache actor_rollout_ref.rollout.pipeline.true_cfg_scale=5.0"
  # The demo repeats the sandal images 6x in the pretraining pool (pretrain.class_repeats).
  [repeat_sandal1]="pretrain.class_repeats.sandal=1"
  [repeat_sandal3]="pretrain.class_repeats.sandal=3"
  [repeat_sandal10]="pretrain.class_repeats.sandal=10"
  [patch2_width48]="actor_rollout_ref.model.config.patch_size=2 actor_rollout_ref.model.config.num_attention_heads=3"
  # The RL stage, 64 steps on the cached model: the realism scorer's weight, the KL and the lr.
  [rl_realism1]="$rl reward.reward_functions.realism.weight=1.0"
  [rl_realism3]="$rl reward.reward_functions.realism.weight=3.0"
  [rl_realism5]="$rl reward.reward_functions.realism.weight=5.0"
  [rl_realism1_kl0.01]="$rl reward.reward_functions.realism.weight=1.0 actor_rollout_ref.actor.kl_loss_coef=0.01"
  [rl_realism1_lr3e-3]="$rl reward.reward_functions.realism.weight=1.0 actor_rollout_ref.actor.optim.lr=3.0e-3"
  [rl_realism3_kl0.01]="$rl reward.reward_functions.realism.weight=3.0 actor_rollout_ref.actor.kl_loss_coef=0.01"
  # 64 RL steps on a model pretrained with each class once (its own cache, as repeat_sandal1's).
  [rl_repeat_sandal1]="trainer.total_training_steps=64 pretrain.class_repeats.sandal=1"
)
variants=("$@")
if [[ ${#variants[@]} -eq 0 ]]; then
  variants=(baseline pretrain_lr_4e-3 layers3_steps600 batch64_steps1800 eval_steps50 shift3 shift0.5
    cfg3 cfg5 repeat_sandal1 repeat_sandal3 repeat_sandal10 patch2_width48 rl_repeat_sandal1
    rl_realism1 rl_realism3 rl_realism5 rl_realism1_kl0.01 rl_realism1_lr3e-3 rl_realism3_kl0.01)
fi
mkdir -p "$out"
lscpu >"$out/lscpu.txt"
for v in "${variants[@]}"; do
  [[ -n ${overrides[$v]+set} ]] || { echo "demo_sandal: unknown variant '$v'" >&2; exit 2; }
  # Variants with their own recipe pretrain into their own cache, never into the demo's.
  # shellcheck disable=SC2086
  OMP_WAIT_POLICY=PASSIVE bash scripts/demo.sh "$build" "trainer.default_local_dir=$out/$v" \
    "pretrain.cache_dir=$out/$v/cache" trainer.total_training_steps=1 trainer.save_freq=-1 \
    "trainer.logger=[console, file]" ${overrides[$v]} >"$out/$v.log" 2>&1
done
"$python" - "$out" "${variants[@]}" <<'PY'
import json, sys
out, rows = sys.argv[1], {}
for v in sys.argv[2:]:
    s = json.load(open(f"{out}/{v}/summary.json"))
    rows[v] = {f"{k}_{when}": s[f"{k}_{when}"] for when in ("before", "after")
               for k in ("eval_reward", "eval_realism", "eval_class_prob", "eval_accuracy")}
    for when in ("before", "after"):
        rows[v][f"sandal_realism_{when}"] = s[f"eval_realism_per_class_{when}"]["sandal"]
    rows[v].update(pretrain_seconds=s["pretrain_seconds"], rl_seconds_per_step=s["rl_seconds_per_step"],
                   rl_seconds=s["rl_seconds"])
json.dump(rows, open(f"{out}/table.json", "w"), indent=1)
print(json.dumps(rows, indent=1))
PY
