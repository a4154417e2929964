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
            // verl's nnodes and n_gpus_per_node: the plan's world, and the local ranks
            // `shardrl train` starts; nproc_per_node (torchrun's name) is the older key for the
            // latter. Null: 2 ranks (ranks_per_node).
            {"nnodes", 1},
            {"n_gpus_per_node", nullptr},
            {"nproc_per_node", nullptr},
            // Stop before any rank allocates when the memory plan exceeds what the host has.
            {"memory_plan_check", true},
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

}  // namespace

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

namespace {

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

// Set for the ranks `shardrl train` starts itself, once it has checked the plan for them.
constexpr const char* kPlannedEnv = "SHARDRL_MEMORY_PLANNED";

void log_and_check_plan(const json& config, const engine::Layout& layout, bool check) {
  const auto plan = memory_plan(config, layout);
  spdlog::info("{}", plan.describe());
  if (check && layout.device == torch::kCPU) {
    check_memory_plan(config, layout, engine::host_available_bytes());
  }
  ::setenv(kPlannedEnv, "1", 1);
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
  const int nproc = ranks_per_node(config);
  const auto layout = layout_of(config, torch::cuda::is_available() ? torch::kCUDA : torch::kCPU);
  const bool launched = std::getenv("RANK") != nullptr;
  if (!launched && layout.nnodes > 1) {
    throw std::invalid_argument(fmt::format(
        "{}: config key 'trainer.nnodes' is {}: `shardrl train` starts the ranks of one node; run "
        "it on every node under a launcher that sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and "
        "MASTER_PORT (torchrun's environment), or `shardrl plan` to size the job",
        config_path, layout.nnodes));
  }
  // Before any rank allocates: the plan is logged, and a job it says cannot fit this host stops
  // here, naming the settings that would make it fit, rather than meet the OOM killer. Under
  // another launcher every node's ranks check their own host (below).
  const bool check_plan = get<bool>(config, "trainer.memory_plan_check");
  if (!launched) {
    check_sequence_parallel(config, nproc);
    log_and_check_plan(config, layout, check_plan);
  }
  if (!launched && nproc > 1) {
    dist::LaunchOptions launch;
    launch.nproc = nproc;
    launch.command = {self_exe, "train", config_path};
    launch.command.insert(launch.command.end(), overrides.begin(), overrides.end());
    return dist::launch(launch);
  }
  auto world = dist::World::init_from_env(init);
  check_sequence_parallel(config, world->size());
  if (launched && std::getenv(kPlannedEnv) == nullptr) {
    // Started by another launcher: the plan for the world it made, checked on every host.
    engine::Layout actual = layout;
    const char* local = std::getenv("LOCAL_WORLD_SIZE");
    actual.ranks_per_node = local ? std::max(1, std::atoi(local)) : world->size();
    actual.nnodes = std::max(1, world->size() / actual.ranks_per_node);
    std::string problem;
    try {
      if (world->rank() == 0) spdlog::info("{}", memory_plan(config, actual).describe());
      if (check_plan && world->local_rank() == 0 && actual.device == torch::kCPU) {
        check_memory_plan(config, actual, engine::host_available_bytes());
      }
    } catch (const std::invalid_argument& e) {
      problem = e.what();
    }
    auto failed = torch::tensor({problem.empty() ? 0.0 : 1.0}, torch::kDouble);
    world->group().all_reduce(failed, dist::ReduceOp::kMax);
    if (failed.item<double>() > 0) {
      throw std::invalid_argument(
          problem.empty() ? "the memory plan does not fit another rank's host (see its error)"
                          : problem);
    }
  }
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
