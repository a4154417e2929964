// The engine registry and the built-in model families.
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <regex>
#include <stdexcept>

#include "shardrl/algos/diffusion_rl.h"
#include "shardrl/checkpoint.h"
#include "shardrl/engine.h"
#include "shardrl/memory_plan.h"
#include "shardrl/models/flow_model.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/qwen_image.h"
#include "shardrl/models/sd3.h"
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

// sequence_parallel: the family splits its model over the mesh's Ulysses group.
template <class Holder>
Model finish(Holder holder, const fsdp::FSDPModule& sharded, const std::string& family,
             const json& config, const AdapterPlan& plan, bool sequence_parallel) {
  json info = {{"family", family}, {"config", config}};
  info.update(adapter_export_info(plan));
  return Model{holder.ptr(), sharded, holder, std::move(info), sequence_parallel};
}

// The model's config.json fields: those of the pretrained folder model.path when it has a
// config.json (a user's download brings its own, as lm_grpo reads it), else model.config.
json language_model_config(const json& j) {
  const auto path = field<std::string>(j, "path", "");
  if (!path.empty() && fs::exists(fs::path(path) / "config.json")) {
    std::ifstream in(fs::path(path) / "config.json");
    try {
      return json::parse(in);
    } catch (const json::exception& e) {
      throw std::invalid_argument(
          fmt::format("model.path: {}/config.json is not valid JSON: {}", path, e.what()));
    }
  }
  return j.contains("config") && !j["config"].is_null() ? j["config"] : json::object();
}

Model build_language_model(const json& j, const dist::DeviceMesh& mesh,
                           const fsdp::Options& options) {
  const auto family = field<std::string>(j, "family", "llama");
  const json config = language_model_config(j);
  const bool checkpointing = field<bool>(j, "enable_gradient_checkpointing", false);
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
    model->set_activation_checkpointing(checkpointing);
    models::shard_transformer(model, mesh, options);
    load_sharded(path, model.fsdp());
    return finish(model, model.fsdp(), family, c.to_json(), plan, /*sequence_parallel=*/false);
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
    model->set_sequence_parallel(mesh.sequence_parallel_group());
    models::shard_llama(model, mesh, options);
    load_sharded(path, model.fsdp());
    return finish(model, model.fsdp(), family, c.to_json(), plan, /*sequence_parallel=*/true);
  }
  throw std::invalid_argument(
      fmt::format("model.family: '{}' is not a language model family (gpt, llama)", family));
}

// A model built without bytes (fsdp::EmptyInit), counted unit by unit: each param belongs to the
// unit whose pattern matches its name (the first capture names the unit), or to the root. The
// patterns follow the family's sharding function (shard_llama, shard_transformer, shard_sd3);
// EngineRegistry's tests hold the two to the same units.
ModelSize count_units(torch::nn::Module& module, const std::vector<std::regex>& unit_patterns) {
  ModelSize size;
  size.units.push_back({"root", 0, 0});
  std::map<std::string, size_t> index;
  for (const auto& item : module.named_parameters()) {
    size_t at = 0;
    std::smatch match;
    for (const auto& pattern : unit_patterns) {
      if (std::regex_match(item.key(), match, pattern)) {
        auto [it, added] = index.emplace(match[1].str(), size.units.size());
        if (added) size.units.push_back({match[1].str(), 0, 0});
        at = it->second;
        break;
      }
    }
    size.units[at].params += item.value().numel();
    if (item.value().requires_grad()) size.units[at].trainable += item.value().numel();
  }
  return size;
}

