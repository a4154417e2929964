// Internal to the trainer: the built-in tasks and the run plumbing they share.
#pragma once

#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardrl/engine.h"
#include "shardrl/trainer.h"

namespace shardrl::trainer {

void register_builtin_tasks(std::map<std::string, Task>& tasks);

// The whole config of a `shardrl train` call: trainer defaults, the task's defaults, the file,
// then the overrides.
nlohmann::json task_config(const std::string& path, const std::vector<std::string>& overrides);

// Checkpoints and metrics of one run under trainer.default_local_dir:
//   checkpoints/global_step_N/, metrics.jsonl
class Run {
 public:
  Run(const nlohmann::json& config, dist::World& world);

  // Per trainer.resume_mode (verl's): "auto" continues from the latest whole checkpoint if there
  // is one, warning about each damaged one it passes over (and failing when all are damaged),
  // "disable" starts fresh, "resume_path" continues from trainer.resume_from_path (an error when it
  // is damaged). Collective over the world: every rank continues from the same step. Returns the
  // step to continue from.
  // Call it once, before the first after_step().
  int64_t resume(engine::Engine& engine);
  // Saves every trainer.save_freq steps and at the last step.
  void after_step(engine::Engine& engine, int64_t step, const engine::Metrics& metrics);
  // Metrics outside a training step: validation before training is step 0, as verl logs it, so
  // that a resumed run still has it.
  void log(int64_t step, const engine::Metrics& metrics);

  const std::string& dir() const { return dir_; }
  int64_t total_steps() const { return total_steps_; }
  bool is_rank0() const { return rank0_; }

 private:
  std::string dir_;
  std::string resume_mode_, resume_from_path_;
  int64_t total_steps_, save_freq_;
  bool rank0_;
  dist::World* world_;
  std::optional<MetricsLogger> metrics_;  // opened by resume(), which knows the first step
};

// Writes j, indented, to path.
void write_json(const std::string& path, const nlohmann::json& j);

// A finished run's metrics.jsonl, resumed parts included: reward_curve.png (reward_mean per
// training step and its 5-step mean) is written next to it; the mean seconds per step of each
// time_<phase> metric and every val/ metric by step are returned.
struct RunCurve {
  std::vector<double> reward;
  nlohmann::json phase_seconds_per_step;                        // phase -> seconds
  std::map<std::string, std::map<int64_t, double>> validation;  // "val/..." -> step -> value
};
RunCurve summarize_run(const std::string& run_dir, const std::string& title);

// actor_rollout_ref.<role>.ulysses_sequence_parallel_size; the ref's is the actor's when null,
// as in verl. Errors name the key.
int ulysses_sequence_parallel_size(const nlohmann::json& config, const std::string& role);
// Every role's sequence-parallel size divides the world: checked before any engine is built.
void check_sequence_parallel(const nlohmann::json& config, int world_size);
// A model with these heads splits them over the role's sequence-parallel ranks
// (ulysses::check_heads); the error names the config key.
void check_sequence_parallel_heads(const nlohmann::json& config, const std::string& role,
                                   int64_t heads, int64_t kv_heads);

// Next-token cross-entropy of the language model on mb.data["tokens"], for the supervised stages.
engine::LossOutput next_token_loss(engine::Engine& e, const engine::MicroBatch& mb);

// Weight sync into an unsharded rollout replica, in fp32 (the rollouts compute in fp32 on CPU):
// the trainer's params stream in, one full tensor per callback, with `merge_adapter` merged in
// (empty: as they are, adapters included). `trainable_only` sends just the params that train, into
// a replica that holds the frozen rest from an earlier sync. Collective over the trainer's shard
// group. A name the replica lacks, or (full sync) a param of the replica that gets no tensor, is
// an error naming it.
void sync_rollout_replica(engine::Engine& trainer, torch::nn::Module& replica,
                          const std::string& merge_adapter, bool trainable_only = false);

// Gives `replica` (built as the trainer's model, before any adapter) every LoRA adapter the trainer
// carries (its export_info's "lora": PEFT configs by adapter name), frozen, with "default" active:
// a replica that runs the trainer's low-rank path unmerged, as the trainer does.
void add_trainer_adapters(torch::nn::Module& replica, const engine::Engine& trainer);

// After a sync into a replica that holds the trainer's adapters unmerged: every weight the replica
// computes with equals, bit for bit, the trainer's weight with adapter `adapter` merged (empty: no
// adapter, every param as it is). The trainer merges on its side (get_per_tensor_param's
// merge_adapter path), the replica from its own base and adapter tensors, so an adapter tensor
// that did not arrive, or arrived under another name, shows. A difference is an error naming the
// tensor and its largest |difference|. Collective over the trainer's shard group, like the sync.
void check_rollout_replica(engine::Engine& trainer, torch::nn::Module& replica,
                           const std::string& adapter);

// Tasks.
int run_lm_pretrain(const nlohmann::json& config, std::shared_ptr<dist::World> world);
nlohmann::json lm_pretrain_defaults();
int run_diffusion_rl(const nlohmann::json& config, std::shared_ptr<dist::World> world);
nlohmann::json diffusion_rl_defaults();
int run_lm_grpo(const nlohmann::json& config, std::shared_ptr<dist::World> world);
nlohmann::json lm_grpo_defaults();

}  // namespace shardrl::trainer
