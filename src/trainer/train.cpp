// `shardrl train`: picks the task, loads and checks the config, starts the ranks, runs.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "config_table.h"
#include "shardrl/dist.h"
#include "shardrl/launcher.h"
#include "shardrl/trainer.h"
#include "tasks.h"

namespace shardrl::trainer {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

std::chrono::seconds collective_timeout(const json& config) {
  return std::chrono::seconds(get<int64_t>(config, "actor_rollout_ref.nccl_timeout"));
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

std::vector<std::string> task_names() {
  auto& table = TaskTable::get();
  std::lock_guard lock(table.mutex);
  std::vector<std::string> names;
  for (const auto& [name, unused] : table.tasks) names.push_back(name);
  return names;
}

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

ConfigTable table_of(const std::string& name, const std::string& source) {
  return ConfigTable(name, find_task(name, source));
}

// Set for the ranks `shardrl train` starts itself, once it has checked the plan for them.
constexpr const char* kPlannedEnv = "SHARDRL_MEMORY_PLANNED";

void log_and_check_plan(const json& config, const engine::Layout& layout, bool check) {
  // One line on the screen; `shardrl plan` gives every part of it.
  const auto plan = memory_plan(config, layout);
  spdlog::info("memory plan: {} (`shardrl plan` shows each part)", plan.summary());
  if (check && layout.device == torch::kCPU) {
    check_memory_plan(config, layout, engine::host_available_bytes());
  }
  ::setenv(kPlannedEnv, "1", 1);
}

// The resolved config as <trainer.default_local_dir>/config.yaml, which `shardrl train` runs
// again as it is; a resumed run overwrites it with the config it resumes under. Written whole or
// not at all (a temp file renamed). Returns its path.
std::string write_run_config(const ConfigTable& table, const json& config) {
  const fs::path dir = get<std::string>(config, "trainer.default_local_dir");
  fs::create_directories(dir);
  const fs::path path = dir / "config.yaml", temp = dir / "config.yaml.tmp";
  {
    std::ofstream out(temp);
    out << fmt::format("# The config of this run, resolved: `shardrl train {}` runs it again.\n\n",
                       path.string())
        << config_yaml(table, config, /*comments=*/true);
    if (!out.flush()) {
      throw std::runtime_error(
          fmt::format("cannot write {} (trainer.default_local_dir)", temp.string()));
    }
  }
  fs::rename(temp, path);
  return path.string();
}

}  // namespace

void register_task(const std::string& name, Task task) {
  auto& table = TaskTable::get();
  std::lock_guard lock(table.mutex);
  table.tasks[name] = std::move(task);
}

json task_config(const std::string& path, const std::vector<std::string>& overrides,
                 ConfigChecks checks) {
  const std::string name = task_name(path, overrides);
  const ConfigTable table = table_of(name, path);
  ConfigOrigins origins;
  const json config = load_config(path, overrides, table, &origins);
  table.check(config, origins, checks == ConfigChecks::kValuesAndFiles);
  check_shared_relations(config);
  return config;
}

ConfigTable task_table(const std::string& task) {
  return table_of(task, "shardrl config");
}

int train_main(const std::string& config_path, const std::vector<std::string>& overrides,
               const std::string& self_exe) {
  // Every rank checks the config, so a bad key fails before any rank waits for another.
  const json config = task_config(config_path, overrides);
  const std::string task = get<std::string>(config, "trainer.task");
  dist::InitOptions init;
  init.timeout = collective_timeout(config);
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
      if (world->rank() == 0) {
        spdlog::info("memory plan: {} (`shardrl plan` shows each part)",
                     memory_plan(config, actual).summary());
      }
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
    const ConfigTable table = table_of(task, config_path);
    const auto changed = changed_keys(table, config);
    spdlog::info(
        "task {} on {} rank(s), bulk collectives over {}; config {}: {}", task, world->size(),
        world->group().bulk_transport(), write_run_config(table, config),
        changed.empty() ? "the task's defaults" : fmt::format("{}", fmt::join(changed, ", ")));
  }
  try {
    return find_task(task, config_path).run(config, world);
  } catch (const dist::CollectiveError& e) {
    throw dist::CollectiveError(
        fmt::format("{} (the timeout is actor_rollout_ref.nccl_timeout={})", e.what(),
                    std::chrono::duration_cast<std::chrono::seconds>(init.timeout).count()));
  }
}

}  // namespace shardrl::trainer
