// `shardrl train`: picks the task, loads and checks the config, starts the ranks, runs.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <sstream>

#include "shardrl/dist.h"
#include "shardrl/launcher.h"
#include "shardrl/trainer.h"
#include "tasks.h"

namespace shardrl::trainer {
namespace {

using nlohmann::json;

json trainer_defaults() {
  return {{"trainer",
           {{"task", ""},
            {"project_name", "shardrl"},
            {"experiment_name", "run"},
            {"default_local_dir", "runs/run"},
            {"nproc_per_node", 2},
            {"total_training_steps", 100},
            {"save_freq", -1},
            {"resume_mode", "auto"},
            {"resume_from_path", ""},
            {"max_actor_ckpt_to_keep", 2},
            {"max_mem_gb", 0.0},
            {"seed", 0},
            // verl's key: a list of loggers (tracking.h); a single name is a list of one.
            {"logger", {"console", "file"}}}},
          // verl's key and default: the bound, in seconds, on every collective and on the
          // rendezvous, for Gloo and NCCL alike.
          {"actor_rollout_ref", {{"nccl_timeout", 600}}}};
}

constexpr int64_t kMaxCollectiveTimeoutSeconds = 30 * 24 * 3600;

std::chrono::seconds collective_timeout(const json& config, const std::string& source) {
  const auto seconds = get<int64_t>(config, "actor_rollout_ref.nccl_timeout");
  if (seconds < 1 || seconds > kMaxCollectiveTimeoutSeconds) {
    throw std::invalid_argument(
        fmt::format("{}: config key 'actor_rollout_ref.nccl_timeout' must be a number of seconds "
                    "in [1, {}], got {}",
                    source, kMaxCollectiveTimeoutSeconds, seconds));
  }
  return std::chrono::seconds(seconds);
}

struct TaskTable {
  std::mutex mutex;
  std::map<std::string, Task> tasks;
  TaskTable() { register_builtin_tasks(tasks); }
  static TaskTable& get() {
    static TaskTable table;
    return table;
  }
};

Task find_task(const std::string& name, const std::string& source) {
  auto& table = TaskTable::get();
  std::lock_guard lock(table.mutex);
  auto it = table.tasks.find(name);
  if (it == table.tasks.end()) {
    std::string known;
    for (const auto& [key, unused] : table.tasks) known += (known.empty() ? "" : ", ") + key;
    throw std::invalid_argument(
        fmt::format("{}: config key 'trainer.task' is '{}'; known tasks: {}", source, name, known));
  }
  return it->second;
}

// trainer.task decides which defaults the rest of the config is checked against, so it is read
// first, from the file and then the overrides.
std::string task_name(const std::string& path, const std::vector<std::string>& overrides) {
  std::string name;
  for (const auto& item : overrides) {
    if (item.rfind("trainer.task=", 0) == 0) name = item.substr(13);
  }
  if (!name.empty()) return name;
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(fmt::format("config file '{}' cannot be read", path));
  std::stringstream text;
  text << in.rdbuf();
  const json raw = yaml_to_json(text.str(), path);
  if (!raw.is_object() || !raw.contains("trainer") || !raw["trainer"].contains("task") ||
      !raw["trainer"]["task"].is_string()) {
    throw std::invalid_argument(fmt::format("{}: config key 'trainer.task' is missing", path));
  }
  return raw["trainer"]["task"].get<std::string>();
}

// Lays a task's defaults over the trainer's. Unlike JSON merge-patch, a null default stays a key:
// verl's `clip_ratio_low: null` means "use clip_ratio", and the key must still be settable.
void overlay_defaults(json& base, const json& over) {
  for (const auto& [key, value] : over.items()) {
    if (base.contains(key) && base[key].is_object() && value.is_object()) {
      overlay_defaults(base[key], value);
    } else {
      base[key] = value;
    }
  }
}

}  // namespace

void register_task(const std::string& name, Task task) {
  auto& table = TaskTable::get();
  std::lock_guard lock(table.mutex);
  table.tasks[name] = std::move(task);
}

json task_config(const std::string& path, const std::vector<std::string>& overrides) {
  const std::string name = task_name(path, overrides);
  const Task task = find_task(name, path);
  json defaults = trainer_defaults();
  overlay_defaults(defaults, task.defaults());
  json config = load_config(path, overrides, defaults);
  try {
    configured_loggers(config);  // before any stage runs: a wrong logger fails at once
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(fmt::format("{}: {}", path, e.what()));
  }
  return config;
}

int train_main(const std::string& config_path, const std::vector<std::string>& overrides,
               const std::string& self_exe) {
  // Every rank checks the config, so a bad key fails before any rank waits for another.
  const json config = task_config(config_path, overrides);
  dist::InitOptions init;
  init.timeout = collective_timeout(config, config_path);
  const int nproc = get<int>(config, "trainer.nproc_per_node");
  if (std::getenv("RANK") == nullptr && nproc > 1) {
    check_sequence_parallel(config, nproc);  // once, before any rank starts
    dist::LaunchOptions launch;
    launch.nproc = nproc;
    launch.command = {self_exe, "train", config_path};
    launch.command.insert(launch.command.end(), overrides.begin(), overrides.end());
    return dist::launch(launch);
  }
  auto world = dist::World::init_from_env(init);
  check_sequence_parallel(config, world->size());
  if (world->rank() == 0) {
    spdlog::info("task {} on {} rank(s), bulk collectives over {}; config:\n{}",
                 get<std::string>(config, "trainer.task"), world->size(),
                 world->group().bulk_transport(), config.dump(2));
  }
  try {
    return find_task(get<std::string>(config, "trainer.task"), config_path).run(config, world);
  } catch (const dist::CollectiveError& e) {
    throw dist::CollectiveError(
        fmt::format("{} (the timeout is actor_rollout_ref.nccl_timeout={})", e.what(),
                    std::chrono::duration_cast<std::chrono::seconds>(init.timeout).count()));
  }
}

}  // namespace shardrl::trainer
