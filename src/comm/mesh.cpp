#include <fmt/format.h>

#include "shardrl/dist.h"

namespace shardrl::dist {

DeviceMesh DeviceMesh::create(World& world, int fsdp_size) {
  const int world_size = world.size();
  if (fsdp_size <= 0) fsdp_size = world_size;
  if (fsdp_size > world_size || world_size % fsdp_size != 0) {
    throw std::invalid_argument(
        fmt::format("fsdp_size={} does not divide the world size {} (hybrid sharding needs world = "
                    "replicas x fsdp_size)",
                    fsdp_size, world_size));
  }
  DeviceMesh mesh;
  mesh.device_ = world.device();
  if (fsdp_size == world_size) {
    mesh.shard_ = std::shared_ptr<ProcessGroup>(&world.group(), [](ProcessGroup*) {});
    return mesh;
  }
  // Rank = replica * fsdp_size + shard index: shard groups are runs of neighbouring ranks, which
  // keeps the heavier all-gather/reduce-scatter traffic inside a node on real clusters.
  const int replicas = world_size / fsdp_size;
  for (int replica = 0; replica < replicas; ++replica) {
    std::vector<int> ranks;
    for (int s = 0; s < fsdp_size; ++s) ranks.push_back(replica * fsdp_size + s);
    auto group = world.new_group(ranks, fmt::format("shard{}", replica));
    if (group) mesh.shard_ = group;
  }
  for (int s = 0; s < fsdp_size; ++s) {
    std::vector<int> ranks;
    for (int replica = 0; replica < replicas; ++replica) ranks.push_back(replica * fsdp_size + s);
    auto group = world.new_group(ranks, fmt::format("replicate{}", s));
    if (group) mesh.replicate_ = group;
  }
  return mesh;
}

int DeviceMesh::data_parallel_rank() const {
  const int replica = replicate_ ? replicate_->rank() : 0;
  return replica * shard_size() + shard_->rank();
}

}  // namespace shardrl::dist
