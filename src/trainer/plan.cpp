// The memory plan of a config: `shardrl plan`, and the check `shardrl train` makes before any rank
// allocates (memory_plan.h holds the formula; here, the config's side of it).
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <iostream>

#include "shardrl/trainer.h"
#include "tasks.h"

namespace shardrl::trainer {
namespace {

using nlohmann::json;

// A positive integer at `key`, or nullopt when it is null; errors name the key.
std::optional<int> optional_count(const json& config, const std::string& key) {
  const auto& value = at(config, key);
  if (value.is_null()) return std::nullopt;
  if (!value.is_number_integer() || value.get<int64_t>() < 1 || value.get<int64_t>() > 1 << 20) {
    throw std::invalid_argument(
        fmt::format("config key '{}' must be an integer >= 1, got {}", key, value.dump()));
  }
  return value.get<int>();
}

std::string gb(int64_t bytes) {
  return fmt::format("{:.1f} GB", static_cast<double>(bytes) / 1e9);
}

// What the plan is held against: a host's memory on a CPU, a device's on a GPU.
int64_t needed(const engine::MemoryPlan& plan) {
  return plan.layout.device == torch::kCPU ? plan.per_host : plan.peak_per_rank;
}

// `key` set to `value` in `config` when the config has the key and the value differs.
bool set_setting(json& config, const std::string& key, const json& value) {
  json* node = &config;
  size_t start = 0;
  while (true) {
    const size_t dot = key.find('.', start);
    const std::string part = key.substr(start, dot == std::string::npos ? dot : dot - start);
    if (!node->is_object() || !node->contains(part)) return false;
    node = &(*node)[part];
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  if (*node == value) return false;
  *node = value;
  return true;
}

using Settings = std::vector<std::pair<std::string, json>>;

// The settings that shrink a job's memory, each as the key=value overrides a user would pass;
// a group's settings only shrink it together (FSDP2's offload policy with what it offloads).
std::vector<Settings> shrinking_settings() {
  const std::string fsdp = "actor_rollout_ref.actor.fsdp_config.";
  return {
      {{"actor_rollout_ref.rollout.name", "hf"}},
      {{fsdp + "host_shared_params", false}},
      {{"actor_rollout_ref.model.enable_gradient_checkpointing", true}},
      {{"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1}},
      {{fsdp + "optimizer_offload", true}, {fsdp + "offload_policy", true}},
      {{fsdp + "param_offload", true},
       {fsdp + "optimizer_offload", true},
       {fsdp + "offload_policy", true}},
      {{"actor_rollout_ref.model.lora_rank", 16}},
  };
}

// `settings` applied to a copy of config; nullopt when none of them changes it.
std::optional<json> with_settings(const json& config, const Settings& settings) {
  json out = config;
  bool changed = false;
  for (const auto& [key, value] : settings) changed |= set_setting(out, key, value);
  if (!changed) return std::nullopt;
  return out;
}

std::string override_text(const Settings& settings) {
  std::string out;
  for (const auto& [key, value] : settings) {
    out += (out.empty() ? "" : " ") + key + "=" +
           (value.is_string() ? value.get<std::string>() : value.dump());
  }
  return out;
}

}  // namespace

int ranks_per_node(const json& config) {
  const auto verl = optional_count(config, "trainer.n_gpus_per_node");
  const auto torchrun = optional_count(config, "trainer.nproc_per_node");
  if (verl && torchrun && *verl != *torchrun) {
    throw std::invalid_argument(fmt::format(
        "config keys 'trainer.n_gpus_per_node' ({}) and 'trainer.nproc_per_node' ({}) disagree: "
        "both name the ranks a node runs; set one",
        *verl, *torchrun));
  }
  return verl.value_or(torchrun.value_or(2));
}

engine::Layout layout_of(const json& config, torch::DeviceType device) {
  engine::Layout layout;
  layout.nnodes = optional_count(config, "trainer.nnodes").value_or(1);
  layout.ranks_per_node = ranks_per_node(config);
  layout.device = device;
  return layout;
}

engine::MemoryPlan memory_plan(const json& config, const engine::Layout& layout) {
  const auto name = get<std::string>(config, "trainer.task");
  const Task task = find_task(name, "config");
  if (!task.plan) {
    throw std::invalid_argument(fmt::format("trainer.task '{}' has no memory plan", name));
  }
  const PlanInput input = task.plan(config, layout);
  const auto size = engine::EngineRegistry::model_size(input.engine);
  return engine::plan_memory(input.engine, size, input.workload, layout);
}

void check_memory_plan(const json& config, const engine::Layout& layout, int64_t capacity) {
  const auto plan = memory_plan(config, layout);
  if (needed(plan) <= capacity) return;
  const bool cpu = layout.device == torch::kCPU;
  const std::string where = cpu ? "a host's memory" : "a device's memory";
  // Each setting alone, then as many as it takes, the smallest plan first.
  std::vector<std::pair<int64_t, Settings>> singles;
  std::string alone;
  for (const auto& settings : shrinking_settings()) {
    const auto changed = with_settings(config, settings);
    if (!changed) continue;
    const auto bytes = needed(memory_plan(*changed, layout));
    if (bytes >= needed(plan)) continue;
    singles.emplace_back(bytes, settings);
    if (bytes <= capacity) alone += fmt::format("\n  {} ({})", override_text(settings), gb(bytes));
  }
  std::sort(singles.begin(), singles.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  json together = config;
  std::string combined;
  int64_t combined_bytes = needed(plan);
  for (const auto& [bytes, settings] : singles) {
    if (combined_bytes <= capacity) break;
    const auto changed = with_settings(together, settings);
    if (!changed) continue;
    const auto next = needed(memory_plan(*changed, layout));
    if (next >= combined_bytes) continue;
    together = *changed;
    combined_bytes = next;
    combined += (combined.empty() ? "" : " ") + override_text(settings);
  }
  std::string advice;
  if (!alone.empty()) advice += "\nEach of these settings alone makes it fit:" + alone;
  if (combined_bytes <= capacity && alone.empty()) {
    advice += fmt::format("\nThese settings together make it fit ({}):\n  {}", gb(combined_bytes),
                          combined);
  } else if (combined_bytes > capacity) {
    advice += fmt::format(
        "\nEven with {} it needs {}: give it more ranks (trainer.nnodes, "
        "trainer.n_gpus_per_node), a smaller model or LoRA (actor_rollout_ref.model.lora_rank)",
        combined.empty() ? "every setting ShardRL has" : combined, gb(combined_bytes));
  }
  throw std::invalid_argument(
      fmt::format("the memory plan does not fit: it needs {} of {} and {} is available{}\n{}\n"
                  "(set trainer.memory_plan_check=false to run it anyway)",
                  gb(needed(plan)), where, gb(capacity), advice, plan.describe()));
}

int plan_main(const std::string& config_path, const std::vector<std::string>& overrides,
              const PlanOptions& options) {
  const json config = task_config(config_path, overrides);
  const auto device =
      options.device.value_or(torch::cuda::is_available() ? torch::kCUDA : torch::kCPU);
  const auto layout = layout_of(config, device);
  const auto plan = memory_plan(config, layout);
  int64_t capacity = options.capacity_bytes;
  if (capacity == 0 && device == torch::kCPU) capacity = engine::host_available_bytes();
  if (options.json) {
    json out = plan.to_json();
    out["capacity_bytes"] = capacity;
    std::cout << out.dump(2) << "\n";
  } else {
    std::cout << plan.describe() << "\n";
  }
  if (capacity <= 0) return 0;
  try {
    check_memory_plan(config, layout, capacity);
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    // The plan itself was printed above; the verdict and the advice come without it.
    std::cerr << message.substr(0, message.find("\nmemory plan:")) << "\n";
    return 1;
  }
  if (!options.json) {
    std::cout << fmt::format("fits: {} needed of {} available\n", gb(needed(plan)), gb(capacity));
  }
  return 0;
}

}  // namespace shardrl::trainer
