#include <fmt/format.h>

#include "shardrl/dist.h"

namespace shardrl::dist {

namespace {
// The world's own group, shared without being owned (the World outlives every mesh of it).
std::shared_ptr<ProcessGroup> world_group(World& world) {
  return std::shared_ptr<ProcessGroup>(&world.group(), [](ProcessGroup*) {});
}
}  // namespace

DeviceMesh DeviceMesh::create(World& world, int fsdp_size, int ulysses_sequence_parallel_size) {
  const int world_size = world.size();
  if (fsdp_size <= 0) fsdp_size = world_size;
  if (fsdp_size > world_size || world_size % fsdp_size != 0) {
    throw std::invalid_argument(
        fmt::format("fsdp_size={} does not divide the world size {} (hybrid sharding needs world = "
                    "replicas x fsdp_size)",
                    fsdp_size, world_size));
  }
  const int sp = ulysses_sequence_parallel_size;
  if (sp < 1 || world_size % sp != 0) {
    throw std::invalid_argument(fmt::format(
        "ulysses_sequence_parallel_size={} does not divide the world size {} (the mesh is "
        "data-parallel ranks x sequence-parallel ranks)",
        sp, world_size));
  }
  DeviceMesh mesh;
  mesh.device_ = world.device();
  if (fsdp_size == world_size) {
    mesh.shard_ = world_group(world);
  } else {
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
  }
  if (sp == 1) {
    mesh.data_parallel_ = world_group(world);
    return mesh;
  }
  // verl's (dp, sp) mesh: the sp ranks of one sample are neighbours, so the all-to-alls of every
  // attention layer stay inside a node, as with the shard groups.
  const int dp = world_size / sp;
  for (int d = 0; d < dp; ++d) {
    std::vector<int> ranks;
    for (int s = 0; s < sp; ++s) ranks.push_back(d * sp + s);
    auto group = world.new_group(ranks, fmt::format("sp{}", d));
    if (group) mesh.sequence_ = group;
  }
  for (int s = 0; s < sp; ++s) {
    std::vector<int> ranks;
    for (int d = 0; d < dp; ++d) ranks.push_back(d * sp + s);
    auto group = world.new_group(ranks, fmt::format("dp{}", s));
    if (group) mesh.data_parallel_ = group;
  }
  return mesh;
}

int DeviceMesh::rank() const {
  const int replica = replicate_ ? replicate_->rank() : 0;
  return replica * shard_size() + shard_->rank();
}

}  // namespace shardrl::dist
