// The training engine: one sharded model with its optimizer and LR schedule, in the shape verl's
// engines have (initialize, train_mode/eval_mode, forward_backward_batch, optimizer_step,
// lr_scheduler_step, train_batch, infer_batch, get_per_tensor_param, save/load_checkpoint).
//
// The engine knows nothing of a model's forward signature or of any algorithm: a LossFn receives
// the engine and one micro-batch and calls the model through engine.model<Holder>(). Algorithms
// (algos/) and the trainer (trainer/) are built from loss functions.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <any>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "shardrl/checkpoint.h"
#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/lr_schedule.h"
#include "shardrl/offload.h"
#include "shardrl/optim.h"

namespace shardrl::models {
class FlowModel;
}  // namespace shardrl::models

namespace shardrl::engine {

// verl's DataProto in its simplest form: named tensors that share dim 0, the sample dimension.
using Batch = std::map<std::string, torch::Tensor>;

// Samples in the batch; every tensor must agree (the error names the one that does not).
int64_t batch_size(const Batch& batch);
// `count` contiguous micro-batches whose sizes differ by at most one.
std::vector<Batch> split_batch(const Batch& batch, int64_t count);
Batch concat_batches(const std::vector<Batch>& parts);
// Rows [first, first + rows) of every tensor: a rank's shard of a global batch.
Batch slice_batch(const Batch& batch, int64_t first, int64_t rows);

// One micro-batch as a loss function sees it. `count` is the same on every rank, so dividing a
// mean loss by it gives the gradient of the mean over the rank's whole batch.
struct MicroBatch {
  const Batch& data;
  int64_t index = 0;
  int64_t count = 1;
};

struct LossOutput {
  torch::Tensor loss;                     // scalar with grad; unused when forward_only
  std::map<std::string, double> metrics;  // averaged over micro-batches and ranks
  Batch outputs;                          // per-sample outputs, concatenated by infer_batch
};

class Engine;
using LossFn = std::function<LossOutput(Engine& engine, const MicroBatch& micro_batch)>;

struct OptimConfig {
  double lr = 1e-4;
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.01;
  double clip_grad = 1.0;  // global max norm; <= 0 disables clipping
  // LoRA+ (PEFT's create_loraplus_optimizer and its loraplus_lr_ratio): when set, a
  // GroupedOptimizer steps the adapters' B matrices with lr * loraplus_lr_ratio and every other
  // trainable parameter with lr, one AdamW each, under one schedule. Unset: one AdamW for all.
  std::optional<double> loraplus_lr_ratio;
  optim::LRScheduleConfig schedule;
};

struct EngineConfig {
  std::string model_type = "language_model";  // the registry key, with `backend`
  std::string backend = "fsdp";
  nlohmann::json model = nlohmann::json::object();  // handed to the model family's builder
  int fsdp_size = -1;                               // -1: shard over every rank (no HSDP)
  // Ulysses sequence parallelism (verl's actor.ulysses_sequence_parallel_size): groups of this
  // many neighbouring ranks split each sample's sequence (dist::DeviceMesh); 1: off.
  int ulysses_sequence_parallel_size = 1;
  fsdp::Options fsdp;                    // reshard_after_forward, mixed_precision, prefetch
  int64_t micro_batch_size_per_gpu = 0;  // 0: the whole local batch is one micro-batch
  bool forward_only = false;             // a reference model: no optimizer, no grads
  // verl's param_offload / optimizer_offload: the state lives in offload.tier between phases and
  // train_mode()/eval_mode() bring it in. With offload_policy (FSDP2's CPUOffloadPolicy) it stays
  // in the tier during training too: shards reach compute memory only inside the all-gather.
  // A forward_only engine with param_offload keeps its params offloaded between forwards.
  offload::Options offload;
  bool offload_policy = false;
  OptimConfig optim;
  checkpoint::SaveOptions checkpoint;  // max_ckpt_to_keep, max_mem_gb
  // The settings of the loss the model type registers (Engine::loss_fn()), in the loss's own
  // field names: for the diffusion model types, algos::DiffusionLossConfig's fields and a
  // "sampler" object with algos::SamplerConfig's.
  nlohmann::json loss = nlohmann::json::object();
};

// What a model family's builder hands the engine: the root module, sharded.
struct Model {
  std::shared_ptr<torch::nn::Module> module;
  fsdp::FSDPModule fsdp;
  std::any root;  // the root fsdp::Unit<M> holder, for typed calls through Engine::model<Holder>()
  // What `shardrl export` needs, saved in every checkpoint's extra JSON: {"family": ...,
  // "config": the family's config.json (Hugging Face's for llama / qwen2), "lora": {adapter:
  // PEFT adapter_config.json}} (no "lora" without adapters).
  nlohmann::json export_info = nlohmann::json::object();
  // The builder split the model over mesh.sequence_parallel_group() (Ulysses): the Engine refuses
  // a model without it on a mesh with sequence parallelism, whose gradients it would overcount.
  bool sequence_parallel = false;
};
using ModelBuilder = std::function<Model(const nlohmann::json& model_config,
                                         const dist::DeviceMesh& mesh, const fsdp::Options&)>;
// A model type's training loss, built from EngineConfig::loss: what verl-omni's PPO, DPO and NFT
// engine subclasses override.
using LossFactory = std::function<LossFn(const nlohmann::json& loss_config)>;
struct ModelSize;  // memory_plan.h
// A model's units and activation sizes for the memory plan, counted without allocating it.
using ModelSizer = std::function<ModelSize(const nlohmann::json& model_config)>;

// Metrics of one train_batch: loss-function metrics plus grad_norm, lr and whether the step was
// skipped because the gradient norm was not finite.
using Metrics = std::map<std::string, double>;

class Engine {
 public:
  // initialize(): builds and shards the model, then the optimizer and LR schedule. `loss` (may be
  // null) is the model type's loss: train_batch(data) uses it.
  Engine(EngineConfig config, std::shared_ptr<dist::World> world, const ModelBuilder& builder,
         LossFn loss = nullptr);

