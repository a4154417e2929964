#include <fmt/format.h>

#include <string>
#include <tuple>
#include <utility>

#include "shardrl/dist.h"

namespace shardrl::dist {

namespace {
// The world's own group, shared without being owned (the World outlives every mesh of it).
std::shared_ptr<ProcessGroup> world_group(World& world) {
  return std::shared_ptr<ProcessGroup>(&world.group(), [](ProcessGroup*) {});
}

// The world laid out as a grid of runs of `run` neighbouring ranks: every rank's run (tag
// `run_tag`{index}) and its column, the ranks at the same place in every run (`column_tag`{place}).
// Collective over the world: every rank makes every group, runs first, in the same order.
std::pair<std::shared_ptr<ProcessGroup>, std::shared_ptr<ProcessGroup>> grid_groups(
    World& world, int run, const std::string& run_tag, const std::string& column_tag) {
  const int runs = world.size() / run;
  std::shared_ptr<ProcessGroup> mine_run, mine_column;
  for (int r = 0; r < runs; ++r) {
    std::vector<int> ranks;
    for (int place = 0; place < run; ++place) ranks.push_back(r * run + place);
    if (auto group = world.new_group(ranks, fmt::format("{}{}", run_tag, r))) mine_run = group;
  }
  for (int place = 0; place < run; ++place) {
    std::vector<int> ranks;
    for (int r = 0; r < runs; ++r) ranks.push_back(r * run + place);
    if (auto group = world.new_group(ranks, fmt::format("{}{}", column_tag, place))) {
      mine_column = group;
    }
  }
  return {mine_run, mine_column};
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
    std::tie(mesh.shard_, mesh.replicate_) = grid_groups(world, fsdp_size, "shard", "replicate");
  }
  if (sp == 1) {
    mesh.data_parallel_ = world_group(world);
    return mesh;
  }
  // verl's (dp, sp) mesh: the sp ranks of one sample are neighbours, so the all-to-alls of every
  // attention layer stay inside a node, as with the shard groups.
  std::tie(mesh.sequence_, mesh.data_parallel_) = grid_groups(world, sp, "sp", "dp");
  return mesh;
}

int DeviceMesh::rank() const {
  const int replica = replicate_ ? replicate_->rank() : 0;
  return replica * shard_size() + shard_->rank();
}

}  // namespace shardrl::dist
