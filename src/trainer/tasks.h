// Internal to the trainer: the built-in tasks and the run plumbing they share.
#pragma once

#include <nlohmann/json.hpp>

#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardrl/engine.h"
#include "shardrl/trainer.h"
#include "tracking.h"

namespace shardrl::trainer {

void register_builtin_tasks(std::map<std::string, Task>& tasks);
// The registered tasks' names, sorted.
std::vector<std::string> task_names();
// The task registered as `name`; an error naming trainer.task, `source` and the known tasks.
Task find_task(const std::string& name, const std::string& source);

// The whole config of a `shardrl train` call: the task's table (trainer.task, from the file or
// an override, names the task) gives the defaults, then the file, then the overrides; then every
// key is checked against the table (kValues: types, ranges and choices; kValuesAndFiles: the
// files and folders keys name too) and the shared sections' rules between keys. Errors name the
// key, what it takes, and the file or override it came from.
enum class ConfigChecks { kValues, kValuesAndFiles };
nlohmann::json task_config(const std::string& path, const std::vector<std::string>& overrides,
                           ConfigChecks checks = ConfigChecks::kValuesAndFiles);

// Checkpoints and metrics of one run under trainer.default_local_dir:
//   checkpoints/global_step_N/, metrics.jsonl (the "file" logger)
// and what the other loggers of trainer.logger write (tracking.h): the console's step lines,
// TensorBoard's event files. Also verl's trainer.rollout_data_dir and trainer.log_val_generations.
class Run {
 public:
  // `throughput`: the metric the console line shows as the task's throughput.
  Run(const nlohmann::json& config, dist::World& world, Throughput throughput = {});
  ~Run();

  // Per trainer.resume_mode (verl's): "auto" continues from the latest whole checkpoint if there
  // is one, warning about each damaged one it passes over (and failing when all are damaged),
  // "disable" starts fresh, "resume_path" continues from trainer.resume_from_path (an error when it
  // is damaged). Collective over the world: every rank continues from the same step. Returns the
  // step to continue from.
  // Call it once, before the first after_step(). With a critic (save_critic_with), the critic's
  // checkpoint of the same step is loaded too; a step without a whole one is an error naming it.
  int64_t resume(engine::Engine& engine);
  // PPO's critic, saved and resumed with the actor (the engine resume() and after_step() take):
  // checkpoints/critic/global_step_N, written before the actor's step, which commits both, and
  // rotated after it to trainer.max_critic_ckpt_to_keep (null: max_actor_ckpt_to_keep). Call it
  // before resume().
  void save_critic_with(engine::Engine& critic);
  // Logs a training step and saves every trainer.save_freq steps and at the last step.
  void after_step(engine::Engine& engine, int64_t step, const engine::Metrics& metrics);
  // Metrics outside a training step: validation before training is step 0, as verl logs it, so
  // that a resumed run still has it.
  void log(int64_t step, const engine::Metrics& metrics);
  // To TensorBoard, when it is a logger (rank 0 writes): an image (uint8 [H, W, C]), markdown.
  void log_image(int64_t step, const std::string& tag, const torch::Tensor& image);
  void log_text(int64_t step, const std::string& tag, const std::string& markdown);
  bool uses(const std::string& logger) const;

  // trainer.rollout_data_dir (verl's; null or empty: off): each step's rollouts as
  // <dir>/<step>.jsonl, one JSON object a sample ({"input", "output", "gts", "score", "step"} as
  // verl's _dump_generations writes them).
  bool dumps_rollouts() const { return !rollout_data_dir_.empty(); }
  // Collective over `group`, the ranks that hold different samples (a mesh's data-parallel
  // group): every rank's `samples` in rank order, "step" added, written by rank 0. With `images`
  // ([samples, C, H, W] in [-1, 1]) sample i's image is written to <dir>/<step>/<i>.png and its
  // "output" names that file, as verl's diffusion trainer dumps its images.
  void dump_rollouts(int64_t step, std::vector<nlohmann::json> samples, dist::ProcessGroup& group,
                     const torch::Tensor& images = {});
  // trainer.log_val_generations (verl's): how many validation generations go to TensorBoard (0
  // without the tensorboard logger), the same on every rank.
  int64_t val_generations() const { return val_generations_; }
  // Collective over `group` (as dump_rollouts): the first val_generations() of every rank's
  // samples ({"input", "output", "score"} each) in rank order, as the markdown text
  // "val/generations" of `step`, laid out as verl's.
  void log_val_generations(int64_t step, const std::vector<nlohmann::json>& samples,
                           dist::ProcessGroup& group);

  const std::string& dir() const { return dir_; }
  int64_t total_steps() const { return total_steps_; }
  bool is_rank0() const { return rank0_; }

 private:
  std::string dir_;
  std::string resume_mode_, resume_from_path_;
  int64_t total_steps_, save_freq_;
  bool rank0_;
  dist::World* world_;
  std::vector<std::string> loggers_;
  std::string tensorboard_dir_, rollout_data_dir_;
  int64_t val_generations_ = 0;
  Throughput throughput_;
  std::unique_ptr<Tracking> tracking_;  // opened by resume(), which knows the first step
  engine::Engine* critic_ = nullptr;
  int max_critic_ckpt_to_keep_ = 0;
};

// The mean of the last `window` values added: a noisy per-step loss as a progress line shows it.
class RecentMean {
 public:
  explicit RecentMean(size_t window = 100) : window_(window) {}
  void add(double value) {
    values_.push_back(value);
    sum_ += value;
    if (values_.size() > window_) {
      sum_ -= values_.front();
      values_.pop_front();
    }
  }
  double mean() const { return values_.empty() ? 0.0 : sum_ / static_cast<double>(values_.size()); }
  size_t count() const { return values_.size(); }

 private:
  size_t window_;
  std::deque<double> values_;
  double sum_ = 0;
};

// Writes j, indented, to path.
void write_json(const std::string& path, const nlohmann::json& j);

// A finished run's metrics.jsonl, resumed parts included: reward_curve.png (reward_mean per
// training step and its 5-step mean) is written next to it; the mean seconds per step of each
// time_<phase> metric and every val/ metric by step are returned. Without a metrics.jsonl (no
// "file" logger) nothing is written and the curve is empty.
struct RunCurve {
  std::vector<double> reward;
  nlohmann::json phase_seconds_per_step = nlohmann::json::object();  // phase -> seconds
  std::map<std::string, std::map<int64_t, double>> validation;       // "val/..." -> step -> value
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

// The built-in tasks: each one's config table, entry point and memory plan.
Task lm_pretrain_task();
Task diffusion_rl_task();
Task lm_grpo_task();
PlanInput lm_pretrain_plan(const nlohmann::json& config, const engine::Layout& layout);
PlanInput diffusion_rl_plan(const nlohmann::json& config, const engine::Layout& layout);
PlanInput lm_grpo_plan(const nlohmann::json& config, const engine::Layout& layout);

// actor_rollout_ref.rollout.name, verl's key: "replica" (ShardRL's unsharded rollout model on each
// rank, fed by the weight sync, in the role verl gives vLLM or SGLang) or "hf" (verl's HFRollout:
// the actor's own sharded module samples, with no second copy of the weights). Errors name the key.
engine::Workload::Rollout rollout_engine(const nlohmann::json& config,
                                         engine::Workload::Rollout hf_mode);

}  // namespace shardrl::trainer
