// A wrap policy by block type, after FSDP2's usual recipe (torchtitan's apply_fsdp): every block
// of the model's block type becomes its own unit, then the embeddings and the head, then the root
// takes whatever params are left (norms, small embedders). The head's grads are then reduced
// while the blocks' backward runs, not after it.
//
// In the C++ frontend the unit boundary is a type (fsdp::Unit<Block>), so the model hands over
// the holders; the policy checks that no module of the block type below the root is missing
// from them (a block sharded with the root would keep its params gathered all step).
//
//   models::WrapPolicy policy(fsdp_options, /*activation_checkpointing=*/true);
//   models::shard_by_block(model, model->layers, mesh, policy, model->embed_tokens,
//   model->lm_head);
#pragma once

#include <torch/torch.h>

#include <string>
#include <unordered_set>
#include <vector>

#include "shardrl/fsdp.h"

namespace shardrl::models {

struct WrapPolicy {
  // Implicit from fsdp::Options, so `shard_llama(model, mesh, options)` reads as before.
  WrapPolicy(fsdp::Options options_in = {}, bool activation_checkpointing_in = false)  // NOLINT
      : options(std::move(options_in)), activation_checkpointing(activation_checkpointing_in) {}

  fsdp::Options options;
  // true: every block recomputes its activations in backward (its checkpoint_activations flag);
  // false leaves each block's own setting alone.
  bool activation_checkpointing = false;
};

namespace detail {
// Errors naming the first module of type Block below `root` that `blocks` does not hold.
template <class Block>
void check_blocks_cover_type(torch::nn::Module& root, const std::unordered_set<const void*>& held) {
  for (const auto& item : root.named_modules("", /*include_self=*/false)) {
    if (dynamic_cast<const Block*>(item.value().get()) && !held.count(item.value().get())) {
      throw std::invalid_argument("shard_by_block: module '" + item.key() +
                                  "' has the block type but is not among the blocks given");
    }
  }
}
}  // namespace detail

// Shards the blocks, then each non-empty extra unit in forward order (embeddings, head: an
// fsdp::Unit holder each; an empty holder, e.g. the head of a model with tied embeddings, is
// skipped), then the root. The last extra given (the head) runs last in forward and first in
// backward: it keeps its params from one to the other, as torchtitan's default reshard policy
// does, where resharding would gather them again at once.
template <class Root, class Block, class... Extra>
void shard_by_block(fsdp::Unit<Root>& root, std::vector<fsdp::Unit<Block>>& blocks,
                    const dist::DeviceMesh& mesh, const WrapPolicy& policy, Extra&... extras) {
  std::unordered_set<const void*> held;
  for (auto& block : blocks) held.insert(static_cast<const torch::nn::Module*>(block.get()));
  detail::check_blocks_cover_type<Block>(*root, held);
  for (auto& block : blocks) {
    if (policy.activation_checkpointing) block->checkpoint_activations = true;
    fsdp::fully_shard(block, mesh, policy.options);
  }
  fsdp::Options last_options = policy.options;
  last_options.reshard_after_forward = false;
  [[maybe_unused]] size_t index = 0;
  [[maybe_unused]] const auto shard_extra = [&](auto& unit) {
    const bool last = ++index == sizeof...(extras);
    if (!unit.is_empty()) fsdp::fully_shard(unit, mesh, last ? last_options : policy.options);
  };
  (shard_extra(extras), ...);
  fsdp::fully_shard(root, mesh, policy.options);
}

}  // namespace shardrl::models