  template <class Holder>
  Holder& model() {
    auto* holder = std::any_cast<Holder>(&model_.root);
    TORCH_CHECK(holder, "Engine::model<", typeid(Holder).name(),
                ">(): the model was built as a different type");
    return *holder;
  }
  torch::nn::Module& module() { return *model_.module; }
  fsdp::FSDPModule& fsdp() { return model_.fsdp; }
  const EngineConfig& config() const { return config_; }
  // What `shardrl export` needs, as every checkpoint saves it: {"family", "config", "lora"}.
  const nlohmann::json& export_info() const { return model_.export_info; }

  // Brings in what the config offloads (train: params, grads, optimizer state; eval: params) and
  // offloads it again when the scope ends. Nothing moves when nothing is offloaded, so a scope
  // opened inside another (a checkpoint save inside train_mode) leaves the outer one's state be.
  class ModeScope {
   public:
    ModeScope(Engine& engine, offload::Selection what);
    ~ModeScope();
    ModeScope(const ModeScope&) = delete;
    ModeScope& operator=(const ModeScope&) = delete;

   private:
    Engine& engine_;
    offload::Selection what_;
    bool active_;
  };
  [[nodiscard]] ModeScope train_mode();
  [[nodiscard]] ModeScope eval_mode();

  // verl's to(device, model, optimizer, grad): moves the selected state (grad requires model).
  void to(offload::Tier tier, offload::Selection what);
  void offload(offload::Selection what = {});
  void onload(offload::Selection what = {});
  // Wall seconds spent moving state to and from the offload tier since the engine was built,
  // for the per-phase timing of an RL step.
  double offload_seconds() const { return offload_seconds_; }
  // Bytes per category, resident and offloaded, and the phase's log line.
  offload::MemoryReport memory() const;
  void log_memory(const std::string& phase) const;

  void optimizer_zero_grad();
  // Clips to optim.clip_grad and steps; a non-finite norm skips the update.
  optim::StepResult optimizer_step();
  double lr_scheduler_step();  // advances the schedule and returns the new lr
  double current_lr() const;

  // Splits the local batch into micro-batches (the same count on every rank), runs loss_fn on
  // each and, unless forward_only, back-propagates with gradient sync on the last one only.
  // `outputs`, when given, receives the concatenated per-sample outputs.
  Metrics forward_backward_batch(const Batch& data, const LossFn& loss_fn, bool forward_only,
                                 Batch* outputs = nullptr);
  // zero_grad, forward_backward_batch, optimizer_step, lr_scheduler_step.
  Metrics train_batch(const Batch& data, const LossFn& loss_fn);
  // The same with the model type's registered loss.
  Metrics train_batch(const Batch& data) { return train_batch(data, loss_fn()); }
  // The model type's loss (an error when its registry entry has none).
  const LossFn& loss_fn() const;
  // forward_only under NoGradGuard; returns the per-sample outputs.
  Batch infer_batch(const Batch& data, const LossFn& loss_fn, Metrics* metrics = nullptr);