// The activations of a pre-norm decoder block per token, in fp32: about 12 hidden-wide tensors
// (norms, q/k/v, the attention output and projection input, residuals) and 4 MLP-wide ones (gate,
// up, their product, the down projection's input); the attention probabilities [heads, T, T] and
// their pre-softmax scores add 2 x heads floats per position.
void decoder_activations(ModelSize& size, int64_t blocks, int64_t hidden, int64_t mlp,
                         int64_t heads) {
  size.blocks = blocks;
  size.block_input_bytes_per_token = 4.0 * static_cast<double>(hidden);
  size.block_activation_bytes_per_token = 4.0 * static_cast<double>(12 * hidden + 4 * mlp);
  size.block_attention_bytes_per_token_position = 4.0 * 2.0 * static_cast<double>(heads);
}

// A Llama-family decoder's activations. Attention runs through at::scaled_dot_product_attention:
// the flash kernels keep a log-sum-exp per query and head for backward, no [heads, T, T] scores.
void llama_activations(ModelSize& size, const models::LlamaConfig& c) {
  decoder_activations(size, c.num_hidden_layers, c.hidden_size, c.intermediate_size,
                      c.num_attention_heads);
  size.block_activation_bytes_per_token += 4.0 * static_cast<double>(c.num_attention_heads);
  size.block_attention_bytes_per_token_position = 0;
}

ModelSize language_model_size(const json& j) {
  const auto family = field<std::string>(j, "family", "llama");
  const json config = language_model_config(j);
  fsdp::EmptyInit empty;
  if (family == "gpt") {
    const auto c = models::TransformerConfig::from_json(config);
    models::Transformer model(c);
    add_adapters(*model, adapter_plan(j, {"q_proj", "v_proj"}));
    auto size = count_units(*model, {std::regex(R"((blocks\.\d+)\..*)"),
                                     std::regex(R"((tok_emb)\..*)"), std::regex(R"((head)\..*)")});
    decoder_activations(size, c.n_layers, c.d_model, c.mlp_ratio * c.d_model, c.n_heads);
    size.vocab_size = c.vocab_size;
    size.kv_bytes_per_token = 2 * 4 * c.n_layers * c.d_model;
    return size;
  }
  if (family == "llama") {
    const auto c = models::LlamaConfig::from_json(config);
    models::LlamaForCausalLM model(c);
    add_adapters(*model, adapter_plan(j, {"q_proj", "k_proj", "v_proj", "o_proj"}));
    std::vector<std::regex> units = {std::regex(R"((model\.layers\.\d+)\..*)")};
    if (!c.tie_word_embeddings) {
      units.emplace_back(R"((model\.embed_tokens)\..*)");
      units.emplace_back(R"((lm_head)\..*)");
    }
    auto size = count_units(*model, units);
    llama_activations(size, c);
    size.vocab_size = c.vocab_size;
    size.kv_bytes_per_token =
        2 * 4 * c.num_hidden_layers * c.num_key_value_heads * c.attention_head_dim();
    return size;
  }
  throw std::invalid_argument(
      fmt::format("model.family: '{}' is not a language model family (gpt, llama)", family));
}

