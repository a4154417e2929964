// `shardrl train`: picks the task, loads and checks the config, starts the ranks, runs.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdlib>
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

ConfigTable table_of(const std::string& name, const std::string& source) {
  return ConfigTable(name, find_task(name, source));
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
    spdlog::info("task {} on {} rank(s), bulk collectives over {}; config:\n{}", task,
                 world->size(), world->group().bulk_transport(), config.dump(2));
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
