// The config keys every task has: the trainer section and verl's engine roles. A task's table
// adds its own rows and defaults (src/trainer/<task>.cpp).
#include <fmt/format.h>

#include "config_table.h"

namespace shardrl::trainer {

using nlohmann::json;

namespace {

// Beyond this a collective timeout is a typo: 30 days.
constexpr int64_t kMaxCollectiveTimeoutSeconds = 30 * 24 * 3600;

const std::vector<std::string> kDtypes = {"fp32", "bf16", "fp16"};
const std::vector<std::string> kDtypeAliases = {"float32", "float", "bfloat16", "float16", "half"};

// The rows of one engine role, actor, ref or critic: verl's optim, fsdp_config and micro-batch
// keys, under actor_rollout_ref.<role> (the critic's under critic.).
std::vector<ConfigKey> role_keys(const std::string& role) {
  const std::string r = role == "critic" ? "critic." : "actor_rollout_ref." + role + ".";
  // The ref is forward-only: it has no optimizer.
  const std::string unused = role == "ref" ? " (unused: the ref does not train)" : "";
  // verl's critic learns at 1e-5.
  const double lr = role == "critic" ? 1e-5 : 1e-4;
  std::vector<ConfigKey> rows = {
      {r + "optim.lr", lr, number().at_least(0), "learning rate" + unused},
      {r + "optim.betas",
       {0.9, 0.999},
       list().size(2).of(number().at_least(0).below(1)),
       "AdamW's beta1, beta2" + unused},
      {r + "optim.eps", 1e-8, number().above(0), "AdamW's epsilon" + unused},
      {r + "optim.weight_decay", 0.01, number().at_least(0),
       "AdamW's decoupled weight decay" + unused},
      {r + "optim.clip_grad", 1.0, number().at_least(0),
       "clip the gradient norm to this (0: no clipping); a step whose norm is not finite is "
       "skipped" +
           unused},
      {r + "optim.warmup_style", "constant", text().one_of({"constant", "cosine"}),
       "the schedule after warmup: constant, or cosine down to min_lr_ratio" + unused},
      {r + "optim.lr_warmup_steps", -1, integer().at_least(-1),
       "warmup steps (-1: lr_warmup_steps_ratio of the run)" + unused},
      {r + "optim.lr_warmup_steps_ratio", 0.0, number().at_least(0).at_most(1),
       "warmup as a fraction of the run's steps, when lr_warmup_steps is -1" + unused},
      {r + "optim.min_lr_ratio", 0.0, number().at_least(0).at_most(1),
       "the cosine schedule's floor, as a fraction of lr" + unused},
      {r + "optim.num_cycles", 0.5, number().at_least(0),
       "cosine cycles over the run (0.5: one half-wave down to the floor)" + unused},
      {r + "fsdp_config.fsdp_size", -1, integer().at_least(-1),
       "ranks one shard group spans (-1 or 0: all; fewer: hybrid sharding, replicated groups)"},
      {r + "fsdp_config.param_offload", false, boolean(),
       "params wait in the offload tier between phases"},
      {r + "fsdp_config.optimizer_offload", false, boolean(),
       "optimizer state waits in the offload tier between phases"},
      {r + "fsdp_config.offload_policy", false, boolean(),
       "FSDP2's CPUOffloadPolicy: params and grads live in the tier throughout, each unit brought "
       "in for its compute"},
      {r + "fsdp_config.offload_tier", "file",
       text().one_of({"compute", "host", "file"},
                     {"device", "cuda", "cpu", "pinned", "nvme", "disk"}),
       "where offloaded state waits: the compute device, host memory, or files (ShardRL's key)"},
      {r + "fsdp_config.offload_dir", "", text(),
       "the file tier's folder (empty: the temp folder, one per job and rank; ShardRL's key)"},
      {r + "fsdp_config.reshard_after_forward", true, boolean(),
       "free the gathered params after forward and gather again for backward"},
      {r + "fsdp_config.forward_prefetch", 1, integer().at_least(0),
       "units whose all-gather starts ahead of use (verl's is a boolean, off)"},
      {r + "fsdp_config.host_shared_params", true, boolean(),
       "the ranks of one host share one /dev/shm image of the unsharded params (ShardRL's key)"},
      {r + "fsdp_config.mixed_precision.param_dtype", "fp32", text().one_of(kDtypes, kDtypeAliases),
       "the dtype params compute in (verl: bf16; fp32 here, as CPUs without bf16 arithmetic are "
       "slower in bf16)"},
      {r + "fsdp_config.mixed_precision.reduce_dtype", "fp32",
       text().one_of(kDtypes, kDtypeAliases), "the dtype gradients are reduced in"},
      {r + "ppo_micro_batch_size_per_gpu", 0, integer().at_least(0),
       "samples one forward and backward takes on a rank (0: the rank's whole batch; verl: null)"},
  };
  if (role == "actor") {
    rows.push_back({r + "ulysses_sequence_parallel_size", 1, integer().at_least(1),
                    "ranks each sample's sequence is split over (DeepSpeed-Ulysses); divides the "
                    "world and the attention heads"});
  } else {
    rows.push_back({r + "ulysses_sequence_parallel_size", nullptr,
                    integer().at_least(1).or_null("the actor's"),
                    fmt::format("ranks each sample's sequence is split over for the {}; divides "
                                "the actor's",
                                role)});
  }
  if (role != "critic") {
    // The critic trains in full (no adapters).
    rows.push_back({r + "optim.loraplus_lr_ratio", nullptr, number().above(0).or_null("no LoRA+"),
                    "PEFT's LoRA+: the adapters' B matrices learn at lr times this (needs "
                    "model.lora_rank > 0); ShardRL's key, verl has none" +
                        unused});
  }
  return rows;
}

}  // namespace

std::vector<ConfigKey> shared_keys() {
  std::vector<ConfigKey> rows = {
      {"trainer.task", "", text(), "the pipeline that runs (`shardrl config --list`)"},
      {"trainer.project_name", "shardrl", text(), "the project's name"},
      {"trainer.experiment_name", "run", text(), "the run's name"},
      {"trainer.default_local_dir", "runs/run", text(),
       "the run's folder: config.yaml, metrics.jsonl, checkpoints/ (verl: "
       "checkpoints/${project_name}/${experiment_name})"},
      {"trainer.nnodes", 1, integer().at_least(1),
       "nodes the job runs on: the memory plan's world (`shardrl train` alone starts one node's "
       "ranks; more need a launcher)"},
      {"trainer.n_gpus_per_node", nullptr,
       integer().at_least(1).or_null("trainer.nproc_per_node, else 2"),
       "ranks a node runs: those `shardrl train` starts when no launcher did (verl counts GPUs; "
       "here CPU ranks count too)"},
      {"trainer.nproc_per_node", nullptr, integer().at_least(1).or_null("2"),
       "the older name of n_gpus_per_node (torchrun's); set one of the two"},
      {"trainer.memory_plan_check", true, boolean(),
       "stop before any rank allocates when the memory plan exceeds what the host has (ShardRL's "
       "key; `shardrl plan` prints the plan)"},
      {"trainer.total_training_steps", 100, integer().at_least(1),
       "training steps of the run (verl: null, then total_epochs; ShardRL's tasks count steps)"},
      {"trainer.save_freq", -1, integer().at_least(-1),
       "save a checkpoint every this many steps (-1 or 0: only at the last step, which always "
       "saves)"},
      {"trainer.resume_mode", "auto", text().one_of({"auto", "disable", "resume_path"}),
       "auto: continue from the latest whole checkpoint, if any; disable: start afresh; "
       "resume_path: continue from resume_from_path"},
      {"trainer.resume_from_path", "", text().existing_folder(),
       "the checkpoint folder (global_step_N) resume_mode resume_path continues from"},
      {"trainer.max_actor_ckpt_to_keep", 2, integer().at_least(0),
       "checkpoints kept, the oldest removed first (0: all; verl: null keeps all)"},
      {"trainer.max_mem_gb", 0.0, number().at_least(0),
       "GiB the kept checkpoints may take on disk, the oldest removed first (0: no limit; "
       "ShardRL's key)"},
      {"trainer.seed", 0, integer().at_least(0), "seeds the weights, the data and the sampling"},
      {"trainer.logger",
       {"console", "file"},
       list().of(text().one_of({"console", "file", "tensorboard"})),
       "where metrics go: console step lines, file (metrics.jsonl), tensorboard (event files under "
       "$TENSORBOARD_DIR, else tensorboard_log/<project>/<experiment>); one name is a list of one"},
      {"actor_rollout_ref.nccl_timeout", 600,
       integer().at_least(1).at_most(kMaxCollectiveTimeoutSeconds),
       "seconds any collective and the rendezvous may take before the run stops naming it (Gloo "
       "and NCCL alike)"},
      {"actor_rollout_ref.model.family", nullptr, text().one_of({"gpt", "llama"}).or_null("llama"),
       "a language model built from ShardRL's own families (the diffusion model types build an "
       "SD3 MMDiT; ShardRL's key)"},
      {"actor_rollout_ref.model.config", nullptr, mapping().or_null("the family's defaults"),
       "the model's config.json fields, for a model built here rather than read from model.path "
       "(ShardRL's key)"},
      {"actor_rollout_ref.model.path", "", text().existing_path(),
       "pretrained weights: a safetensors file, or a Hugging Face folder (empty: a fresh model)"},
      {"actor_rollout_ref.model.lora_rank", 0, integer().at_least(0),
       "LoRA adapters' rank (0: no adapters, every param trains)"},
      {"actor_rollout_ref.model.lora_alpha", 16.0, number().above(0),
       "LoRA's alpha: the adapters' update is scaled by alpha / rank"},
      {"actor_rollout_ref.model.lora_dropout", 0.0, number().at_least(0).below(1),
       "dropout on the adapters' input"},
      {"actor_rollout_ref.model.target_modules", nullptr,
       list().of(text()).or_null("the family's attention projections"),
       "the linear layers that get adapters, by name (PEFT's)"},
      {"actor_rollout_ref.model.enable_gradient_checkpointing", false, boolean(),
       "recompute each block's activations in backward instead of keeping them (verl: true; off "
       "here, where the demo models are small)"},
  };
  for (const char* role : {"actor", "ref"}) {
    for (auto& row : role_keys(role)) rows.push_back(std::move(row));
  }
  return rows;
}

std::vector<ConfigKey> critic_keys() {
  std::vector<ConfigKey> rows = {
      {"critic.enable", nullptr, boolean().or_null("on with algorithm.adv_estimator gae"),
       "train a critic (value model) beside the actor, as PPO with GAE needs"},
      {"critic.model.path", nullptr, text().existing_folder("config.json").or_null("the actor's"),
       "the causal LM folder the critic's decoder is read from; a new `score` head is added "
       "unless the folder has one (a critic export)"},
      {"critic.model.enable_gradient_checkpointing", nullptr, boolean().or_null("the actor's"),
       "recompute each block's activations in the critic's backward"},
      {"critic.cliprange_value", 0.5, number().at_least(0),
       "how far a new value may move from the rollout's value before its error is clipped"},
      {"critic.loss_agg_mode", nullptr,
       text()
           .one_of({"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                    "seq-mean-token-sum-norm"})
           .or_null("the actor's"),
       "how the value loss's tokens are aggregated"},
      {"trainer.critic_warmup", 0, integer().at_least(0),
       "the actor trains from this step on (verl's: steps before it update the critic alone)"},
      {"trainer.max_critic_ckpt_to_keep", nullptr,
       integer().at_least(0).or_null("trainer.max_actor_ckpt_to_keep"),
       "critic checkpoints kept (checkpoints/critic/global_step_N), the oldest removed first (0: "
       "all)"},
  };
  for (auto& row : role_keys("critic")) rows.push_back(std::move(row));
  return rows;
}

std::vector<ConfigKey> rollout_task_keys() {
  return {
      {"trainer.test_freq", -1, integer().at_least(-1),
       "validate every this many steps (-1 or 0: only at the last step)"},
      {"trainer.val_before_train", true, boolean(), "validate before the first step too"},
      {"trainer.rollout_data_dir", nullptr, text().or_null("off"),
       "each step's rollouts as <dir>/<step>.jsonl, one JSON object a sample (empty or null: off)"},
      {"actor_rollout_ref.rollout.name", "replica", text().one_of({"replica", "hf"}),
       "who samples: replica (an unsharded rollout model on each rank, fed by the weight sync, in "
       "the role verl gives vLLM) or hf (the actor's own sharded module, no second copy)"},
  };
}

void check_shared_relations(const json& config) {
  if (get<std::string>(config, "trainer.resume_mode") == "resume_path" &&
      get<std::string>(config, "trainer.resume_from_path").empty()) {
    throw std::invalid_argument(
        "config key 'trainer.resume_from_path' must name a checkpoint directory when "
        "trainer.resume_mode is resume_path");
  }
  for (const char* role : {"actor", "ref"}) {
    const std::string key = fmt::format("actor_rollout_ref.{}.optim.loraplus_lr_ratio", role);
    if (!at(config, key).is_null() &&
        get<int64_t>(config, "actor_rollout_ref.model.lora_rank") <= 0) {
      throw std::invalid_argument(
          fmt::format("config key '{}' is set, but the model has no LoRA adapters "
                      "(actor_rollout_ref.model.lora_rank is 0)",
                      key));
    }
  }
}

}  // namespace shardrl::trainer