// verl's value_model (FSDPEngineWithValueHead): <Family>ForTokenClassification with one label,
// the critic of PPO. Made from the actor's causal LM folder, as verl's critic.model.path is: the
// decoder is read, lm_head is not, and the head `score`, absent there, starts as transformers
// initializes a new one (N(0, initializer_range), seeded alike on every rank). A folder that
// holds `score` (a critic checkpoint's export) gives it.
Model build_value_model(const json& j, const dist::DeviceMesh& mesh, const fsdp::Options& options) {
  const auto family = field<std::string>(j, "family", "llama");
  if (family != "llama") {
    throw std::invalid_argument(fmt::format(
        "model.family: the value model (critic) is built on the llama family, got '{}'", family));
  }
  if (adapter_plan(j, {}).enabled()) {
    throw std::invalid_argument(
        "model.lora_rank: the value model (critic) trains in full; LoRA on it is not implemented");
  }
  const json config = language_model_config(j);
  const auto c = models::LlamaConfig::from_json(config);
  const auto path = pretrained_path(j);
  models::LlamaForTokenClassification model{nullptr};
  {
    fsdp::EmptyInit empty(/*enabled=*/!path.empty());
    model = models::LlamaForTokenClassification(c);
  }
  const bool head_in_file = !path.empty() && models::weight_shapes(path).count("score.weight") > 0;
  if (!path.empty() && !head_in_file) {
    // Built with bytes, so the head holds real values before sharding takes each rank's rows.
    model->score = model->replace_module(
        "score", models::Linear(torch::nn::LinearOptions(c.hidden_size, 1).bias(true)));
  }
  if (!head_in_file) {
    models::init_value_head(*model->score, config.value("initializer_range", 0.02),
                            field<uint64_t>(j, "seed", 0));
  }
  model->set_activation_checkpointing(field<bool>(j, "enable_gradient_checkpointing", false));
  model->set_sequence_parallel(mesh.sequence_parallel_group());
  models::shard_llama(model, mesh, options);
  if (!path.empty()) {
    auto sharded = model.fsdp();
    checkpoint::load_hf_from_rank0(path, sharded, "", [&](const std::string& name) {
      return head_in_file || name.rfind("score.", 0) != 0;
    });
  }
  return finish(model, model.fsdp(), family, models::value_model_config_json(c), AdapterPlan{},
                /*sequence_parallel=*/true);
}

ModelSize value_model_size(const json& j) {
  const auto c = models::LlamaConfig::from_json(language_model_config(j));
  fsdp::EmptyInit empty;
  models::LlamaForTokenClassification model(c);
  auto size = count_units(*model, {std::regex(R"((model\.layers\.\d+)\..*)"),
                                   std::regex(R"((model\.embed_tokens)\..*)")});
  llama_activations(size, c);
  return size;
}

// verl-omni's transformer_subfolder: a diffusers pipeline folder keeps its transformer there; a
// transformer folder (save_pretrained of the model alone) has config.json at its top, beside its
// weights in one file or in several with their index.
std::string diffusers_transformer_dir(const json& j) {
  const auto path = field<std::string>(j, "path", "");
  if (path.empty()) return path;
  const auto subfolder = field<std::string>(j, "transformer_subfolder", "transformer");
  for (const auto& dir : {fs::path(path), fs::path(path) / subfolder}) {
    if (fs::exists(dir / "config.json") &&
        (fs::exists(dir / "diffusion_pytorch_model.safetensors") ||
         fs::exists(dir / "diffusion_pytorch_model.safetensors.index.json")))
      return dir.string();
  }
  throw std::invalid_argument(
      fmt::format("model.path: '{}' holds no diffusers transformer (config.json and "
                  "diffusion_pytorch_model.safetensors or its .index.json, at its top or under "
                  "model.transformer_subfolder '{}')",
                  path, subfolder));
}

// Whether the diffusion model is Qwen-Image's transformer: its config.json's _class_name (that of
// model.path's folder, else model.config's) names it, as diffusers picks the class it builds. A
// config without _class_name is SD3's.
bool is_qwen_image(const json& j) {
  const auto dir = diffusers_transformer_dir(j);
  json config = j.value("config", json::object());
  if (!dir.empty()) {
    std::ifstream in(fs::path(dir) / "config.json");
    config = json::parse(in, nullptr, /*allow_exceptions=*/false);
  }
  return config.is_object() && config.contains("_class_name") &&
         config["_class_name"] == models::kQwenImageClassName;
}

// verl-omni's policy_state_adapters: "default" is the trained adapter, every other one a frozen
// copy of it (NFT's "old", which follows "default" by EMA).
std::vector<std::string> frozen_adapters(const json& j, std::vector<std::string> fallback) {
  const auto states = field<std::vector<std::string>>(j, "policy_state_adapters", fallback);
  if (std::find(states.begin(), states.end(), "default") == states.end()) {
    throw std::invalid_argument(
        fmt::format("model.policy_state_adapters: {} lacks \"default\", the trained adapter",
                    json(states).dump()));
  }
  std::vector<std::string> frozen;
  for (const auto& s : states) {
    if (s != "default") frozen.push_back(s);
  }
  return frozen;
}

