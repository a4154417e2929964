#include "shardrl/models/lora.h"

#include "shardrl/checkpoint.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <unordered_set>

namespace shardrl::models::lora {
namespace {

const std::string kA = ".lora_A.", kB = ".lora_B.";
const std::string kPeftPrefix = "base_model.model.";  // PEFT's names of the wrapped model
constexpr size_t kMarkerSize = 7;                     // "lora_A."

// Where "lora_A." or "lora_B." starts as a component of `name`, or npos.
size_t marker_at(const std::string& name) {
  for (const char* marker : {"lora_A.", "lora_B."}) {
    for (size_t at = name.find(marker); at != std::string::npos; at = name.find(marker, at + 1)) {
      if (at == 0 || name[at - 1] == '.') return at;
    }
  }
  return std::string::npos;
}

// "x.lora_A.<adapter>.weight" -> the adapter, or "" when `name` is no adapter tensor.
std::string adapter_of(const std::string& name) {
  const size_t at = marker_at(name);
  if (at == std::string::npos) return "";
  const size_t begin = at + kMarkerSize, end = name.find('.', begin);
  return end == std::string::npos ? "" : name.substr(begin, end - begin);
}

// For every adapter tensor of `dst`, the tensor of `src` at the same place.
std::vector<std::pair<torch::Tensor, torch::Tensor>> pair_adapters(const NamedTensors& tensors,
                                                                   const std::string& dst,
                                                                   const std::string& src) {
  TORCH_CHECK(dst != src, "adapter '", dst, "' paired with itself");
  std::map<std::string, torch::Tensor> by_name(tensors.begin(), tensors.end());
  std::vector<std::pair<torch::Tensor, torch::Tensor>> pairs;
  for (const auto& [name, tensor] : tensors) {
    if (adapter_of(name) != dst) continue;
    std::string other = name;
    other.replace(marker_at(other) + kMarkerSize, dst.size(), src);
    auto it = by_name.find(other);
    TORCH_CHECK(it != by_name.end(), "adapter tensor ", name, " has no counterpart ", other);
    TORCH_CHECK(it->second.sizes() == tensor.sizes(), "adapter tensor ", other, " has shape ",
                it->second.sizes(), " but ", name, " has ", tensor.sizes());
    pairs.emplace_back(tensor, it->second);
  }
  TORCH_CHECK(!pairs.empty(), "no tensors of adapter '", dst, "' found");
  return pairs;
}

}  // namespace

bool is_adapter_tensor(const std::string& name) {
  return marker_at(name) != std::string::npos;
}

bool is_lora_b_tensor(const std::string& name) {
  const size_t at = marker_at(name);
  return at != std::string::npos && name.compare(at, kMarkerSize, "lora_B.") == 0;
}

torch::Tensor LoraLinearImpl::forward(const torch::Tensor& input) {
  torch::Tensor out = LinearImpl::forward(input);
  if (active_.empty() || disabled_ || merged_ == active_) {
    TORCH_CHECK(!(disabled_ && !merged_.empty()), "LoraLinear: adapter '", merged_,
                "' is merged into the base weight; unmerge it before disabling adapters");
    return out;
  }
  TORCH_CHECK(merged_.empty(), "LoraLinear: adapter '", merged_, "' is merged but adapter '",
              active_, "' is active; unmerge first");
  const Adapter& ad = adapter(active_);
  torch::Tensor x = input.to(ad.a.scalar_type());
  if (ad.config.dropout > 0) x = torch::dropout(x, ad.config.dropout, is_training());
  const torch::Tensor xa = linear_rows(x, ad.a);
  if (out.scalar_type() == ad.b.scalar_type()) {
    // out + scaling * (x A^T) B^T as one GEMM that accumulates into a copy of out: in a decode
    // step, where every GEMM is a few rows, three element-wise passes cost as much as the GEMM.
    // Without grad (a rollout) it accumulates into out itself, which nothing else holds.
    const auto rows = out.numel() / out.size(-1);
    const auto xa_2d = xa.reshape({rows, ad.config.r});
    if (!torch::GradMode::is_enabled() && out.is_contiguous()) {
      out.view({rows, out.size(-1)}).addmm_(xa_2d, ad.b.t(), /*beta=*/1, ad.config.scaling());
      return out;
    }
    return torch::addmm(out.reshape({rows, out.size(-1)}), xa_2d, ad.b.t(), /*beta=*/1,
                        /*alpha=*/ad.config.scaling())
        .view(out.sizes());
  }
  torch::Tensor delta = torch::nn::functional::linear(xa, ad.b);
  return out + (delta * ad.config.scaling()).to(out.scalar_type());
}

void LoraLinearImpl::add_adapter(const std::string& name, const LoraConfig& config,
                                 bool trainable) {
  TORCH_CHECK(!name.empty() && name.find('.') == std::string::npos, "LoRA adapter name '", name,
              "' must be non-empty and contain no '.'");
  TORCH_CHECK(!has_adapter(name), "LoRA adapter '", name, "' already exists");
  TORCH_CHECK(config.r > 0, "LoraConfig.r must be positive, got ", config.r);
  TORCH_CHECK(config.dropout >= 0 && config.dropout < 1, "LoraConfig.dropout must be in [0, 1)");
  if (!a_holder_) {
    a_holder_ = register_module("lora_A", std::make_shared<torch::nn::Module>()).get();
    b_holder_ = register_module("lora_B", std::make_shared<torch::nn::Module>()).get();
  }
  const int64_t in = options.in_features(), out = options.out_features();
  auto opts = torch::TensorOptions().dtype(torch::kFloat).device(weight.device());
  Adapter ad;
  ad.config = config;
  {
    torch::NoGradGuard no_grad;
    ad.a = torch::empty({config.r, in}, opts);
    torch::nn::init::kaiming_uniform_(ad.a, std::sqrt(5.0));
    ad.b = torch::zeros({out, config.r}, opts);
  }
  auto holder_a = a_holder_->register_module(name, std::make_shared<torch::nn::Module>());
  auto holder_b = b_holder_->register_module(name, std::make_shared<torch::nn::Module>());
  ad.a = holder_a->register_parameter("weight", ad.a, trainable);
  ad.b = holder_b->register_parameter("weight", ad.b, trainable);
  adapters_.emplace(name, std::move(ad));
  weight.set_requires_grad(false);
  if (bias.defined()) bias.set_requires_grad(false);
  if (active_.empty()) active_ = name;
}

std::vector<std::string> LoraLinearImpl::adapter_names() const {
  std::vector<std::string> names;
  for (const auto& item : adapters_) names.push_back(item.first);
  return names;
}

void LoraLinearImpl::set_active_adapter(const std::string& name) {
  adapter(name);  // checks it exists
  active_ = name;
}

const LoraConfig& LoraLinearImpl::adapter_config(const std::string& name) const {
  return adapter(name).config;
}

const LoraLinearImpl::Adapter& LoraLinearImpl::adapter(const std::string& name) const {
  auto it = adapters_.find(name);
  TORCH_CHECK(it != adapters_.end(), "LoraLinear has no adapter '", name, "'");
  return it->second;
}

void LoraLinearImpl::merge(const std::string& name) {
  TORCH_CHECK(merged_.empty(), "LoraLinear: adapter '", merged_, "' is already merged");
  TORCH_CHECK(!packed_for_inference(),
              "LoraLinear: the base weight is packed for inference; merge before packing");
  const Adapter& ad = adapter(name);
  torch::NoGradGuard no_grad;
  weight.add_(delta_weight(ad.a, ad.b, ad.config.scaling()).to(weight.scalar_type()));
  merged_ = name;
}

void LoraLinearImpl::unmerge() {
  if (merged_.empty()) return;
  TORCH_CHECK(!packed_for_inference(),
              "LoraLinear: the base weight is packed for inference; unpack before unmerging");
  const Adapter& ad = adapter(merged_);
  torch::NoGradGuard no_grad;
  weight.sub_(delta_weight(ad.a, ad.b, ad.config.scaling()).to(weight.scalar_type()));
  merged_.clear();
}

torch::Tensor delta_weight(const torch::Tensor& a, const torch::Tensor& b, double scaling) {
  return torch::matmul(b, a) * scaling;
}

std::vector<std::pair<std::string, LoraLinearImpl*>> lora_linears(torch::nn::Module& model) {
  std::vector<std::pair<std::string, LoraLinearImpl*>> out;
  for (const auto& item : model.named_modules()) {
    if (auto* layer = dynamic_cast<LoraLinearImpl*>(item.value().get()))
      out.emplace_back(item.key(), layer);
  }
  return out;
}

std::vector<std::string> apply_lora(torch::nn::Module& model, const LoraConfig& config,
                                    const std::string& name, bool trainable) {
  std::vector<std::string> targeted;
  for (auto& [module_name, layer] : lora_linears(model)) {
    if (!is_target(config, module_name)) continue;
    layer->add_adapter(name, config, trainable);
    targeted.push_back(module_name);
  }
  if (targeted.empty()) {
    TORCH_CHECK(false, "LoraConfig.target_modules: no LoraLinear matches [",
                config.describe_targets(), "]");
  }
  // Only adapters train, as PEFT does; frozen adapters (an EMA target) stay frozen.
  for (auto& item : model.named_parameters()) {
    const bool adapter = is_adapter_tensor(item.key());
    if (!adapter) item.value().set_requires_grad(false);
  }
  return targeted;
}

void set_active_adapter(torch::nn::Module& model, const std::string& name) {
  bool found = false;
  for (auto& [module_name, layer] : lora_linears(model)) {
    if (!layer->has_adapter(name)) continue;
    layer->set_active_adapter(name);
    found = true;
  }
  TORCH_CHECK(found, "set_active_adapter: no LoraLinear has adapter '", name, "'");
}

UseAdapter::UseAdapter(torch::nn::Module& model, const std::string& name) {
  for (auto& [module_name, layer] : lora_linears(model)) {
    saved_.push_back({layer, layer->active_adapter(), layer->adapters_disabled()});
  }
  set_active_adapter(model, name);  // changes nothing when it throws
  for (auto& s : saved_) s.layer->set_adapters_disabled(false);
}

UseAdapter::~UseAdapter() {
  for (auto& s : saved_) {
    if (!s.active.empty()) s.layer->set_active_adapter(s.active);
    s.layer->set_adapters_disabled(s.disabled);
  }
  saved_.clear();
}

DisableAdapters::DisableAdapters(torch::nn::Module& model) {
  for (auto& [module_name, layer] : lora_linears(model)) {
    saved_.push_back({layer, layer->active_adapter(), layer->adapters_disabled()});
    layer->set_adapters_disabled(true);
  }
}

DisableAdapters::~DisableAdapters() {
  for (auto& s : saved_) s.layer->set_adapters_disabled(s.disabled);
}

NamedTensors named_tensors(torch::nn::Module& model) {
  NamedTensors out;
  for (auto& item : model.named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

NamedTensors named_tensors(const std::vector<fsdp::ShardedParameter>& shards) {
  NamedTensors out;
  for (const auto& p : shards) out.emplace_back(p.name, p.shard);
  return out;
}

void copy_adapter(const NamedTensors& tensors, const std::string& dst, const std::string& src) {
  torch::NoGradGuard no_grad;
  for (auto& [d, s] : pair_adapters(tensors, dst, src)) d.copy_(s);
}

void ema_update(const NamedTensors& tensors, const std::string& dst, const std::string& src,
                double decay) {
  TORCH_CHECK(decay >= 0 && decay <= 1, "ema_update: decay must be in [0, 1], got ", decay);
  torch::NoGradGuard no_grad;
  for (auto& [d, s] : pair_adapters(tensors, dst, src)) d.mul_(decay).add_(s, 1.0 - decay);
}

std::map<std::string, torch::Tensor> merged_state_dict(
    const std::map<std::string, torch::Tensor>& params, const std::string& name,
    const LoraConfig& config) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [key, tensor] : params) {
    if (!is_adapter_tensor(key)) out[key] = tensor.detach().clone();
  }
  const std::string suffix = kA + name + ".weight";
  for (const auto& [key, a] : params) {
    if (key.size() <= suffix.size() ||
        key.compare(key.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    const std::string module = key.substr(0, key.size() - suffix.size());
    auto b = params.find(module + kB + name + ".weight");
    auto w = out.find(module + ".weight");
    TORCH_CHECK(b != params.end(), "merged_state_dict: ", key, " has no lora_B counterpart");
    TORCH_CHECK(w != out.end(), "merged_state_dict: ", key, " has no base weight ", module,
                ".weight");
    torch::NoGradGuard no_grad;
    w->second.add_(delta_weight(a, b->second, config.scaling()).to(w->second.scalar_type()));
  }
  return out;
}

std::optional<std::string> peft_name(const std::string& param, const std::string& name) {
  if (adapter_of(param) != name) return std::nullopt;
  // PEFT saves without the adapter name: "...q_proj.lora_A.weight".
  std::string peft = param;
  peft.erase(marker_at(peft) + kMarkerSize, name.size() + 1);
  return kPeftPrefix + peft;
}

std::map<std::string, torch::Tensor> peft_state_dict(
    const std::map<std::string, torch::Tensor>& params, const std::string& name) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [key, tensor] : params) {
    if (auto peft = peft_name(key, name)) out[*peft] = tensor.detach().clone();
  }
  TORCH_CHECK(!out.empty(), "peft_state_dict: no tensors of adapter '", name, "'");
  return out;
}

namespace {

// One adapter tensor as exported: its name in the model and in PEFT's file.
struct PeftTensor {
  std::string param;
  checkpoint::TensorInfo info;
};

// Writes adapter_model.safetensors from `tensors` (their data supplied in order by `write_all`,
// one full tensor at a time) and adapter_config.json; returns both paths.
//
// PEFT reads the config from adapter_config.json. diffusers' load_lora_adapter reads it from the
// header's lora_adapter_metadata instead, and keeps only the tensors and metadata keys under its
// `prefix`: so the keys carry PEFT's "base_model.model." and
// load_lora_adapter(dir, weight_name="adapter_model.safetensors", prefix="base_model.model") reads
// the same file as PEFT. (No one file serves both otherwise: PEFT does not load
// "transformer."-named tensors, and diffusers' default prefix "transformer" drops PEFT's names.)
std::vector<std::string> write_peft_files(
    const std::string& out_dir, const std::vector<PeftTensor>& tensors, const std::string& config,
    const std::function<void(checkpoint::SafetensorsWriter&)>& write_all) {
  std::filesystem::create_directories(out_dir);
  std::vector<checkpoint::TensorInfo> infos;
  for (const auto& t : tensors) infos.push_back(t.info);
  const nlohmann::json fields = nlohmann::json::parse(config);
  nlohmann::json metadata = nlohmann::json::object();
  for (const auto& [key, value] : fields.items()) metadata[kPeftPrefix + key] = value;
  const std::string weights = (std::filesystem::path(out_dir) / kPeftWeightsFile).string();
  checkpoint::SafetensorsWriter writer(
      weights, infos, {{"format", "pt"}, {"lora_adapter_metadata", metadata.dump()}});
  write_all(writer);
  writer.close();
  const std::string config_path = (std::filesystem::path(out_dir) / kPeftConfigFile).string();
  std::ofstream out(config_path);
  out << config << "\n";
  if (!out.flush()) throw std::runtime_error(fmt::format("cannot write {}", config_path));
  return {weights, config_path};
}

template <class Named>
std::vector<PeftTensor> plan_peft(const Named& named, const std::string& name,
                                  torch::ScalarType dtype, const std::string& what) {
  std::vector<PeftTensor> out;
  for (const auto& [param, shape] : named) {
    if (auto peft = peft_name(param, name)) out.push_back({param, {*peft, dtype, shape}});
  }
  if (out.empty()) {
    throw std::invalid_argument(fmt::format("{} has no tensors of adapter '{}'", what, name));
  }
  return out;
}

// Adapter `name`'s PEFT config as the checkpoint's extra JSON holds it, validated.
const nlohmann::json& checkpoint_adapter_config(const nlohmann::json& index,
                                                const std::string& ckpt_dir,
                                                const std::string& name) {
  // A reference into the index, not into a defaulted copy: the caller keeps the returned config.
  static const nlohmann::json kNoExtra = nlohmann::json::object();
  const nlohmann::json& extra = index.contains("extra") ? index["extra"] : kNoExtra;
  if (!extra.is_object() || !extra.contains("lora") || !extra["lora"].is_object() ||
      !extra["lora"].contains(name)) {
    std::string known;
    if (extra.contains("lora") && extra["lora"].is_object()) {
      for (const auto& [adapter, unused] : extra["lora"].items())
        known += (known.empty() ? "" : ", ") + adapter;
    }
    throw std::invalid_argument(fmt::format(
        "checkpoint {}: its extra JSON has no lora.{} (the adapter's PEFT config; adapters saved: "
        "{})",
        ckpt_dir, name, known.empty() ? "none" : known));
  }
  config_from_peft(extra["lora"][name],
                   fmt::format("checkpoint {}: extra.lora.{}", ckpt_dir, name));
  return extra["lora"][name];
}

}  // namespace

void load_peft_adapter(torch::nn::Module& model, const std::string& dir, const std::string& name) {
  namespace fs = std::filesystem;
  const std::string config_path = (fs::path(dir) / kPeftConfigFile).string();
  const LoraConfig config = read_peft_config(config_path);
  apply_lora(model, config, name);
  set_active_adapter(model, name);

  const std::string weights_path = (fs::path(dir) / kPeftWeightsFile).string();
  checkpoint::SafetensorsReader reader(weights_path);
  std::map<std::string, torch::Tensor> wanted;  // PEFT name -> param
  for (auto& [param, tensor] : named_tensors(model)) {
    if (auto peft_key = peft_name(param, name)) wanted.emplace(*peft_key, tensor);
  }
  for (const auto& key : reader.names()) {
    if (!wanted.count(key)) {
      throw std::invalid_argument(
          fmt::format("{}: tensor {} is no adapter tensor of this model (targets: {})",
                      weights_path, key, config.describe_targets()));
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& [key, param] : wanted) {
    if (!reader.contains(key)) {
      throw std::invalid_argument(fmt::format("{}: missing tensor {}", weights_path, key));
    }
    const torch::Tensor value = reader.read(key);
    if (value.sizes() != param.sizes()) {
      throw std::invalid_argument(fmt::format("{}: tensor {} has shape {}, the model expects {}",
                                              weights_path, key, c10::str(value.sizes()),
                                              c10::str(param.sizes())));
    }
    param.copy_(value);
  }
}

std::vector<std::string> export_peft_adapter(const std::string& ckpt_dir,
                                             const std::string& out_dir, const std::string& name,
                                             torch::ScalarType dtype) {
  const nlohmann::json index = checkpoint::read_index(ckpt_dir);
  // Validated before anything is written.
  const nlohmann::json& config = checkpoint_adapter_config(index, ckpt_dir, name);
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& [param, entry] : index.at("model").items())
    shapes.emplace_back(param, entry.at("shape").get<std::vector<int64_t>>());
  const auto tensors = plan_peft(shapes, name, dtype, "checkpoint " + ckpt_dir);
  std::vector<std::string> params;
  for (const auto& t : tensors) params.push_back(t.param);
  return write_peft_files(out_dir, tensors, config.dump(2), [&](auto& writer) {
    size_t next = 0;
    checkpoint::for_each_full_tensor(ckpt_dir, params,
                                     [&](const std::string&, const torch::Tensor& full) {
                                       writer.write(tensors[next++].info.name, full.to(dtype));
                                     });
  });
}

std::vector<std::string> export_base(const std::string& ckpt_dir, const std::string& out_dir,
                                     const std::string& merge_adapter,
                                     checkpoint::ExportOptions options) {
  options.select = [](const std::string& param) { return !is_adapter_tensor(param); };
  if (merge_adapter.empty()) return checkpoint::export_hf(ckpt_dir, out_dir, options);

  const nlohmann::json index = checkpoint::read_index(ckpt_dir);
  const double scaling =
      config_from_peft(checkpoint_adapter_config(index, ckpt_dir, merge_adapter), "").scaling();
  // The adapter's tensors are small (rank r): all are read first, then each base weight is merged
  // as it streams past, so the peak stays one full tensor plus the adapter.
  std::vector<std::string> adapter_params;
  for (const auto& [param, unused] : index.at("model").items()) {
    if (adapter_of(param) == merge_adapter) adapter_params.push_back(param);
  }
  struct Factors {
    torch::Tensor a, b;
  };
  std::map<std::string, Factors> by_base;  // base weight name -> its adapter's A and B
  checkpoint::for_each_full_tensor(
      ckpt_dir, adapter_params, [&](const std::string& param, const torch::Tensor& full) {
        const size_t at = marker_at(param);
        Factors& f = by_base[param.substr(0, at) + "weight"];
        (param.compare(at, kMarkerSize, "lora_A.") == 0 ? f.a : f.b) = full.to(torch::kFloat);
      });
  for (const auto& [base, f] : by_base) {
    if (!f.a.defined() || !f.b.defined() || !index.at("model").contains(base)) {
      throw std::invalid_argument(
          fmt::format("checkpoint {}: adapter '{}' of {} lacks lora_A, lora_B or the base weight",
                      ckpt_dir, merge_adapter, base));
    }
  }
  options.transform = [&](const std::string& param, const torch::Tensor& full) {
    auto it = by_base.find(param);
    if (it == by_base.end()) return full;
    return (full.to(torch::kFloat) + delta_weight(it->second.a, it->second.b, scaling))
        .to(full.scalar_type());
  };
  return checkpoint::export_hf(ckpt_dir, out_dir, options);
}

void export_peft_adapter(const fsdp::FSDPModule& model, const LoraConfig& config,
                         const std::string& name, const std::string& out_dir,
                         torch::ScalarType dtype, const std::string& base_model) {
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& p : model.sharded_parameters()) shapes.emplace_back(p.name, p.global_shape);
  const auto tensors = plan_peft(shapes, name, dtype, "the model");
  std::map<std::string, std::string> peft_of;
  for (const auto& t : tensors) peft_of[t.param] = t.info.name;
  auto is_mine = [&](const std::string& param) { return peft_of.count(param) > 0; };
  // Only rank 0 writes; every rank takes part in each gather, one adapter tensor at a time.
  const bool writes = model.mesh().rank() == 0;
  auto gather = [&](checkpoint::SafetensorsWriter* writer) {
    checkpoint::for_each_full_parameter(
        model, dtype, "",
        [&](const std::string& param, const torch::Tensor& full) {
          if (writer) writer->write(peft_of.at(param), full);
        },
        is_mine);
  };
  if (!writes) {
    gather(nullptr);
    return;
  }
  write_peft_files(out_dir, tensors, peft_adapter_config(config, base_model),
                   [&](auto& writer) { gather(&writer); });
}

}  // namespace shardrl::models::lora
