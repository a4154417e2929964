#include "shardrl/models/kv_cache.h"

namespace shardrl::models {

std::pair<torch::Tensor, torch::Tensor> KVCache::append(size_t layer, const torch::Tensor& k,
                                                        const torch::Tensor& v) {
  if (keys.size() <= layer) {
    keys.resize(layer + 1);
    values.resize(layer + 1);
  }
  auto& ck = keys[layer];
  auto& cv = values[layer];
  const int64_t past = ck.defined() ? ck.size(2) : 0, total = past + k.size(2);
  if (capacity == 0) {
    ck = past > 0 ? torch::cat({ck, k.detach()}, 2) : k.detach();
    cv = past > 0 ? torch::cat({cv, v.detach()}, 2) : v.detach();
    return {ck, cv};
  }
  TORCH_CHECK(total <= capacity, "KVCache: ", total, " positions exceed its capacity ", capacity);
  if (key_buffers.size() <= layer) {
    key_buffers.resize(layer + 1);
    value_buffers.resize(layer + 1);
  }
  auto& kb = key_buffers[layer];
  auto& vb = value_buffers[layer];
  if (!kb.defined()) {
    kb = torch::empty({k.size(0), k.size(1), capacity, k.size(3)}, k.options());
    vb = torch::empty({v.size(0), v.size(1), capacity, v.size(3)}, v.options());
  }
  kb.narrow(2, past, k.size(2)).copy_(k.detach());
  vb.narrow(2, past, v.size(2)).copy_(v.detach());
  ck = kb.narrow(2, 0, total);
  cv = vb.narrow(2, 0, total);
  return {ck, cv};
}

void KVCache::batch_select_indices(const torch::Tensor& indices) {
  for (auto* buffers : {&key_buffers, &value_buffers}) {
    for (auto& t : *buffers) t = t.index_select(0, indices);
  }
  for (size_t layer = 0; layer < keys.size(); ++layer) {
    const int64_t length = keys[layer].size(2);
    keys[layer] = capacity > 0 ? key_buffers[layer].narrow(2, 0, length)
                               : keys[layer].index_select(0, indices);
    values[layer] = capacity > 0 ? value_buffers[layer].narrow(2, 0, length)
                                 : values[layer].index_select(0, indices);
  }
}

}  // namespace shardrl::models