// A diffusers transformer's adapters: the trained one (on `targets` unless model.target_modules
// says otherwise) and the model type's frozen copies of it.
AdapterPlan diffusers_adapter_plan(const json& j, std::vector<std::string> targets,
                                   const std::vector<std::string>& default_states) {
  auto plan = adapter_plan(j, std::move(targets));
  if (plan.enabled()) plan.frozen_copies = frozen_adapters(j, default_states);
  return plan;
}

const std::vector<std::string> kSd3LoraTargets = {
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"};

models::SD3Config sd3_config(const json& j, const std::string& dir) {
  return dir.empty() ? models::SD3Config::from_json(j.value("config", json::object()))
                     : models::SD3Config::load((fs::path(dir) / "config.json").string());
}

// The SD3 transformer of verl-omni's diffusion model types: its config from model.path (a
// diffusers folder) or model.config (diffusers' config.json fields), LoRA by diffusers' names.
Model build_sd3(const json& j, const dist::DeviceMesh& mesh, const fsdp::Options& options,
                const std::vector<std::string>& default_states) {
  const auto dir = diffusers_transformer_dir(j);
  const auto c = sd3_config(j, dir);
  models::SD3Transformer2DModel model{nullptr};
  {
    fsdp::EmptyInit empty(/*enabled=*/!dir.empty());
    model = models::SD3Transformer2DModel(c);
  }
  const auto plan = diffusers_adapter_plan(j, kSd3LoraTargets, default_states);
  add_adapters(*model, plan);
  model->set_activation_checkpointing(field<bool>(j, "enable_gradient_checkpointing", false));
  model->set_sequence_parallel(mesh.sequence_parallel_group());
  models::shard_sd3(model, mesh, options);
  // The position table is no param: the config determines it, as in diffusers.
  load_sharded(dir, model.fsdp());
  return finish(model, model.fsdp(), "sd3", c.to_json(), plan, /*sequence_parallel=*/true);
}

ModelSize sd3_size(const json& j, const std::vector<std::string>& default_states) {
  const auto dir = diffusers_transformer_dir(j);
  const auto c = sd3_config(j, dir);
  fsdp::EmptyInit empty;
  models::SD3Transformer2DModel model(c);
  const auto plan = diffusers_adapter_plan(j, kSd3LoraTargets, default_states);
  add_adapters(*model, plan);
  auto size = count_units(*model, {std::regex(R"((transformer_blocks\.\d+)\..*)")});
  size.buffer_bytes = model->pos_embed_table().numel() * 4;
  // A joint block per token of either stream: about 16 inner-wide tensors (modulated norms,
  // q/k/v, attention output, gates, residuals) and the feed-forward's 4x-wide input, GELU and
  // output (12 inner widths); attention probabilities and scores over the joint sequence.
  const auto d = c.inner_dim();
  size.blocks = c.num_layers;
  size.block_input_bytes_per_token = 4.0 * static_cast<double>(d);
  size.block_activation_bytes_per_token = 4.0 * static_cast<double>(28 * d);
  size.block_attention_bytes_per_token_position =
      4.0 * 2.0 * static_cast<double>(c.num_attention_heads);
  return size;
}

models::QwenImageConfig qwen_image_config(const json& j, const std::string& dir) {
  return dir.empty() ? models::QwenImageConfig::from_json(j.value("config", json::object()))
                     : models::QwenImageConfig::load((fs::path(dir) / "config.json").string());
}

// The Qwen-Image transformer, as SD3's: LoRA on verl-omni's 12 target names by default.
Model build_qwen_image(const json& j, const dist::DeviceMesh& mesh, const fsdp::Options& options,
                       const std::vector<std::string>& default_states) {
  const auto dir = diffusers_transformer_dir(j);
  const auto c = qwen_image_config(j, dir);
  models::QwenImageTransformer2DModel model{nullptr};
  {
    fsdp::EmptyInit empty(/*enabled=*/!dir.empty());
    model = models::QwenImageTransformer2DModel(c);
  }
  const auto plan = diffusers_adapter_plan(j, models::qwen_image_lora_targets(), default_states);
  add_adapters(*model, plan);
  model->set_activation_checkpointing(field<bool>(j, "enable_gradient_checkpointing", false));
  model->set_sequence_parallel(mesh.sequence_parallel_group());
  models::shard_qwen_image(model, mesh, options);
  load_sharded(dir, model.fsdp());
  return finish(model, model.fsdp(), "qwen_image", c.to_json(), plan,
                /*sequence_parallel=*/true);
}

ModelSize qwen_image_size(const json& j, const std::vector<std::string>& default_states) {
  const auto c = qwen_image_config(j, diffusers_transformer_dir(j));
  fsdp::EmptyInit empty;
  models::QwenImageTransformer2DModel model(c);
  const auto plan = diffusers_adapter_plan(j, models::qwen_image_lora_targets(), default_states);
  add_adapters(*model, plan);
  auto size = count_units(*model, {std::regex(R"((transformer_blocks\.\d+)\..*)")});
  // A dual-stream block per token of either stream: about 18 inner-wide tensors (the norms and
  // their modulation, q and k before and after the qk norm and the rotation, v, the attention
  // output, the gated residuals) and the feed-forward's 4x-wide input and GELU (12 inner
  // widths); attention probabilities and scores over the joint sequence. The rotary angles are
  // computed each forward: no buffer.
  const auto d = c.inner_dim();
  size.blocks = c.num_layers;
  size.block_input_bytes_per_token = 4.0 * static_cast<double>(d);
  size.block_activation_bytes_per_token = 4.0 * static_cast<double>(30 * d);
  size.block_attention_bytes_per_token_position =
      4.0 * 2.0 * static_cast<double>(c.num_attention_heads);
  return size;
}

// verl-omni's diffusion model types build the transformer model.path or model.config names:
// SD3's or Qwen-Image's.
ModelBuilder diffusion_builder(std::vector<std::string> default_states) {
  return
      [default_states](const json& j, const dist::DeviceMesh& mesh, const fsdp::Options& options) {
        return is_qwen_image(j) ? build_qwen_image(j, mesh, options, default_states)
                                : build_sd3(j, mesh, options, default_states);
      };
}

ModelSizer diffusion_sizer(std::vector<std::string> default_states) {
  return [default_states](const json& j) {
    return is_qwen_image(j) ? qwen_image_size(j, default_states) : sd3_size(j, default_states);
  };
}

// The loss of a diffusion model type: algos::diffusion_loss with the settings of
// EngineConfig::loss, divided by the micro-batch count so that the accumulated gradient is the
// mean over the rank's rows.
LossFactory diffusion_loss(const std::string& model_type) {
  return [model_type](const json& j) -> LossFn {
    auto loss = j.get<algos::DiffusionLossConfig>();
    if (!j.contains("loss_mode") || j["loss_mode"].is_null()) {
      loss.loss_mode = algos::loss_mode_of(model_type);
    }
    const auto& modes = algos::loss_modes_of(model_type);
    if (std::find(modes.begin(), modes.end(), loss.loss_mode) == modes.end()) {
      throw std::invalid_argument(fmt::format(
          "actor.diffusion_loss.loss_mode: '{}' is not a loss of model_type {}'s engine ({})",
          loss.loss_mode, model_type, json(modes).dump()));
    }
    loss.validate();
    const auto sampler = j.value("sampler", json::object()).get<algos::SamplerConfig>();
    sampler.validate();
    return [loss, sampler](Engine& engine, const MicroBatch& micro_batch) {
      auto out = algos::diffusion_loss(flow_model(engine), micro_batch.data, loss, sampler);
      LossOutput result{out.loss / static_cast<double>(micro_batch.count), {}, {}};
      for (const auto& [name, value] : out.metrics) result.metrics[name] = value.item<double>();
      return result;
    };
  };
}

}  // namespace

