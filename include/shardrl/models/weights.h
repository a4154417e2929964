// Model weights as Hugging Face-style safetensors files: the base params of a module (LoRA adapter
// tensors are left out; they export separately with PEFT names), by their qualified names.
#pragma once

#include <torch/torch.h>

#include <map>
#include <set>
#include <string>
#include <vector>

namespace shardrl::models {

// The module's params by qualified name (tied params appear under each name).
std::map<std::string, torch::Tensor> state_dict(torch::nn::Module& model);

// Writes the base tensors of `params` to one safetensors file, in `dtype`.
void save_weights(const std::map<std::string, torch::Tensor>& params, const std::string& path,
                  torch::ScalarType dtype = torch::kFloat);

// Name -> shape of every tensor of Hugging Face-style weights: a safetensors file, or a directory
// with model.safetensors or the sharded model.safetensors.index.json (checkpoint::HfWeights).
std::map<std::string, std::vector<int64_t>> weight_shapes(const std::string& path);

// What a weights file may hold besides the model's params.
struct LoadWeightsOptions {
  // Tensors the file may hold that the model does not use (transformers' unexpected keys it
  // ignores): skipped.
  std::set<std::string> unused;
  // Tensors the file carries that are no params of the model (a diffusers model's persistent
  // buffers): each is checked and filled like a param.
  std::map<std::string, torch::Tensor> extra;
};

// Copies Hugging Face-style weights (as weight_shapes) into the module's base params. A missing or
// unexpected tensor or a wrong shape is an error naming the file and the tensor. Call before
// sharding.
void load_weights(torch::nn::Module& model, const std::string& path,
                  const LoadWeightsOptions& options = {});

}  // namespace shardrl::models
