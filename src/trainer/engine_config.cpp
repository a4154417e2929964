// verl's actor_rollout_ref layout, read into an EngineConfig. The keys, their defaults and the
// values they take are rows of the config table (shared_keys.cpp), checked before any rank starts.
#include <fmt/format.h>

#include "shardrl/trainer.h"
#include "shardrl/ulysses.h"
#include "tasks.h"

namespace shardrl::trainer {

using nlohmann::json;

namespace {
// Where a role's keys sit: actor_rollout_ref.<role>, and the critic's at the top, as verl's.
std::string role_section(const std::string& role) {
  return role == "critic" ? "critic" : "actor_rollout_ref." + role;
}

// The key that sets a role's sequence parallelism: its own, or the actor's when the ref's or the
// critic's is null.
std::string sequence_parallel_key(const json& config, const std::string& role) {
  const std::string key = role_section(role) + ".ulysses_sequence_parallel_size";
  if (role != "actor" && at(config, key).is_null()) {
    return "actor_rollout_ref.actor.ulysses_sequence_parallel_size";
  }
  return key;
}
}  // namespace

int ulysses_sequence_parallel_size(const json& config, const std::string& role) {
  return get<int>(config, sequence_parallel_key(config, role));
}

void check_sequence_parallel(const json& config, int world_size) {
  std::vector<std::string> roles = {"actor", "ref"};
  if (config.contains("critic")) roles.push_back("critic");  // the tasks that have one
  for (const auto& role : roles) {
    const auto sp = ulysses_sequence_parallel_size(config, role);
    if (world_size % sp != 0) {
      throw std::invalid_argument(
          fmt::format("config key '{}' ({}) must divide the world size {} (the ranks form "
                      "data-parallel groups of sp sequence-parallel ranks)",
                      sequence_parallel_key(config, role), sp, world_size));
    }
  }
  // The ref and the critic compute columns of the actor's samples: each of their groups must lie
  // inside one of the actor's, whose ranks hold the same samples.
  const auto actor = ulysses_sequence_parallel_size(config, "actor");
  for (size_t i = 1; i < roles.size(); ++i) {
    const auto sp = ulysses_sequence_parallel_size(config, roles[i]);
    if (actor % sp != 0) {
      throw std::invalid_argument(fmt::format(
          "config key '{}' ({}) must divide "
          "'actor_rollout_ref.actor.ulysses_sequence_parallel_size' ({}): a {} group must split "
          "samples that one actor group holds",
          sequence_parallel_key(config, roles[i]), sp, actor, roles[i]));
    }
  }
}

void check_sequence_parallel_heads(const json& config, const std::string& role, int64_t heads,
                                   int64_t kv_heads) {
  try {
    ulysses::check_heads(heads, kv_heads, ulysses_sequence_parallel_size(config, role));
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(
        fmt::format("config key '{}': {}", sequence_parallel_key(config, role), e.what()));
  }
}

engine::EngineConfig engine_config(const json& config, const std::string& model_type,
                                   const std::string& role) {
  const std::string base = role_section(role);
  engine::EngineConfig c;
  c.model_type = model_type;
  c.model = at(config, "actor_rollout_ref.model");
  if (role == "critic") {
    // verl's critic is the actor's model with a value head, trained in full; critic.model's keys
    // replace the actor's where set.
    c.model["lora_rank"] = 0;
    c.model["seed"] = get<int64_t>(config, "trainer.seed");
    if (!at(config, "critic.model.path").is_null()) {
      c.model["path"] = get<std::string>(config, "critic.model.path");
    }
    if (!at(config, "critic.model.enable_gradient_checkpointing").is_null()) {
      c.model["enable_gradient_checkpointing"] =
          get<bool>(config, "critic.model.enable_gradient_checkpointing");
    }
  }
  c.forward_only = role == "ref";
  c.micro_batch_size_per_gpu = get<int64_t>(config, base + ".ppo_micro_batch_size_per_gpu");

  const std::string f = base + ".fsdp_config";
  c.fsdp_size = get<int>(config, f + ".fsdp_size");
  c.ulysses_sequence_parallel_size = ulysses_sequence_parallel_size(config, role);
  c.fsdp.reshard_after_forward = get<bool>(config, f + ".reshard_after_forward");
  c.fsdp.prefetch = get<int>(config, f + ".forward_prefetch");
  c.fsdp.host_shared_params = get<bool>(config, f + ".host_shared_params");
  c.offload.param_offload = get<bool>(config, f + ".param_offload");
  c.offload.optimizer_offload = get<bool>(config, f + ".optimizer_offload");
  c.offload.tier =
      offload::parse_tier(get<std::string>(config, f + ".offload_tier"), f + ".offload_tier");
  c.offload.dir = get<std::string>(config, f + ".offload_dir");
  c.offload_policy = get<bool>(config, f + ".offload_policy");
  c.fsdp.mixed_precision.param_dtype =
      fsdp::parse_dtype(get<std::string>(config, f + ".mixed_precision.param_dtype"),
                        f + ".mixed_precision.param_dtype");
  c.fsdp.mixed_precision.reduce_dtype =
      fsdp::parse_dtype(get<std::string>(config, f + ".mixed_precision.reduce_dtype"),
                        f + ".mixed_precision.reduce_dtype");

  const std::string o = base + ".optim";
  c.optim.lr = get<double>(config, o + ".lr");
  const auto betas = get<std::vector<double>>(config, o + ".betas");
  c.optim.beta1 = betas[0];
  c.optim.beta2 = betas[1];
  c.optim.eps = get<double>(config, o + ".eps");
  c.optim.weight_decay = get<double>(config, o + ".weight_decay");
  c.optim.clip_grad = get<double>(config, o + ".clip_grad");
  if (role != "critic" && !at(config, o + ".loraplus_lr_ratio").is_null()) {
    c.optim.loraplus_lr_ratio = get<double>(config, o + ".loraplus_lr_ratio");
  }
  auto& s = c.optim.schedule;
  s.warmup_style = get<std::string>(config, o + ".warmup_style");
  s.lr_warmup_steps = get<int64_t>(config, o + ".lr_warmup_steps");
  s.lr_warmup_steps_ratio = get<double>(config, o + ".lr_warmup_steps_ratio");
  s.min_lr_ratio = get<double>(config, o + ".min_lr_ratio");
  s.num_cycles = get<double>(config, o + ".num_cycles");
  s.total_training_steps = get<int64_t>(config, "trainer.total_training_steps");

  if (role == "critic") {
    // The critic's checkpoints are rotated by the run once the actor's step is saved
    // (Run::after_step), so a crash between the two saves never leaves a step of one alone.
    c.checkpoint.max_ckpt_to_keep = 0;
  } else {
    c.checkpoint.max_ckpt_to_keep = get<int>(config, "trainer.max_actor_ckpt_to_keep");
    c.checkpoint.max_mem_gb = get<double>(config, "trainer.max_mem_gb");
  }
  return c;
}

}  // namespace shardrl::trainer
