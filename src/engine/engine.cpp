#include "shardrl/engine.h"

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>
#include <stdexcept>

#include "shardrl/models/lora.h"

namespace shardrl::engine {

int64_t batch_size(const Batch& batch) {
  if (batch.empty()) throw std::invalid_argument("batch: it holds no tensors");
  int64_t size = -1;
  std::string first;
  for (const auto& [name, tensor] : batch) {
    if (!tensor.defined() || tensor.dim() == 0) {
      throw std::invalid_argument(fmt::format("batch: '{}' has no sample dimension", name));
    }
    if (size < 0) {
      size = tensor.size(0);
      first = name;
    } else if (tensor.size(0) != size) {
      throw std::invalid_argument(fmt::format("batch: '{}' has {} samples but '{}' has {}", name,
                                              tensor.size(0), first, size));
    }
  }
  return size;
}

Batch slice_batch(const Batch& batch, int64_t first, int64_t rows) {
  Batch out;
  for (const auto& [name, tensor] : batch) out[name] = tensor.narrow(0, first, rows);
  return out;
}

std::vector<Batch> split_batch(const Batch& batch, int64_t count) {
  const int64_t n = batch_size(batch);
  if (count < 1 || count > n) {
    throw std::invalid_argument(
        fmt::format("batch: cannot split {} samples into {} micro-batches", n, count));
  }
  std::vector<Batch> parts;
  int64_t first = 0;
  for (int64_t i = 0; i < count; ++i) {
    const int64_t rows = n / count + (i < n % count ? 1 : 0);
    parts.push_back(slice_batch(batch, first, rows));
    first += rows;
  }
  return parts;
}

namespace {

Batch to_device(const Batch& batch, const torch::Device& device) {
  Batch out;
  for (const auto& [name, tensor] : batch) out[name] = tensor.to(device);
  return out;
}

}  // namespace

Batch concat_batches(const std::vector<Batch>& parts) {
  Batch out;
  if (parts.empty()) return out;
  for (const auto& [name, unused] : parts.front()) {
    std::vector<torch::Tensor> pieces;
    for (const auto& part : parts) {
      auto it = part.find(name);
      if (it == part.end()) {
        throw std::invalid_argument(fmt::format("batch: '{}' is missing from a micro-batch", name));
      }
      pieces.push_back(it->second);
    }
    out[name] = torch::cat(pieces);
  }
  return out;
}

Engine::Engine(EngineConfig config, std::shared_ptr<dist::World> world, const ModelBuilder& builder,
               LossFn loss)
    : config_(std::move(config)),
      world_(std::move(world)),
      mesh_(dist::DeviceMesh::create(*world_, config_.fsdp_size,
                                     config_.ulysses_sequence_parallel_size)),
      model_(builder(config_.model, mesh_, config_.fsdp)),
      loss_(std::move(loss)) {
  if (mesh_.sequence_parallel_size() > 1 && !model_.sequence_parallel) {
    throw std::invalid_argument(fmt::format(
        "model_type '{}': its model has no sequence parallelism (ulysses_sequence_parallel_size="
        "{}); the llama family and the SD3 transformer have it",
        config_.model_type, mesh_.sequence_parallel_size()));
  }
  if (config_.forward_only) {
    // A reference model never updates: no grads are kept, so backward never reaches it.
    for (auto& p : model_.module->parameters()) p.set_requires_grad(false);
    if (config_.offload.param_offload) offload::set_policy(model_.fsdp, nullptr, config_.offload);
    return;
  }
  optim::AdamWConfig adamw;
  adamw.lr = config_.optim.lr;
  adamw.beta1 = config_.optim.beta1;
  adamw.beta2 = config_.optim.beta2;
  adamw.eps = config_.optim.eps;
  adamw.weight_decay = config_.optim.weight_decay;
  const auto params = optim::from_sharded(model_.fsdp.sharded_parameters());
  if (config_.optim.loraplus_lr_ratio) {
    // LoRA+: the B matrices in their own AdamW at a higher lr, each part keeping the decay rule.
    std::vector<optim::NamedParameter> rest, lora_b;
    for (const auto& p : params) {
      (models::lora::is_lora_b_tensor(p.name) ? lora_b : rest).push_back(p);
    }
    if (lora_b.empty()) {
      throw std::invalid_argument(
          "optim.loraplus_lr_ratio is set, but the model has no LoRA B matrices (lora_B.*)");
    }
    optim::AdamWConfig faster = adamw;
    faster.lr = adamw.lr * *config_.optim.loraplus_lr_ratio;
    std::vector<std::unique_ptr<torch::optim::Optimizer>> parts;
    parts.push_back(optim::make_adamw(rest, adamw));
    parts.push_back(optim::make_adamw(lora_b, faster));
    optimizer_ = std::make_unique<optim::GroupedOptimizer>(std::move(parts));
  } else {
    optimizer_ = optim::make_adamw(params, adamw);
  }
  scheduler_ = std::make_unique<optim::LRScheduler>(*optimizer_, config_.optim.schedule);
  if (config_.offload_policy) {
    offload::set_policy(model_.fsdp, optimizer_.get(), config_.offload);
  } else if (config_.offload.param_offload || config_.offload.optimizer_offload) {
    // Between phases the state waits in the tier, as verl's engines keep it after initialize().
    offload::Options tier_only = config_.offload;
    tier_only.param_offload = tier_only.optimizer_offload = false;
    offload::set_policy(model_.fsdp, optimizer_.get(), tier_only);
    offload(offloaded_between_phases(/*train=*/true));
  }
}

offload::Selection Engine::offloaded_between_phases(bool train) const {
  // The policy keeps the state in the tier all along, so the phase scopes have nothing to move.
  if (config_.offload_policy || (config_.forward_only && config_.offload.param_offload)) {
    return {false, false, false};
  }
  const bool params = config_.offload.param_offload;
  return {params, params && train, train && optimizer_ && config_.offload.optimizer_offload};
}

Engine::ModeScope::ModeScope(Engine& engine, offload::Selection what)
    : engine_(engine), what_(what), active_(false) {
  if (!what.model && !what.grad && !what.optimizer) return;
  // Resident already: an enclosing scope brought it in and will take it out again.
  const auto report = engine_.memory();
  active_ = (what.model && report.params.offloaded > 0) ||
            (what.optimizer && report.optimizer.offloaded > 0);
  if (active_) engine_.onload(what_);
}

Engine::ModeScope::~ModeScope() {
  if (!active_) return;
  try {
    engine_.offload(what_);
  } catch (const std::exception& e) {
    // A destructor cannot throw; the state stays resident, which is correct, only larger.
    spdlog::error("offload at the end of a phase failed, the state stays resident: {}", e.what());
  }
}

Engine::ModeScope Engine::train_mode() {
  return ModeScope(*this, offloaded_between_phases(true));
}
Engine::ModeScope Engine::eval_mode() {
  return ModeScope(*this, offloaded_between_phases(false));
}

Engine::ModeScope Engine::offloaded_state_in(bool params_only) {
  // Whatever is offloaded now, between phases or by the training policy: the checkpoint and the
  // weight sync read the shards' bytes directly, and exactly this goes back afterwards.
  const auto report = memory();
  const bool params = report.params.offloaded > 0;
  return ModeScope(*this, {params, !params_only && params && report.grads.offloaded > 0,
                           !params_only && report.optimizer.offloaded > 0});
}

namespace {
// Adds the wall time of one transfer to `total`, also when it throws.
class TransferTimer {
 public:
  explicit TransferTimer(double& total) : total_(total), start_(Clock::now()) {}
  ~TransferTimer() { total_ += std::chrono::duration<double>(Clock::now() - start_).count(); }

