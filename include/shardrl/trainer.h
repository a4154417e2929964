// The trainer: YAML configs in verl's names and `shardrl train`.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "shardrl/engine.h"
#include "shardrl/memory_plan.h"

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
// names. Without a launcher environment it starts trainer.n_gpus_per_node (or its older name
// trainer.nproc_per_node) local ranks of itself, once its memory plan fits this host.
int train_main(const std::string& config_path, const std::vector<std::string>& overrides,
               const std::string& self_exe);

// What the memory plan needs of a task: the actor's engine and what one rank runs with it.
struct PlanInput {
  engine::EngineConfig engine;
  engine::Workload workload;
};

// A pipeline (e.g. "fmnist_flow_grpo") registers its defaults and entry point, and how its memory
// is planned (none: `shardrl plan` and the check before `shardrl train` say the task has no plan).
struct Task {
  std::function<nlohmann::json()> defaults;
  std::function<int(const nlohmann::json& config, std::shared_ptr<dist::World> world)> run;
  std::function<PlanInput(const nlohmann::json& config, const engine::Layout& layout)> plan;
};
void register_task(const std::string& name, Task task);

// Local ranks a node runs: trainer.n_gpus_per_node (verl's name), or trainer.nproc_per_node
// (torchrun's, which ShardRL's configs used first); the two must agree when both are set, and
// neither set means 2. Errors name the keys.
int ranks_per_node(const nlohmann::json& config);
// trainer.nnodes x ranks_per_node on `device`.
engine::Layout layout_of(const nlohmann::json& config, torch::DeviceType device);

// The memory plan of a whole config (trainer defaults, the task's, the file, the overrides).
engine::MemoryPlan memory_plan(const nlohmann::json& config, const engine::Layout& layout);
// The plan against `capacity_bytes` (per host on a CPU, per device on a GPU): nothing when it fits;
// else std::invalid_argument naming what does not fit and the settings (key=value overrides) with
// which the same job's plan fits.
void check_memory_plan(const nlohmann::json& config, const engine::Layout& layout,
                       int64_t capacity_bytes);

// `shardrl plan CONFIG [key=value ...]`: the plan printed without running (JSON with `json`).
// capacity_bytes 0: this host's available memory (CPU) or no check (GPU).
struct PlanOptions {
  std::optional<torch::DeviceType> device;  // unset: CUDA when a GPU is visible, else CPU
  int64_t capacity_bytes = 0;
  bool json = false;
};
int plan_main(const std::string& config_path, const std::vector<std::string>& overrides,
              const PlanOptions& options);

}  // namespace shardrl::trainer