models::FlowModel flow_model(Engine& engine) {
  const auto family = engine.export_info().value("family", std::string());
  if (family == "qwen_image") return engine.model<models::QwenImageTransformer2DModel>();
  if (family == "sd3") return engine.model<models::SD3Transformer2DModel>();
  throw std::invalid_argument(fmt::format(
      "model family '{}' is no diffusion transformer (SD3 or Qwen-Image): the diffusion losses "
      "run on model_type diffusion_model, diffusion_nft_model or diffusion_dpo_model",
      family));
}

namespace {

struct Entry {
  ModelBuilder builder;
  LossFactory loss;
  ModelSizer sizer;
};

struct Registry {
  std::mutex mutex;
  std::map<std::string, Entry> builders;

  Registry() {
    builders["language_model/fsdp"] = {build_language_model, nullptr, language_model_size};
    builders["value_model/fsdp"] = {build_value_model, nullptr, value_model_size};
    // verl-omni's PPODiffusersFSDPEngine, DPODiffusersFSDPEngine and NFTDiffusersFSDPEngine.
    builders["diffusion_model/fsdp"] = {diffusion_builder({"default"}),
                                        diffusion_loss("diffusion_model"),
                                        diffusion_sizer({"default"})};
    builders["diffusion_dpo_model/fsdp"] = {diffusion_builder({"default"}),
                                            diffusion_loss("diffusion_dpo_model"),
                                            diffusion_sizer({"default"})};
    // NFT's behaviour policy "old" starts as a copy of the trained adapter and follows it by EMA.
    builders["diffusion_nft_model/fsdp"] = {diffusion_builder({"default", "old"}),
                                            diffusion_loss("diffusion_nft_model"),
                                            diffusion_sizer({"default", "old"})};
  }

