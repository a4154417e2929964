// The seeded distributed sampler: the permutation depends only on (seed, epoch), so every rank
// computes the same one without communicating.
#include <fmt/format.h>

#include <stdexcept>

#include "shardrl/data.h"

namespace shardrl::data {

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t global_batch, int64_t rank,
                                       int64_t world_size, uint64_t seed)
    : dataset_size_(dataset_size),
      global_batch_(global_batch),
      rank_(rank),
      world_size_(world_size),
      batches_per_epoch_(0),
      seed_(seed) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument(
        fmt::format("DistributedSampler: rank {} is not in a world of size {}", rank, world_size));
  }
  if (global_batch < 1 || global_batch % world_size != 0) {
    throw std::invalid_argument(fmt::format(
        "DistributedSampler: global_batch {} must be a positive multiple of the world size {}",
        global_batch, world_size));
  }
  if (dataset_size < global_batch) {
    throw std::invalid_argument(
        fmt::format("DistributedSampler: dataset_size {} is smaller than global_batch {}",
                    dataset_size, global_batch));
  }
  batches_per_epoch_ = dataset_size / global_batch;
}

torch::Tensor DistributedSampler::global_indices(int64_t step) {
  TORCH_CHECK(step >= 0, "DistributedSampler: step must be >= 0, got ", step);
  const int64_t epoch = step / batches_per_epoch_;
  if (epoch != cached_epoch_) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ + static_cast<uint64_t>(epoch));
    permutation_ = torch::randperm(dataset_size_, gen, torch::kLong);
    cached_epoch_ = epoch;
  }
  return permutation_.narrow(0, (step % batches_per_epoch_) * global_batch_, global_batch_);
}

torch::Tensor DistributedSampler::indices(int64_t step) {
  return global_indices(step).narrow(0, rank_ * local_batch(), local_batch()).clone();
}

}  // namespace shardrl::data
