#include "tasks.h"

#include <fmt/format.h>

#include "shardrl/models/lora.h"

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

void add_trainer_adapters(torch::nn::Module& replica, const engine::Engine& trainer) {
  const auto& info = trainer.export_info();
  if (!info.contains("lora")) return;
  for (const auto& [name, peft] : info["lora"].items()) {
    models::lora::apply_lora(replica, models::lora::config_from_peft(peft, "lora." + name), name,
                             /*trainable=*/false);
  }
  models::lora::set_active_adapter(replica, "default");
}

void check_rollout_replica(engine::Engine& trainer, torch::nn::Module& replica,
                           const std::string& adapter) {
  torch::NoGradGuard no_grad;
  // The replica's LoRA layers that carry `adapter`, by their base weight's name.
  std::map<std::string, models::lora::LoraLinearImpl*> merged;
  if (!adapter.empty()) {
    for (const auto& [name, layer] : models::lora::lora_linears(replica)) {
      if (layer->has_adapter(adapter)) merged[name.empty() ? "weight" : name + ".weight"] = layer;
    }
    if (merged.empty()) {
      throw std::runtime_error(fmt::format(
          "weight sync check: the rollout model has no layer with adapter '{}'", adapter));
    }
  }
  auto params = replica.named_parameters();
  size_t checked = 0;
  engine::Engine::WeightSyncOptions sync;
  sync.dtype = torch::kFloat;
  sync.merge_adapter = adapter;
  trainer.get_per_tensor_param(
      [&](const std::string& name, const torch::Tensor& want) {
        auto* param = params.find(name);
        if (!param) throw std::runtime_error("weight sync check: the rollout model has no " + name);
        torch::Tensor got = *param;
        if (auto it = merged.find(name); it != merged.end()) {
          const auto* layer = it->second;
          got = got + models::lora::delta_weight(layer->lora_A(adapter), layer->lora_B(adapter),
                                                 layer->adapter_config(adapter).scaling());
        }
        if (!torch::equal(got, want)) {
          throw std::runtime_error(fmt::format(
              "weight sync check: the rollout model's {}{} differs from the trainer's by up to {} "
              "after the sync",
              name, merged.count(name) ? fmt::format(" (adapter '{}' merged)", adapter) : "",
              (got - want).abs().max().item<double>()));
        }
        ++checked;
      },
      sync);
  size_t expected = 0;
  for (const auto& item : params) {
    expected += adapter.empty() || !models::lora::is_adapter_tensor(item.key()) ? 1 : 0;
  }
  if (checked != expected) {
    throw std::runtime_error(
        fmt::format("weight sync check: {} of the rollout model's {} weights came to compare",
                    checked, expected));
  }
}

}  // namespace shardrl::trainer