  static Registry& get() {
    static Registry registry;
    return registry;
  }
};

}  // namespace

void EngineRegistry::register_model(const std::string& model_type, const std::string& backend,
                                    ModelBuilder builder, LossFactory loss, ModelSizer sizer) {
  auto& registry = Registry::get();
  std::lock_guard lock(registry.mutex);
  registry.builders[model_type + "/" + backend] = {std::move(builder), std::move(loss),
                                                   std::move(sizer)};
}

namespace {
Entry find_entry(const EngineConfig& config) {
  auto& registry = Registry::get();
  Entry entry;
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
    entry = it->second;
  }
  return entry;
}
}  // namespace

std::unique_ptr<Engine> EngineRegistry::create(const EngineConfig& config,
                                               std::shared_ptr<dist::World> world) {
  const Entry entry = find_entry(config);
  // The loss is built first: a bad setting fails before any rank allocates the model.
  LossFn loss = entry.loss ? entry.loss(config.loss) : nullptr;
  return std::make_unique<Engine>(config, std::move(world), entry.builder, std::move(loss));
}

ModelSize EngineRegistry::model_size(const EngineConfig& config) {
  const Entry entry = find_entry(config);
  if (!entry.sizer) {
    throw std::invalid_argument(
        fmt::format("model_type/backend '{}/{}' registers no model size: it has no memory plan",
                    config.model_type, config.backend));
  }
  return entry.sizer(config.model);
}

std::vector<std::string> EngineRegistry::keys() {
  auto& registry = Registry::get();
  std::lock_guard lock(registry.mutex);
  std::vector<std::string> out;
  for (const auto& [key, unused] : registry.builders) out.push_back(key);
  return out;
}

}  // namespace shardrl::engine
