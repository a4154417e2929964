// The engine registry and the built-in model families.
#include <fmt/format.h>

#include <filesystem>
#include <mutex>
#include <stdexcept>

#include "shardrl/checkpoint.h"
#include "shardrl/engine.h"
#include "shardrl/models/dit.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/transformer.h"
#include "shardrl/models/weights.h"

namespace shardrl::engine {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

template <class T>
T field(const json& j, const char* name, T fallback) {
  if (!j.contains(name) || j[name].is_null()) return fallback;
  try {
    return j[name].get<T>();
  } catch (const json::exception&) {
    throw std::invalid_argument(fmt::format("model.{}: wrong type ({})", name, j[name].dump()));
  }
}

// LoRA settings in verl's names: lora_rank (0: full fine-tuning), lora_alpha, target_modules.
struct AdapterPlan {
  models::lora::LoraConfig lora;
  std::vector<std::string> frozen_copies;  // non-trainable adapters initialised as "default"
  bool enabled() const { return lora.r > 0; }
};

AdapterPlan adapter_plan(const json& j, std::vector<std::string> default_targets) {
  AdapterPlan plan;
  plan.lora.r = field<int64_t>(j, "lora_rank", 0);
  plan.lora.alpha = field<double>(j, "lora_alpha", 16.0);
  plan.lora.dropout = field<double>(j, "lora_dropout", 0.0);
  plan.lora.target_modules =
      field<std::vector<std::string>>(j, "target_modules", std::move(default_targets));
  if (plan.lora.r < 0) throw std::invalid_argument("model.lora_rank: must be >= 0");
  return plan;
}

// Pretrained base weights, model.path: a safetensors file, or a directory with model.safetensors
// or Hugging Face's sharded model.safetensors.index.json.
std::string pretrained_path(const json& j) {
  const auto path = field<std::string>(j, "path", "");
  if (path.empty()) return path;
  const bool found = fs::is_directory(path)
                         ? fs::exists(fs::path(path) / "model.safetensors") ||
                               fs::exists(fs::path(path) / "model.safetensors.index.json")
                         : fs::exists(path);
  if (!found) {
    throw std::invalid_argument(fmt::format(
        "model.path: '{}' is neither a safetensors file nor a directory with model.safetensors",
        path));
  }
  return path;
}

// Models that load weights are built under fsdp::EmptyInit, so nothing is allocated unsharded;
// once sharded, the first rank of each shard group reads the weights and sends every rank its
// rows. Adapters are not in the file: they keep their fresh values.
void load_sharded(const std::string& path, fsdp::FSDPModule model) {
  if (path.empty()) return;
  checkpoint::load_hf_from_rank0(path, model, "", [](const std::string& name) {
    return !models::lora::is_adapter_tensor(name);
  });
}

// Every adapter on the model, each with its PEFT adapter_config.json (the frozen copies share the
// trained adapter's config).
json adapter_export_info(const AdapterPlan& plan) {
  if (!plan.enabled()) return json::object();
  json lora = {{"default", json::parse(models::lora::peft_adapter_config(plan.lora))}};
  for (const auto& name : plan.frozen_copies) lora[name] = lora["default"];
  return {{"lora", lora}};
}

void add_adapters(torch::nn::Module& module, const AdapterPlan& plan) {
  if (!plan.enabled()) return;
  if (models::lora::apply_lora(module, plan.lora, "default").empty()) {
    throw std::invalid_argument("model.target_modules: no linear layer matches");
  }
  for (const auto& name : plan.frozen_copies) {
    models::lora::apply_lora(module, plan.lora, name, /*trainable=*/false);
    models::lora::copy_adapter(models::lora::named_tensors(module), name, "default");
  }
  models::lora::set_active_adapter(module, "default");
}

template <class Holder>
Model finish(Holder holder, const fsdp::FSDPModule& sharded, const std::string& family,
             const json& config, const AdapterPlan& plan) {
  json info = {{"family", family}, {"config", config}};
  info.update(adapter_export_info(plan));
  return Model{holder.ptr(), sharded, holder, std::move(info)};
}

Model build_language_model(const json& j, const dist::DeviceMesh& mesh,
                           const fsdp::Options& options) {
  const auto family = field<std::string>(j, "family", "llama");
  const json config = j.value("config", json::object());
  const bool checkpointing = field<bool>(j, "enable_activation_checkpointing", false);
  const auto path = pretrained_path(j);
  if (family == "gpt") {
    const auto c = models::TransformerConfig::from_json(config);
    models::Transformer model{nullptr};
    {
      fsdp::EmptyInit empty(/*enabled=*/!path.empty());
      model = models::Transformer(c);
    }
    const auto plan = adapter_plan(j, {"q_proj", "v_proj"});
    add_adapters(*model, plan);
    models::shard_transformer(model, mesh, options);
    load_sharded(path, model.fsdp());
    return finish(model, model.fsdp(), family, c.to_json(), plan);
  }
  if (family == "llama") {
    const auto c = models::LlamaConfig::from_json(config);
    models::LlamaForCausalLM model{nullptr};
    {
      fsdp::EmptyInit empty(/*enabled=*/!path.empty());
      model = models::LlamaForCausalLM(c);
    }
    const auto plan = adapter_plan(j, {"q_proj", "k_proj", "v_proj", "o_proj"});
    add_adapters(*model, plan);
    model->set_activation_checkpointing(checkpointing);
    models::shard_llama(model, mesh, options);
    load_sharded(path, model.fsdp());
    return finish(model, model.fsdp(), family, c.to_json(), plan);
  }
  throw std::invalid_argument(
      fmt::format("model.family: '{}' is not a language model family (gpt, llama)", family));
}

ModelBuilder dit_builder(std::vector<std::string> frozen_adapters) {
  return [frozen_adapters](const json& j, const dist::DeviceMesh& mesh,
                           const fsdp::Options& options) {
    const auto family = field<std::string>(j, "family", "dit");
    if (family != "dit") {
      throw std::invalid_argument(
          fmt::format("model.family: '{}' is not a diffusion model family (dit)", family));
    }
    const auto c = models::DiTConfig::from_json(j.value("config", json::object()));
    const auto path = pretrained_path(j);
    models::DiT model{nullptr};
    {
      fsdp::EmptyInit empty(/*enabled=*/!path.empty());
      model = models::DiT(c);
    }
    auto plan = adapter_plan(j, {"qkv", "proj", "fc1", "fc2"});
    plan.frozen_copies = frozen_adapters;
    add_adapters(*model, plan);
    model->set_activation_checkpointing(field<bool>(j, "enable_activation_checkpointing", false));
    models::shard_dit(model, mesh, options);
    load_sharded(path, model.fsdp());
    return finish(model, model.fsdp(), family, c.to_json(), plan);
  };
}

struct Registry {
  std::mutex mutex;
  std::map<std::string, ModelBuilder> builders;

