// The trainer: YAML configs in verl's names and `shardrl train`.
#pragma once

#include <nlohmann/json.hpp>

#include <functional>
#include <map>
#include <memory>
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

// `shardrl train CONFIG.yaml [key=value ...]`: runs the pipeline the config's `trainer.task`
// names. Without a launcher environment it starts trainer.n_gpus_per_node (or its older name
// trainer.nproc_per_node) local ranks of itself, once its memory plan fits this host.
int train_main(const std::string& config_path, const std::vector<std::string>& overrides,
               const std::string& self_exe);

// `shardrl config TASK`: every key of the task's table as YAML (its default, its description and
// the values it takes), a config to start from. `list`: the registered tasks, one a line.
// `markdown`: every task's table, the reference docs/config.md holds (`make docs`).
int config_main(const std::string& task, bool list, bool markdown);

// What the memory plan needs of a task: the actor's engine and what one rank runs with it.
struct PlanInput {
  engine::EngineConfig engine;
  engine::Workload workload;
};

// What values a config key takes: a type, then a range, choices or a path that must exist, and
// whether null is allowed. Built in one expression, as a table row reads:
//   integer().at_least(1)                     number().above(0).at_most(1)
//   text().one_of({"sde", "cps"})             list().of(text()).or_null("the family's default")
//   text().existing_folder("config.json")     mapping()   (free-form: any keys, e.g. a config.json)
class Values {
 public:
  enum class Type { kBoolean, kInteger, kNumber, kText, kList, kMapping };
  explicit Values(Type type) : type_(type) {}

  Values& at_least(double bound);  // >= bound
  Values& above(double bound);     // > bound
  Values& at_most(double bound);   // <= bound
  Values& below(double bound);     // < bound
  // Text: one of `choices` (listed first in the reference), or of `aliases` (also accepted).
  Values& one_of(std::vector<std::string> choices, std::vector<std::string> aliases = {});
  // Text matching an ECMAScript regex; `meaning` says in words what matches.
  Values& matching(std::string regex, std::string meaning);
  // A list: every item one of `item`; `size` items exactly.
  Values& of(const Values& item);
  Values& size(size_t items);
  // Text naming a file or folder that must exist when the text is not empty (a folder, holding
  // `holding` when given); required(): not empty either.
  Values& existing_path();
  Values& existing_folder(std::string holding = "");
  Values& required();
  // null is also allowed; `meaning` says what it stands for ("clip_ratio", "all steps").
  Values& or_null(std::string meaning);

  Type type() const { return type_; }
  bool nullable() const { return nullable_; }
  bool names_path() const { return path_ != Path::kNone; }
  // In words, for the reference and the errors: "integer >= 1", "one of: sde, cps", ...
  std::string describe() const;
  // Throws std::invalid_argument naming `key`, what is allowed and what it got. check_files: the
  // paths of existing_path / existing_folder / required are checked too.
  void check(const nlohmann::json& value, const std::string& key, bool check_files) const;

 private:
  Type type_;
  std::optional<double> min_, max_;
  bool min_open_ = false, max_open_ = false;
  std::vector<std::string> choices_, aliases_;
  std::string regex_, regex_meaning_;
  std::shared_ptr<const Values> item_;
  std::optional<size_t> size_;
  enum class Path { kNone, kAny, kFolder } path_ = Path::kNone;
  std::string holding_;
  bool required_ = false, nullable_ = false;
  std::string null_meaning_;
};
Values boolean();
Values integer();
Values number();
Values text();
Values list();
Values mapping();

// One row of a task's config table: the key's dotted name (verl's where verl has one), its
// default, the values it takes and what it means in one line. Where a default differs from verl's
// on purpose, the description says why.
struct ConfigKey {
  std::string key;
  nlohmann::json default_value;
  Values values;
  std::string description;
};

// A pipeline (e.g. "diffusion_rl") registers its config table and entry point. Its table is the
// shared sections (trainer.*, the engine roles actor_rollout_ref.{model, actor, ref}) with
// `defaults` laid over them, plus its own `keys` (a key of a shared section replaces that row).
// The table gives the parser its defaults, checks every key before any rank starts, and is what
// `shardrl config TASK` prints: one source. `plan`: how its memory is planned (none: `shardrl
// plan` and the check before `shardrl train` say the task has no plan).
struct Task {
  std::string description;  // one line, for `shardrl config --list`
  std::vector<ConfigKey> keys;
  std::map<std::string, nlohmann::json> defaults;
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
