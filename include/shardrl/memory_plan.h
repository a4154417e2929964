// The memory plan of a training job: what each rank holds at its peak, and in which tier, worked
// out before anything is allocated. One formula, used by `shardrl train` (logged before the first
// step; a job that cannot fit stops with the settings that would make it fit), by `shardrl plan`
// (any world size and device, without running) and by the tests that hold it to measured peaks.
//
// Bytes per rank, N ranks sharding a model of P params of which P_t train (LoRA: the adapters):
//   params      4 P / N          fp32 master shards               tier: compute, or the offload
//   grads       4 P_t / N        reduced grad shards                tier with param_offload
//   optimizer   8 P_t / N        AdamW's two moments                tier with optimizer_offload
//   gathered    c (root + (1 + prefetch) x largest unit)   c: compute dtype bytes; the root's
//               params stay gathered from forward to backward; every unit when not resharded
//               after forward. With the host-shared image (CPU, host_shared_params) the host
//               holds c P once instead, and every rank's resident set counts it.
//   unsharded grads, reduce buffers   4 (root_t + 2 x largest_t)   while backward reduces
//   activations rows x tokens x (bytes a token keeps for backward) of one micro-batch, and a
//               language model's fp32 logits [rows, tokens, vocab] three times (logits,
//               log-softmax, their grad)
//   rollout     the replica (P x its dtype) or the actor gathered to sample, the KV cache
//   process     the runtime itself (LibTorch, BLAS, the allocator's slack)
// The update and the rollout are phases: the peak is the larger of the two. Offloaded state
// with offload_policy stays in its tier during training; without the policy it comes back for
// the update and leaves for the rollout (verl's param_offload / optimizer_offload).
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "shardrl/engine.h"

namespace shardrl::engine {

// One FSDP unit of a model, counted on the model built without bytes (fsdp::EmptyInit).
struct UnitSize {
  std::string name;       // "root", "model.layers.3", ...
  int64_t params = 0;     // elements
  int64_t trainable = 0;  // elements that train (all, or the LoRA adapters)
};

// A model as FSDP shards it and as its activations grow (EngineRegistry::model_size).
struct ModelSize {
  std::vector<UnitSize> units;  // the root first
  int64_t buffer_bytes = 0;     // tensors of a model instance that are no params
  // What a token of a micro-batch keeps for backward in each of `blocks` blocks: its
  // activations, what the attention scores add per position of its sequence, and the block's
  // input (all that activation checkpointing keeps, one block being recomputed at a time).
  int64_t blocks = 0;
  double block_activation_bytes_per_token = 0;
  double block_attention_bytes_per_token_position = 0;
  double block_input_bytes_per_token = 0;
  int64_t vocab_size = 0;          // a language model's head width: logits; 0 for none
  int64_t kv_bytes_per_token = 0;  // the KV cache a sampled token adds (fp32), 0 for none

  int64_t params() const;
  int64_t trainable() const;
  const UnitSize& root() const;
  const UnitSize& largest_unit() const;  // by params, the root excluded (the root when alone)
};

// What a task runs on one rank, for its activations and its rollout.
struct Workload {
  int64_t micro_batch_rows = 0;  // rows of one micro-batch of the update
  int64_t tokens_per_row = 0;    // tokens (or image + text positions) of a row
  // verl's use_prefix_grouper: the first shared_prompt_tokens of a row are its group's prompt,
  // packed once for each group of rows_per_prompt consecutive rows that a micro-batch holds
  // (0: every row packs its own).
  int64_t shared_prompt_tokens = 0;
  int64_t rows_per_prompt = 1;
  int64_t update_rows = 0;  // the rank's rows a step, split into micro-batches as the engine does
  bool gradient_checkpointing = false;
  bool logits = false;  // a language model's loss reads [rows, tokens, vocab] fp32 logits
  enum class Rollout {
    kNone,
    kReplica,        // an unsharded replica per rank, fed by the weight sync
    kActorGathered,  // the actor samples, its units gathered for the whole rollout
    kActorPerUnit,   // the actor samples with the usual FSDP forward, unit by unit
  };
  Rollout rollout = Rollout::kNone;
  torch::ScalarType rollout_dtype = torch::kFloat;  // kHalf: packed fp16 weights besides fp32
  int64_t rollout_rows = 0;                         // rows sampled at once per rank
  int64_t rollout_tokens = 0;  // tokens a row reaches (prompt + response), for the KV cache
  // A frozen forward-only reference model beside the actor (its own sharded engine).
  bool reference = false;
  bool reference_param_offload = false;
  // PPO's critic beside the actor (its own sharded engine that trains): its fp32 params, grads
  // and AdamW state sharded over its fsdp_size, resident in every phase unless offloaded. Its own
  // update needs fewer activations than the actor's (no logits), which the update's peak covers.
  int64_t critic_params = 0;  // 0: no critic
  int critic_fsdp_size = -1;
  bool critic_param_offload = false;
  bool critic_optimizer_offload = false;
  bool critic_host_shared_params = false;  // its own host-shared image of its params
};

// Where the job runs.
struct Layout {
  int nnodes = 1;
  int ranks_per_node = 1;
  torch::DeviceType device = torch::kCPU;
  int world_size() const { return nnodes * ranks_per_node; }
};

struct PlanLine {
  std::string what;
  int64_t bytes = 0;
  std::string tier;  // "compute", "host", "file", "host-shared" (one copy a host)
  std::string note;
};

struct MemoryPlan {
  Layout layout;
  int shard_size = 1;
  std::vector<PlanLine> update;               // one rank during the update
  std::vector<PlanLine> rollout;              // one rank during the rollout (empty: no rollout)
  int64_t update_peak = 0, rollout_peak = 0;  // compute memory of one rank in each phase
  int64_t host_shared = 0;    // one copy a host, counted once in per_host and in every rank's peak
  int64_t peak_per_rank = 0;  // compute memory (device memory; on a CPU its resident set)
  int64_t per_host = 0;       // what one host's ranks hold together in host memory
  int64_t file_per_host = 0;  // bytes the file tier writes on a host's disk
  // {"peak_per_rank_bytes", "per_host_bytes", "file_per_host_bytes", "update": [...], ...}
  nlohmann::json to_json() const;
  std::string describe() const;  // the plan, line by line, as `shardrl plan` prints it
  std::string summary() const;   // its last line: the peaks, as `shardrl train` logs them
};

// The process itself on a CPU rank: LibTorch and its libraries, BLAS and OpenMP buffers, what the
// allocator keeps. Measured (BENCHMARKS.md, the memory plan's entry).
inline constexpr int64_t kProcessBaselineBytes = int64_t{400} << 20;

// The plan of one engine (the actor) with the task's workload.
MemoryPlan plan_memory(const EngineConfig& config, const ModelSize& model, const Workload& work,
                       const Layout& layout);

// The host's available memory now (MemAvailable of /proc/meminfo), 0 where unknown.
int64_t host_available_bytes();

}  // namespace shardrl::engine
