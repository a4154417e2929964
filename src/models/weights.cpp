#include "shardrl/models/weights.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "shardrl/checkpoint.h"
#include "shardrl/models/lora.h"

namespace shardrl::models {
namespace {

std::string shape_str(c10::IntArrayRef shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

std::map<std::string, torch::Tensor> base_params(torch::nn::Module& model) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, param] : state_dict(model)) {
    if (!lora::is_adapter_tensor(name)) out.emplace(name, param);
  }
  return out;
}

}  // namespace

std::map<std::string, torch::Tensor> state_dict(torch::nn::Module& model) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& item : model.named_parameters()) out.emplace(item.key(), item.value());
  return out;
}

void save_weights(const std::map<std::string, torch::Tensor>& params, const std::string& path,
                  torch::ScalarType dtype) {
  std::vector<checkpoint::TensorInfo> infos;
  for (const auto& [name, tensor] : params) {
    if (lora::is_adapter_tensor(name)) continue;
    checkpoint::TensorInfo info;
    info.name = name;
    info.dtype = dtype;
    info.shape = tensor.sizes().vec();
    infos.push_back(std::move(info));
  }
  checkpoint::SafetensorsWriter writer(path, infos, {{"format", "pt"}});
  for (const auto& info : infos) {
    writer.write(info.name, params.at(info.name).detach().to(dtype).contiguous());
  }
  writer.close();
}

std::map<std::string, std::vector<int64_t>> weight_shapes(const std::string& path) {
  checkpoint::HfWeights weights(path);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& name : weights.names()) shapes[name] = weights.reader(name).info(name).shape;
  return shapes;
}

void load_weights(torch::nn::Module& model, const std::string& path,
                  const LoadWeightsOptions& options) {
  checkpoint::HfWeights weights(path);
  auto expected = base_params(model);
  expected.insert(options.extra.begin(), options.extra.end());
  for (const auto& name : weights.names()) {
    if (!expected.count(name) && !options.unused.count(name)) {
      throw std::invalid_argument(fmt::format("{}: unexpected tensor {}", path, name));
    }
  }
  for (const auto& [name, param] : expected) {
    if (!weights.contains(name)) {
      throw std::invalid_argument(fmt::format("{}: missing tensor {}", path, name));
    }
    const auto& shape = weights.reader(name).info(name).shape;
    if (c10::IntArrayRef(shape) != param.sizes()) {
      throw std::invalid_argument(fmt::format("{}: tensor {} has shape {}, the model expects {}",
                                              path, name, shape_str(shape),
                                              shape_str(param.sizes())));
    }
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, param] : expected) param.copy_(weights.reader(name).read(name));
}

}  // namespace shardrl::models
