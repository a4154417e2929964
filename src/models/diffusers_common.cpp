#include "models/diffusers_common.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <vector>

#include "shardrl/models/weights.h"

namespace shardrl::models::detail {

std::string diffusers_weights_file() {
  return std::string(kDiffusersWeightsStem) + ".safetensors";
}

std::shared_ptr<torch::nn::Module> holder(torch::nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<torch::nn::Module>());
}

torch::Tensor plain_norm(const torch::Tensor& x, double eps) {
  return torch::layer_norm(x, {x.size(-1)}, {}, {}, eps);
}

torch::Tensor modulate(const torch::Tensor& normed, const torch::Tensor& shift,
                       const torch::Tensor& scale) {
  return normed * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

torch::Tensor FeedForward::operator()(const torch::Tensor& x) {
  return out->forward(torch::gelu(proj->forward(x), "tanh"));
}

FeedForward feed_forward(torch::nn::Module& block, const std::string& name, int64_t dim) {
  auto net = holder(*holder(block, name), "net");
  FeedForward ff;
  ff.proj = holder(*net, "0")->register_module("proj", lora::LoraLinear(dim, 4 * dim));
  ff.out = net->register_module("2", lora::LoraLinear(4 * dim, dim));
  return ff;
}

torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim, double scale) {
  const int64_t half = dim / 2;
  // Operation for operation diffusers' arithmetic, so the embedding matches to the bit.
  auto exponent =
      -std::log(10000.0) * torch::arange(half, torch::dtype(torch::kFloat).device(t.device()));
  exponent = exponent / static_cast<double>(half);
  auto args =
      t.to(torch::kFloat).unsqueeze(1) * torch::exp(exponent).to(t.scalar_type()).unsqueeze(0);
  if (scale != 1.0) args = args * scale;
  return torch::cat({torch::cos(args), torch::sin(args)}, -1);
}

void save_diffusers_folder(const std::map<std::string, torch::Tensor>& tensors,
                           const nlohmann::json& config, const std::string& dir,
                           torch::ScalarType dtype) {
  std::filesystem::create_directories(dir);
  save_weights(tensors, dir + "/" + diffusers_weights_file(), dtype);
  std::ofstream out(dir + "/config.json");
  if (!out) throw std::runtime_error("cannot write " + dir + "/config.json");
  out << config.dump(2) << "\n";
}

void set_diffusers_export_layout(checkpoint::ExportOptions& options) {
  options.layout.weights_stem = kDiffusersWeightsStem;
  options.layout.single_file_unindexed = true;
  options.layout.config_torch_dtype = false;
}

void save_diffusers_lora(const std::map<std::string, torch::Tensor>& params,
                         const lora::LoraConfig& config, const std::string& name,
                         const std::string& dir, const std::string& caller) {
  // diffusers' LoRA layout: the module path under the pipeline's "transformer", the adapter name
  // dropped, and the config in the header with the same prefix on every key.
  const std::string peft_prefix = "base_model.model.";
  std::vector<checkpoint::TensorInfo> infos;
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& [param, tensor] : params) {
    auto peft = lora::peft_name(param, name);
    if (!peft) continue;
    const std::string key = "transformer." + peft->substr(peft_prefix.size());
    infos.push_back({key, torch::kFloat, tensor.sizes().vec()});
    tensors[key] = tensor;
  }
  if (infos.empty()) {
    throw std::invalid_argument(fmt::format("{}: no tensors of adapter '{}'", caller, name));
  }
  const auto peft_config = nlohmann::json::parse(lora::peft_adapter_config(config));
  nlohmann::json metadata = nlohmann::json::object();
  for (const auto& [key, value] : peft_config.items()) metadata["transformer." + key] = value;
  std::filesystem::create_directories(dir);
  checkpoint::SafetensorsWriter writer(
      dir + "/" + lora::kPeftWeightsFile, infos,
      {{"format", "pt"}, {"lora_adapter_metadata", metadata.dump()}});
  for (const auto& info : infos) {
    writer.write(info.name, tensors.at(info.name).detach().to(torch::kFloat).contiguous());
  }
  writer.close();
  std::ofstream out(dir + "/" + lora::kPeftConfigFile);
  if (!out) throw std::runtime_error("cannot write " + dir + "/" + lora::kPeftConfigFile);
  out << peft_config.dump(2) << "\n";
}

}  // namespace shardrl::models::detail
