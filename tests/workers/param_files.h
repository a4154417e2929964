// How a multi-rank worker hands the gathered parameters to its test: names.txt (one name a line)
// beside params.pt (the tensors in the same order, as torch::save writes a tensor list).
#pragma once

#include <torch/torch.h>

#include <fstream>
#include <map>
#include <string>
#include <vector>

namespace shardrl::testing {

inline void write_params(const std::map<std::string, torch::Tensor>& params,
                         const std::string& dir) {
  std::vector<torch::Tensor> tensors;
  std::ofstream names(dir + "/names.txt");
  for (const auto& [name, tensor] : params) {
    names << name << "\n";
    tensors.push_back(tensor.cpu());  // the test compares on the CPU, whatever trained
  }
  torch::save(tensors, dir + "/params.pt");
}

inline std::map<std::string, torch::Tensor> read_params(const std::string& dir) {
  std::vector<torch::Tensor> tensors;
  torch::load(tensors, dir + "/params.pt");
  std::ifstream names(dir + "/names.txt");
  std::map<std::string, torch::Tensor> params;
  std::string name;
  for (size_t i = 0; std::getline(names, name); ++i) params[name] = tensors.at(i);
  return params;
}

}  // namespace shardrl::testing
