// Offload and onload of a sharded model's params, grads and optimizer state: verl's
// to(device, model, optimizer, grad) and offload()/onload() between rollout and training, and
// FSDP2's CPUOffloadPolicy for training itself.
//
//   offload::offload(model.fsdp(), &optimizer);   // before rollout: the memory is released
//   offload::onload(model.fsdp(), &optimizer);    // before training: bit for bit the same state
//
//   offload::Options policy;                      // or train with the state kept offloaded
//   policy.param_offload = policy.optimizer_offload = true;
//   offload::set_policy(model.fsdp(), &optimizer, policy);
//
// Offloading keeps every tensor object (the shards, their views, the grads, the optimizer state):
// only the bytes behind them move, so optimizers, LoRA handles and checkpoints keep their
// references. Each rank moves its own shards; nothing here is collective.
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>

#include "shardrl/fsdp.h"

namespace shardrl::offload {

// Where sharded state lives.
enum class Tier {
  kCompute,  // the mesh's device, where FSDP computes
  kHost,     // pinned host memory, asynchronous copies (CUDA compute devices only)
  kFile,     // files on local disk, one per unit and kind of state; the memory is released
             // (ZeRO-Infinity's NVMe offload; on a CPU machine the only tier below compute)
};

// "compute"/"device", "host"/"cpu", "file"/"nvme"/"disk"; errors name `field`.
Tier parse_tier(const std::string& name, const std::string& field);
std::string tier_name(Tier tier);

// The training policy, in verl's words.
struct Options {
  // Param and grad shards live in `tier`: a shard comes to compute memory only as the all-gather
  // input, and grads go back to the tier after every reduce-scatter.
  bool param_offload = false;
  // Optimizer state lives in `tier`; each unit's part comes in just for that unit's step.
  bool optimizer_offload = false;
  Tier tier = Tier::kFile;
  // File tier: each rank writes under dir/rank<R>. Empty: <temp dir>/shardrl-offload-<pid>.
  // The files stay between an onload and the next offload, which overwrites them in place, and
  // are removed with the model: the disk holds the offloaded bytes from the first offload on.
  std::string dir;
};

// Which state to move, as verl's to(device, model, optimizer, grad) flags.
struct Selection {
  bool model = true;      // the param shards
  bool grad = true;       // the grad shards; requires model, as in verl
  bool optimizer = true;  // every (sub-)optimizer's state
};

// Sets the policy of `model` (the root) and moves its state to where the policy keeps it. The
// optimizer may be null: a forward-only reference model, whose params then stay offloaded
// between forwards. Also sets the tier and directory to() and offload() use.
void set_policy(fsdp::FSDPModule& model, torch::optim::Optimizer* optimizer,
                const Options& options);

// Moves the selected state to `tier` (kCompute: onload); state already there is left alone.
// `optimizer` may be null; a grouped optimizer's sub-optimizers are all reached, stepped or not.
void to(Tier tier, fsdp::FSDPModule& model, torch::optim::Optimizer* optimizer,
        Selection what = {});
// to() the policy's tier (the file tier unless set_policy chose another), and back.
void offload(fsdp::FSDPModule& model, torch::optim::Optimizer* optimizer, Selection what = {});
void onload(fsdp::FSDPModule& model, torch::optim::Optimizer* optimizer, Selection what = {});

struct Bytes {
  int64_t resident = 0;   // in compute memory
  int64_t offloaded = 0;  // in the offload tier
};

// This rank's sharded state by kind, and what the process holds.
struct MemoryReport {
  Bytes params, grads, optimizer;
  int64_t unsharded = 0;    // the working set: all-gathered params, unsharded (no_sync) grads
  int64_t process_rss = 0;  // VmRSS of this process
};

MemoryReport memory(const fsdp::FSDPModule& model, const torch::optim::Optimizer* optimizer);
// One line with memory() at a phase change ("before rollout", ...), like verl's
// log_gpu_memory_usage.
void log_memory(const std::string& phase, const fsdp::FSDPModule& model,
                const torch::optim::Optimizer* optimizer);

// VmRSS from /proc/self/status, in bytes (0 where there is no /proc).
int64_t process_rss_bytes();
// VmHWM, the largest resident set this process has had (the memory plan's measured peak).
int64_t process_peak_rss_bytes();

}  // namespace shardrl::offload
