// The trainer: YAML configs in verl's names and `shardrl train`.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "shardrl/engine.h"

namespace shardrl::trainer {

// A config is `defaults` with the YAML file laid over it, then each "dotted.key=value" override
// (the value parsed as YAML, so 3, 0.5, true and [a, b] keep their types). A key the defaults do
// not have, a value whose type differs from the default's, or unparsable YAML is an error naming
// the key and the file. A default of null accepts any value. A key renamed to verl's or
// verl-omni's name (algorithm.kl_beta, sample.num_steps, ...) is an error naming the old key, the
// new one and where the old one came from, for every task, whatever the defaults hold.
nlohmann::json load_config(const std::string& path, const std::vector<std::string>& overrides,
                           const nlohmann::json& defaults);
nlohmann::json merge_config(const nlohmann::json& defaults, const nlohmann::json& config,
                            const std::string& source);
nlohmann::json yaml_to_json(const std::string& yaml_text, const std::string& source);

// The value at a dotted path; errors name the key.
const nlohmann::json& at(const nlohmann::json& config, const std::string& dotted_key);
template <class T>
T get(const nlohmann::json& config, const std::string& dotted_key) {
  const auto& value = at(config, dotted_key);
  try {
    return value.get<T>();
  } catch (const nlohmann::json::exception&) {
    throw std::invalid_argument("config key '" + dotted_key +
                                "' has the wrong type: " + value.dump());
  }
}

// The engine settings of one role (actor or ref) in verl's layout:
//   model: {family, config, path, lora_rank, lora_alpha, target_modules, ...}
//   <role>.optim: {lr, weight_decay, betas, clip_grad, lr_warmup_steps_ratio, warmup_style, ...}
//   <role>.fsdp_config: {fsdp_size, param_offload, optimizer_offload, reshard_after_forward,
//                        mixed_precision: {param_dtype, reduce_dtype}}
//   <role>.ppo_micro_batch_size_per_gpu
engine::EngineConfig engine_config(const nlohmann::json& config, const std::string& model_type,
                                   const std::string& role);
// The defaults engine_config reads, for a config's defaults document.
nlohmann::json engine_defaults();

// `shardrl train CONFIG.yaml [key=value ...]`: runs the pipeline the config's `trainer.task`
// names. Without a launcher environment it starts trainer.nproc_per_node local ranks of itself.
int train_main(const std::string& config_path, const std::vector<std::string>& overrides,
               const std::string& self_exe);

// A pipeline (e.g. "fmnist_flow_grpo") registers its defaults and entry point.
struct Task {
  std::function<nlohmann::json()> defaults;
  std::function<int(const nlohmann::json& config, std::shared_ptr<dist::World> world)> run;
};
void register_task(const std::string& name, Task task);

}  // namespace shardrl::trainer