 private:
  using Clock = std::chrono::steady_clock;
  double& total_;
  Clock::time_point start_;
};
}  // namespace

void Engine::to(offload::Tier tier, offload::Selection what) {
  TransferTimer timer(offload_seconds_);
  offload::to(tier, model_.fsdp, optimizer_.get(), what);
}
void Engine::offload(offload::Selection what) {
  TransferTimer timer(offload_seconds_);
  offload::offload(model_.fsdp, optimizer_.get(), what);
}
void Engine::onload(offload::Selection what) {
  TransferTimer timer(offload_seconds_);
  offload::onload(model_.fsdp, optimizer_.get(), what);
}
offload::MemoryReport Engine::memory() const {
  return offload::memory(model_.fsdp, optimizer_.get());
}
void Engine::log_memory(const std::string& phase) const {
  offload::log_memory(phase, model_.fsdp, optimizer_.get());
}

void Engine::optimizer_zero_grad() {
  model_.fsdp.zero_grad();
}

optim::StepResult Engine::optimizer_step() {
  TORCH_CHECK(optimizer_, "optimizer_step: this engine is forward_only (a reference model)");
  return optim::clip_and_step(model_.fsdp, *optimizer_, config_.optim.clip_grad);
}

double Engine::lr_scheduler_step() {
  TORCH_CHECK(scheduler_, "lr_scheduler_step: this engine is forward_only (a reference model)");
  return scheduler_->step();
}

double Engine::current_lr() const {
  return scheduler_ ? scheduler_->current_lr() : 0.0;
}

int64_t Engine::agreed_micro_batch_count(int64_t local_samples) {
  const int64_t per = config_.micro_batch_size_per_gpu;
  const int64_t local = per > 0 ? (local_samples + per - 1) / per : 1;
  // Every rank must run the same number of forward/backward passes, or the FSDP collectives of
  // one rank wait forever for a peer that has finished.
  auto count = torch::tensor({local}, torch::kLong);
  world_->group().all_reduce(count, dist::ReduceOp::kMax);
  const int64_t agreed = count.item<int64_t>();
  if (agreed > local_samples) {
    throw std::invalid_argument(
        fmt::format("rank {}: {} local samples cannot fill the {} micro-batches another rank needs",
                    world_->rank(), local_samples, agreed));
  }
  return agreed;
}

Metrics Engine::average_over_ranks(const Metrics& metrics) {
  if (metrics.empty() || world_->size() == 1) return metrics;
  auto values = torch::empty({static_cast<int64_t>(metrics.size())}, torch::kDouble);
  int64_t i = 0;
  for (const auto& [name, value] : metrics) values[i++] = value;
  world_->group().all_reduce(values);
  values /= world_->size();
  Metrics out;
  i = 0;
  for (const auto& [name, value] : metrics) out[name] = values[i++].item<double>();
  return out;
}

Metrics Engine::forward_backward_batch(const Batch& data, const LossFn& loss_fn, bool forward_only,
                                       Batch* outputs) {
  TORCH_CHECK(forward_only || optimizer_,
              "forward_backward_batch: this engine is forward_only (a reference model)");
  const auto micro_batches = split_batch(data, agreed_micro_batch_count(batch_size(data)));
  const auto count = static_cast<int64_t>(micro_batches.size());
  Metrics sums;
  std::vector<Batch> collected;
  // The loss computes where the model does: each micro-batch moves to the mesh's device (verl's
  // data.to(get_device_id())), and per-sample outputs come back to the host, as verl returns them.
  const torch::Device device = mesh_.device();
  for (int64_t i = 0; i < count; ++i) {
    if (!forward_only) model_.fsdp.set_requires_gradient_sync(i == count - 1);
    const Batch micro_batch = to_device(micro_batches[i], device);
    LossOutput out = loss_fn(*this, MicroBatch{micro_batch, i, count});
    if (!forward_only) {
      TORCH_CHECK(out.loss.defined() && out.loss.numel() == 1,
                  "forward_backward_batch: the loss function must return a scalar loss");
      out.loss.backward();
      sums["loss"] += out.loss.item<double>();
    }
    for (const auto& [name, value] : out.metrics) sums[name] += value / count;
    if (outputs) collected.push_back(to_device(out.outputs, torch::kCPU));
  }
  if (outputs) *outputs = concat_batches(collected);
  return average_over_ranks(sums);
}

Metrics Engine::train_batch(const Batch& data, const LossFn& loss_fn) {
  optimizer_zero_grad();
  Metrics metrics = forward_backward_batch(data, loss_fn, /*forward_only=*/false);
  const auto step = optimizer_step();
  metrics["grad_norm"] = step.grad_norm;
  metrics["step_skipped"] = step.skipped ? 1.0 : 0.0;
  metrics["lr"] = current_lr();
  lr_scheduler_step();
  return metrics;
}

const LossFn& Engine::loss_fn() const {
  if (!loss_) {
    throw std::invalid_argument(fmt::format(
        "model_type '{}' registers no loss: pass train_batch a loss function", config_.model_type));
  }
  return loss_;
}

Batch Engine::infer_batch(const Batch& data, const LossFn& loss_fn, Metrics* metrics) {
  torch::NoGradGuard no_grad;
  Batch outputs;
  auto m = forward_backward_batch(data, loss_fn, /*forward_only=*/true, &outputs);
  if (metrics) *metrics = std::move(m);
  return outputs;
}

void Engine::get_per_tensor_param(const TensorCallback& callback,
                                  const WeightSyncOptions& options) {
  ModeScope params_in = offloaded_state_in(/*params_only=*/true);
  const auto& sharded = model_.fsdp;
  if (options.trainable_only) {
    if (!options.merge_adapter.empty()) {
      throw std::invalid_argument(
          "get_per_tensor_param: trainable_only sends the adapters unmerged; merge_adapter '" +
          options.merge_adapter + "' would change every base weight it targets");
    }
    std::set<std::string> trainable;
    for (const auto& p : sharded.sharded_parameters()) {
      if (p.shard.requires_grad()) trainable.insert(p.name);
    }
    checkpoint::for_each_full_parameter(
        sharded, options.dtype, options.prefix, callback,
        [&](const std::string& name) { return trainable.count(name) > 0; });
    return;
  }
  if (options.merge_adapter.empty()) {
    checkpoint::for_each_full_parameter(sharded, options.dtype, options.prefix, callback);
    return;
  }
  struct Target {
    double scaling = 0;
    torch::Tensor a, b;
  };
  std::map<std::string, Target> targets;                                // by the base weight's name
  std::map<std::string, std::pair<std::string, bool>> adapter_tensors;  // name -> (weight, is A)
  for (const auto& [module_name, layer] : models::lora::lora_linears(*model_.module)) {
    if (!layer->has_adapter(options.merge_adapter)) continue;
    TORCH_CHECK(layer->merged_adapter().empty(), "get_per_tensor_param: ", module_name,
                " already has adapter '", layer->merged_adapter(), "' merged into its weight");
    const std::string base = module_name.empty() ? "" : module_name + ".";
    targets[base + "weight"].scaling = layer->adapter_config(options.merge_adapter).scaling();
    adapter_tensors[base + "lora_A." + options.merge_adapter + ".weight"] = {base + "weight", true};
    adapter_tensors[base + "lora_B." + options.merge_adapter + ".weight"] = {base + "weight",
                                                                             false};
  }
  if (targets.empty()) {
    throw std::invalid_argument(
        fmt::format("get_per_tensor_param: merge_adapter '{}' is on no layer of the model",
                    options.merge_adapter));
  }
  // The adapters are small (rank r), so all of them are gathered first; then every base weight is
  // merged as it streams past, and the peak stays one full tensor plus the adapters.
  checkpoint::for_each_full_parameter(
      sharded, torch::kFloat, "",
      [&](const std::string& name, const torch::Tensor& full) {
        const auto& [weight, is_a] = adapter_tensors.at(name);
        (is_a ? targets[weight].a : targets[weight].b) = full.clone();
      },
      [&](const std::string& name) { return adapter_tensors.count(name) > 0; });
  checkpoint::for_each_full_parameter(
      sharded, torch::kFloat, "",
      [&](const std::string& name, const torch::Tensor& full) {
        auto it = targets.find(name);
        const torch::Tensor out =
            it == targets.end()
                ? full
                : full + models::lora::delta_weight(it->second.a, it->second.b, it->second.scaling);
        callback(options.prefix + name, out.to(options.dtype));
      },
      [&](const std::string& name) { return !models::lora::is_adapter_tensor(name); });
}

std::string Engine::save_checkpoint(const std::string& root, int64_t step,
                                    const nlohmann::json& extra) {
  TORCH_CHECK(optimizer_, "save_checkpoint: this engine is forward_only (a reference model)");
  // checkpoint::save and load bring offloaded state in unit by unit themselves (through the
  // offload layer's residency): nothing is onloaded whole, so a model beyond memory saves too.
  nlohmann::json saved = model_.export_info;
  saved.update(extra);
  return checkpoint::save(root, step, model_.fsdp, *optimizer_, scheduler_.get(), saved,
                          config_.checkpoint);
}

checkpoint::LoadResult Engine::load_checkpoint(const std::string& dir, bool files_checked) {
  return checkpoint::load(dir, model_.fsdp, optimizer_.get(), scheduler_.get(), files_checked);
}

}  // namespace shardrl::engine
