#include "tasks.h"

#include <fmt/format.h>

namespace shardrl::trainer {

void register_builtin_tasks(std::map<std::string, Task>& tasks) {
  tasks["lm_pretrain"] = lm_pretrain_task();
  tasks["diffusion_rl"] = diffusion_rl_task();
  tasks["lm_grpo"] = lm_grpo_task();
}

engine::Workload::Rollout rollout_engine(const nlohmann::json& config,
                                         engine::Workload::Rollout hf_mode) {
  const auto name = get<std::string>(config, "actor_rollout_ref.rollout.name");
  if (name == "replica") return engine::Workload::Rollout::kReplica;
  if (name == "hf") return hf_mode;
  throw std::invalid_argument(fmt::format(
      "config key 'actor_rollout_ref.rollout.name' is '{}': replica (an unsharded rollout model "
      "on each rank, fed by the weight sync) or hf (the actor's sharded module samples)",
      name));
}

void sync_rollout_replica(engine::Engine& trainer, torch::nn::Module& replica,
                          const std::string& merge_adapter, bool trainable_only) {
  engine::Engine::WeightSyncOptions sync;
  sync.dtype = torch::kFloat;
  sync.merge_adapter = merge_adapter;
  sync.trainable_only = trainable_only;
  auto params = replica.named_parameters();
  torch::NoGradGuard no_grad;
  size_t received = 0;
  trainer.get_per_tensor_param(
      [&](const std::string& name, const torch::Tensor& full) {
        auto* param = params.find(name);
        if (!param) throw std::runtime_error("weight sync: the rollout model has no " + name);
        param->copy_(full);
        ++received;
      },
      sync);
  if (trainable_only ? received == 0 : received != params.size()) {
    throw std::runtime_error(fmt::format("weight sync: {} of the rollout model's {} params came",
                                         received, params.size()));
  }
}

}  // namespace shardrl::trainer