  Registry() {
    builders["language_model/fsdp"] = build_language_model;
    builders["diffusion_model/fsdp"] = dit_builder({});
    builders["diffusion_dpo_model/fsdp"] = dit_builder({});
    // NFT's behaviour policy "old" starts as a copy of the trained adapter and follows it by EMA.
    builders["diffusion_nft_model/fsdp"] = dit_builder({"old"});
  }

  static Registry& get() {
    static Registry registry;
    return registry;
  }
};

}  // namespace

void EngineRegistry::register_model(const std::string& model_type, const std::string& backend,
                                    ModelBuilder builder) {
  auto& registry = Registry::get();
  std::lock_guard lock(registry.mutex);
  registry.builders[model_type + "/" + backend] = std::move(builder);
}

std::unique_ptr<Engine> EngineRegistry::create(const EngineConfig& config,
                                               std::shared_ptr<dist::World> world) {
  auto& registry = Registry::get();
  ModelBuilder builder;
  {
    std::lock_guard lock(registry.mutex);
    auto it = registry.builders.find(config.model_type + "/" + config.backend);
    if (it == registry.builders.end()) {
      std::string known;
      for (const auto& [key, unused] : registry.builders)
        known += (known.empty() ? "" : ", ") + key;
      throw std::invalid_argument(
          fmt::format("model_type/backend: no engine registered for '{}/{}' (registered: {})",
                      config.model_type, config.backend, known));
    }
    builder = it->second;
  }
  return std::make_unique<Engine>(config, std::move(world), builder);
}

std::vector<std::string> EngineRegistry::keys() {
  auto& registry = Registry::get();
  std::lock_guard lock(registry.mutex);
  std::vector<std::string> out;
  for (const auto& [key, unused] : registry.builders) out.push_back(key);
  return out;
}

}  // namespace shardrl::engine