  // Weight sync for a rollout engine (verl's get_per_tensor_param): `callback(name, full tensor)`
  // for every parameter, gathered one tensor at a time; collective over the shard group. Params
  // that are offloaded come in for the call and go back after it; no training state changes.
  struct WeightSyncOptions {
    torch::ScalarType dtype = torch::kBFloat16;
    std::string prefix;  // prepended to every name, e.g. "transformer."
    // LoRA: empty sends every tensor as it is (base and adapter tensors, PEFT names). An adapter
    // name sends each target's weight with scaling * B A of that adapter merged in, and no
    // adapter tensors: what a rollout engine without LoRA support loads.
    std::string merge_adapter;
    // Only the params that train (LoRA: the adapter tensors), for a replica that already holds
    // the frozen rest: verl syncs the base once (base_sync_done) and then the adapter alone.
    // Cannot be combined with merge_adapter, whose merged weights change with the adapter.
    bool trainable_only = false;
  };
  using TensorCallback = std::function<void(const std::string&, const torch::Tensor&)>;
  void get_per_tensor_param(const TensorCallback& callback, const WeightSyncOptions& options);

  // Sharded checkpoint of model, optimizer, LR schedule and RNG, rotated per config.checkpoint.
  // Its extra JSON is the model's export_info with `extra`'s keys added (or replaced), so every
  // checkpoint exports without the config that trained it. Offloaded state comes in for the call
  // and goes back after it.
  std::string save_checkpoint(const std::string& root, int64_t step,
                              const nlohmann::json& extra = nlohmann::json::object());
  // files_checked as checkpoint::load's.
  checkpoint::LoadResult load_checkpoint(const std::string& dir, bool files_checked = false);

  int data_parallel_rank() const { return mesh_.data_parallel_rank(); }
  int data_parallel_size() const { return mesh_.data_parallel_size(); }
  // The ranks, as FSDP shards over them and as they split the data (dp x Ulysses sp).
  const dist::DeviceMesh& mesh() const { return mesh_; }
  dist::World& world() { return *world_; }
  torch::optim::Optimizer* optimizer() { return optimizer_.get(); }

  // Mean of each metric over every rank (each must pass the same keys; a Ulysses group agrees).
  Metrics average_over_ranks(const Metrics& metrics);

 private:
  int64_t agreed_micro_batch_count(int64_t local_samples);
  offload::Selection offloaded_between_phases(bool train) const;
  ModeScope offloaded_state_in(bool params_only);

  EngineConfig config_;
  std::shared_ptr<dist::World> world_;
  dist::DeviceMesh mesh_;
  Model model_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  std::unique_ptr<optim::LRScheduler> scheduler_;
  LossFn loss_;
  double offload_seconds_ = 0;
};

// Model families by (model_type, backend), as verl's EngineRegistry. The built-in families are
// registered on first use: language_model (`model.family`: gpt or llama) and the diffusion types
// of verl-omni, each a diffusers transformer with its loss: diffusion_model (Flow-GRPO, PPO),
// diffusion_nft_model (DiffusionNFT, with the "old" adapter under LoRA) and diffusion_dpo_model
// (Diffusion-DPO). The transformer is the one its config.json's _class_name names, as diffusers
// picks it: SD3Transformer2DModel (family "sd3", also when _class_name is absent) or
// QwenImageTransformer2DModel (family "qwen_image"); the losses call either through
// flow_model().
class EngineRegistry {
 public:
  static void register_model(const std::string& model_type, const std::string& backend,
                             ModelBuilder builder, LossFactory loss = nullptr,
                             ModelSizer sizer = nullptr);
  static std::unique_ptr<Engine> create(const EngineConfig& config,
                                        std::shared_ptr<dist::World> world);
  // The model's size as the memory plan reads it (memory_plan.h); an error for a model type
  // registered without a sizer.
  static ModelSize model_size(const EngineConfig& config);
  static std::vector<std::string> keys();  // "model_type/backend"
};

// The transformer of a diffusion model type's engine as the diffusion algorithms call it
// (models::FlowModel): SD3's or Qwen-Image's, by the family its builder recorded.
models::FlowModel flow_model(Engine& engine);

}  // namespace shardrl::engine
