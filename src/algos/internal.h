// Helpers shared by the algorithm translation units; not part of the public API.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace shardrl::algos::internal {

// Every config error names its field, so a bad YAML key is found without a debugger.
[[noreturn]] inline void throw_unknown_value(const std::string& field, const std::string& value,
                                             std::initializer_list<const char*> choices) {
  std::string msg = field + ": unknown value \"" + value + "\" (expected one of:";
  for (const char* c : choices) msg += std::string(" ") + c;
  throw std::invalid_argument(msg + ")");
}

inline void require(bool ok, const std::string& field, const std::string& what) {
  if (!ok) throw std::invalid_argument(field + ": " + what);
}

// Members of each group, groups in order of first appearance: results never depend on hash order.
template <typename Key>
std::vector<std::vector<int64_t>> group_members(const std::vector<Key>& uids) {
  std::unordered_map<Key, size_t> slot;
  std::vector<std::vector<int64_t>> groups;
  for (size_t i = 0; i < uids.size(); ++i) {
    auto [it, inserted] = slot.emplace(uids[i], groups.size());
    if (inserted) groups.emplace_back();
    groups[it->second].push_back(static_cast<int64_t>(i));
  }
  return groups;
}

// Host copy of a 1-D tensor; advantages and pairing are O(B) bookkeeping best done on the CPU.
inline std::vector<double> to_host_vector(const torch::Tensor& t, const std::string& field) {
  require(t.defined() && t.dim() == 1, field, "must be a 1-D tensor");
  auto c = t.detach().to(torch::kCPU, torch::kDouble).contiguous();
  return std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
}

// Mean over all non-batch dims: [B, ...] -> [B]. A [B] input is already per sample (a plain
// mean() over an empty dim list would reduce the batch too).
inline torch::Tensor mean_non_batch(const torch::Tensor& x) {
  return x.dim() <= 1 ? x : x.flatten(1).mean(1);
}

// Per-sample [B] (or 0-dim) value viewed as [B, 1, ..., 1] to broadcast against an ndim tensor.
inline torch::Tensor per_sample_view(const torch::Tensor& v, int64_t ndim) {
  if (v.dim() == 0) return v;
  std::vector<int64_t> shape(static_cast<size_t>(ndim), 1);
  shape[0] = v.numel();
  return v.reshape(shape);
}

// Per-sample [B] values from something shaped [B, 1, ...], [B] or 0-dim (as std_dev_t comes).
inline torch::Tensor flat_per_sample(const torch::Tensor& v) {
  return v.dim() == 0 ? v : v.reshape({-1});
}

inline torch::Tensor f32(const torch::Tensor& t) {
  return t.to(torch::kFloat);
}

// Noise levels [b] of a flow-matching training batch: "logit_normal" (SD3's sigmoid(N(0, 1)))
// or "uniform".
inline torch::Tensor flow_matching_sigmas(const std::string& timestep_sampling, int64_t b,
                                          at::Generator generator,
                                          const torch::TensorOptions& options) {
  if (timestep_sampling == "logit_normal")
    return torch::sigmoid(at::randn({b}, generator, options));
  if (timestep_sampling == "uniform") return at::rand({b}, generator, options);
  throw_unknown_value("timestep_sampling", timestep_sampling, {"logit_normal", "uniform"});
}

inline c10::optional<at::Generator> to_c10(const std::optional<at::Generator>& g) {
  return g ? c10::optional<at::Generator>(*g) : c10::nullopt;
}

}  // namespace shardrl::algos::internal
