// Internal to the trainer: a task's config table and what is made from it (the defaults the
// parser merges over, the checks before any rank starts).
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <set>
#include <string>
#include <vector>

#include "shardrl/trainer.h"

namespace shardrl::trainer {

// The rows every task has: trainer.*, actor_rollout_ref.nccl_timeout and the engine roles
// actor_rollout_ref.{model, actor, ref} that engine_config reads.
std::vector<ConfigKey> shared_keys();
// The rows of the tasks that sample rollouts and validate (lm_grpo, diffusion_rl):
// trainer.test_freq, val_before_train, rollout_data_dir and actor_rollout_ref.rollout.name.
std::vector<ConfigKey> rollout_task_keys();
// verl's critic.* and the trainer keys of a task that trains one (PPO with GAE).
std::vector<ConfigKey> critic_keys();
// What no single row can check: rules between keys of the shared sections (resume_mode
// resume_path needs resume_from_path, LoRA+ needs LoRA). Errors name the keys.
void check_shared_relations(const nlohmann::json& config);

// Where each value of a config came from: key (a row's, or a leaf above a row) -> the file or
// override that set it last. A key no source set holds its default.
using ConfigOrigins = std::map<std::string, std::string>;

class ConfigTable {
 public:
  // The shared rows with the task's defaults and its own rows laid over them; trainer.task's
  // default is the task's name. A default for a key
  // the shared rows lack, or a row whose default its own values refuse (a required path aside),
  // is a std::logic_error naming the task and the key: a mistake in the code, not the config.
  ConfigTable(const std::string& task_name, const Task& task);
  // Any rows, as they are (the fuzz harness's).
  explicit ConfigTable(std::vector<ConfigKey> rows);

  // In the reference's order: trainer.* first, then the task's own sections, then
  // actor_rollout_ref; keys of one section together.
  const std::vector<ConfigKey>& rows() const { return rows_; }
  const ConfigKey* find(const std::string& key) const;
  nlohmann::json defaults() const;
  // The keys whose values are free-form mappings: the file and overrides may add keys below them.
  std::set<std::string> free_form() const;

  // Every row's value checked against its Values; check_files: the paths they name too. One
  // std::invalid_argument lists every bad key, each with the file or override it came from.
  void check(const nlohmann::json& config, const ConfigOrigins& origins, bool check_files) const;

 private:
  void order();
  std::vector<ConfigKey> rows_;
};

// The table of a registered task; an unknown one is an error naming the known ones.
ConfigTable task_table(const std::string& task);

// "a.b.c" -> {"a", "b", "c"}.
std::vector<std::string> split_key(const std::string& key);

// A value as it is written in YAML and in `key=value` overrides: plain where it reads back as
// the same value, else quoted; lists and mappings in flow style.
std::string yaml_value(const nlohmann::json& value);

// `config` as YAML in the table's order, sections nested, each value as yaml_value writes it;
// `comments`: each key's description and the values it takes above it. What `shardrl config TASK`
// prints (with the defaults) and a run's config.yaml holds; `shardrl train` reads either back.
std::string config_yaml(const ConfigTable& table, const nlohmann::json& config, bool comments);
// The keys whose value in `config` differs from the table's default, as key=value.
std::vector<std::string> changed_keys(const ConfigTable& table, const nlohmann::json& config);

// load_config with the table's defaults and free-form keys, recording where each value came from.
nlohmann::json load_config(const std::string& path, const std::vector<std::string>& overrides,
                           const ConfigTable& table, ConfigOrigins* origins);

}  // namespace shardrl::trainer
