// The memory plan's formula (include/shardrl/memory_plan.h). Nothing here allocates: it counts.
#include "shardrl/memory_plan.h"

#include <fmt/format.h>

#include <algorithm>
#include <fstream>
#include <numeric>
#include <sstream>

namespace shardrl::engine {

int64_t ModelSize::params() const {
  return std::accumulate(units.begin(), units.end(), int64_t{0},
                         [](int64_t sum, const UnitSize& u) { return sum + u.params; });
}

int64_t ModelSize::trainable() const {
  return std::accumulate(units.begin(), units.end(), int64_t{0},
                         [](int64_t sum, const UnitSize& u) { return sum + u.trainable; });
}

const UnitSize& ModelSize::root() const {
  TORCH_CHECK(!units.empty(), "ModelSize: no units");
  return units.front();
}

const UnitSize& ModelSize::largest_unit() const {
  TORCH_CHECK(!units.empty(), "ModelSize: no units");
  if (units.size() == 1) return units.front();
  return *std::max_element(units.begin() + 1, units.end(),
                           [](const auto& a, const auto& b) { return a.params < b.params; });
}

namespace {

int64_t dtype_bytes(torch::ScalarType dtype) {
  return static_cast<int64_t>(c10::elementSize(dtype));
}

// Bytes of `elements` split over `shards` ranks (FSDP pads each param to equal shards; the
// padding is at most a row a param, below what this plan resolves).
int64_t sharded(int64_t elements, int64_t bytes_each, int shards) {
  return (elements * bytes_each + shards - 1) / shards;
}

std::string gb(int64_t bytes) {
  return fmt::format("{:.2f} GB", static_cast<double>(bytes) / 1e9);
}

// The tokens of the update's largest micro-batch. With shared prompts, a micro-batch packs one
// prompt for each group it touches; the engine splits the rank's rows as split_batch does, so
// the micro-batch that straddles the most group boundaries sets the peak.
int64_t micro_batch_tokens(const Workload& work) {
  const int64_t rows = work.micro_batch_rows, padded = rows * work.tokens_per_row;
  if (work.shared_prompt_tokens <= 0 || work.update_rows <= 0 || work.rows_per_prompt <= 0) {
    return padded;
  }
  const int64_t count = (work.update_rows + rows - 1) / rows;
  int64_t most = 0;
  for (int64_t i = 0, first = 0; i < count; ++i) {
    const int64_t size = work.update_rows / count + (i < work.update_rows % count ? 1 : 0);
    const int64_t groups =
        (first + size - 1) / work.rows_per_prompt - first / work.rows_per_prompt + 1;
    most = std::max(most, size * work.tokens_per_row - (size - groups) * work.shared_prompt_tokens);
    first += size;
  }
  return most;
}

int64_t sum(const std::vector<PlanLine>& lines) {
  int64_t total = 0;
  for (const auto& line : lines) {
    if (line.tier == "compute" || line.tier == "host-shared") total += line.bytes;
  }
  return total;
}

}  // namespace

MemoryPlan plan_memory(const EngineConfig& config, const ModelSize& model, const Workload& work,
                       const Layout& layout) {
  MemoryPlan plan;
  plan.layout = layout;
  const int world = layout.world_size();
  const int shard = config.fsdp_size > 0 ? std::min(config.fsdp_size, world) : world;
  plan.shard_size = shard;
  const bool cpu = layout.device == torch::kCPU;
  const int64_t compute_bytes = dtype_bytes(config.fsdp.mixed_precision.param_dtype);
  const auto& off = config.offload;
  const std::string tier = offload::tier_name(off.tier);
  // The tier each kind of state sits in during the update and during the rollout.
  const bool params_out_in_update = off.param_offload && config.offload_policy;
  const bool optimizer_out_in_update = off.optimizer_offload && config.offload_policy;
  const bool params_out_in_rollout = off.param_offload;
  const bool optimizer_out_in_rollout = off.optimizer_offload;
  const bool trains = !config.forward_only;

  const int64_t P = model.params(), Pt = trains ? model.trainable() : 0;
  const UnitSize& root = model.root();
  const UnitSize& largest = model.largest_unit();
  const int64_t param_bytes = sharded(P, 4, shard);
  const int64_t grad_bytes = sharded(Pt, 4, shard);
  const int64_t optimizer_bytes = sharded(Pt, 8, shard);
  const bool image = cpu && config.fsdp.host_shared_params && shard > 1;
  // What FSDP holds gathered at once: the root from forward to backward, the unit computing and
  // the ones prefetched after it; every unit when units keep their params after forward.
  const int64_t units_at_once = std::max(0, config.fsdp.prefetch) + 1;
  const int64_t gathered_elements =
      config.fsdp.reshard_after_forward
          ? root.params + std::min<int64_t>(units_at_once, model.units.size() - 1) * largest.params
          : P;
  const std::string gathered_note =
      config.fsdp.reshard_after_forward
          ? fmt::format("root {} + {} x largest unit {} ({} params)", root.params, units_at_once,
                        largest.name, largest.params)
          : "every unit (reshard_after_forward false)";
  if (image) plan.host_shared = P * compute_bytes;
  // The critic's own engine keeps its own image of its unsharded (fp32) params.
  const int critic_shard =
      work.critic_fsdp_size > 0 ? std::min(work.critic_fsdp_size, world) : world;
  const int64_t critic_image =
      cpu && work.critic_host_shared_params && critic_shard > 1 ? work.critic_params * 4 : 0;
  plan.host_shared += critic_image;

  auto state_lines = [&](std::vector<PlanLine>& lines, bool params_out, bool optimizer_out) {
    lines.push_back({"params (fp32 shard)", param_bytes, params_out ? tier : "compute",
                     fmt::format("{} params / {} ranks", P, shard)});
    if (trains) {
      lines.push_back({"grads (fp32 shard)", grad_bytes, params_out ? tier : "compute",
                       fmt::format("{} trainable params", Pt)});
      lines.push_back({"optimizer (AdamW exp_avg, exp_avg_sq)", optimizer_bytes,
                       optimizer_out ? tier : "compute", ""});
    }
  };
  auto gathered_line = [&](std::vector<PlanLine>& lines, int64_t elements, const std::string& what,
                           const std::string& note) {
    if (image) {
      lines.push_back({what + " (host-shared image)", plan.host_shared, "host-shared",
                       "host_shared_params: one copy of the unsharded params a host"});
    } else {
      lines.push_back({what, elements * compute_bytes, "compute", note});
    }
  };
  auto fixed_lines = [&](std::vector<PlanLine>& lines) {
    if (model.buffer_bytes > 0) {
      lines.push_back(
          {"model buffers", model.buffer_bytes, "compute", "tensors that are no params"});
    }
    if (work.rollout == Workload::Rollout::kReplica) {
      int64_t replica = P * 4 + model.buffer_bytes;
      std::string note = "unsharded fp32 copy, fed by the weight sync";
      if (work.rollout_dtype == torch::kHalf) {
        replica += P * 2;
        note = "unsharded fp32 copy and its packed fp16 weights";
      }
      lines.push_back({"rollout replica", replica, "compute", note});
    }
    if (work.reference) {
      lines.push_back({"reference params (fp32 shard)", param_bytes,
                       work.reference_param_offload ? tier : "compute", "forward-only"});
    }
    if (work.critic_params > 0) {
      const auto note = fmt::format("{} params / {} ranks", work.critic_params, critic_shard);
      lines.push_back({"critic params and grads (fp32 shards)",
                       sharded(work.critic_params, 8, critic_shard),
                       work.critic_param_offload ? tier : "compute", note});
      lines.push_back({"critic optimizer (AdamW)", sharded(work.critic_params, 8, critic_shard),
                       work.critic_optimizer_offload ? tier : "compute", note});
      if (critic_image > 0) {
        lines.push_back({"critic gathered params (host-shared image)", critic_image, "host-shared",
                         "the critic's host_shared_params"});
      }
    }
    lines.push_back({"process", cpu ? kProcessBaselineBytes : int64_t{512} << 20, "compute",
                     "LibTorch, BLAS, allocator"});
  };

  // The update.
  auto& u = plan.update;
  state_lines(u, params_out_in_update, optimizer_out_in_update);
  gathered_line(u, gathered_elements, "gathered params", gathered_note);
  if (trains && Pt > 0) {
    const int64_t reduce = 4 * (root.trainable + 2 * largest.trainable);
    u.push_back({"unsharded grads and reduce buffers", reduce, "compute",
                 "root + 2 x largest unit, trainable"});
  }
  if (config.offload_policy && (off.param_offload || off.optimizer_offload)) {
    // One unit's shards come in for its step (and as the all-gather's input).
    const int64_t unit = std::max(root.params, largest.params);
    const int64_t step =
        sharded(unit, (off.param_offload ? 8 : 0) + (off.optimizer_offload ? 8 : 0), shard);
    u.push_back({"offloaded state of one unit, brought in", step, "compute",
                 "its optimizer step or all-gather input"});
  }
  if (trains && work.micro_batch_rows > 0 && work.tokens_per_row > 0) {
    const double tokens = static_cast<double>(micro_batch_tokens(work));
    const double block =
        model.block_activation_bytes_per_token +
        model.block_attention_bytes_per_token_position * static_cast<double>(work.tokens_per_row);
    const double blocks = static_cast<double>(model.blocks);
    const double per_token = work.gradient_checkpointing
                                 ? blocks * model.block_input_bytes_per_token + block
                                 : blocks * block;
    u.push_back(
        {"activations", static_cast<int64_t>(tokens * per_token), "compute",
         fmt::format(
             "micro-batch {} rows x {} tokens{}{}", work.micro_batch_rows, work.tokens_per_row,
             work.shared_prompt_tokens > 0
                 ? ", prompts shared: " + std::to_string(micro_batch_tokens(work)) + " tokens"
                 : "",
             work.gradient_checkpointing ? ", checkpointed" : "")});
    if (work.logits && model.vocab_size > 0) {
      u.push_back({"logits (fp32, x3)", static_cast<int64_t>(tokens) * model.vocab_size * 4 * 3,
                   "compute", fmt::format("vocab {}", model.vocab_size)});
    }
  }
  fixed_lines(u);

  // The rollout.
  if (work.rollout != Workload::Rollout::kNone) {
    auto& r = plan.rollout;
    state_lines(r, params_out_in_rollout, optimizer_out_in_rollout);
    if (work.rollout == Workload::Rollout::kActorGathered) {
      gathered_line(r, P, "actor gathered to sample", "every unit, for the whole rollout");
    } else if (work.rollout == Workload::Rollout::kActorPerUnit) {
      gathered_line(r, gathered_elements, "actor units gathered to sample", gathered_note);
    } else if (image) {
      // The trainer's units keep their rows in the image between phases.
      r.push_back({"gathered params (host-shared image)", plan.host_shared, "host-shared",
                   "host_shared_params"});
    }
    if (model.kv_bytes_per_token > 0 && work.rollout_rows > 0) {
      r.push_back({"KV cache", work.rollout_rows * work.rollout_tokens * model.kv_bytes_per_token,
                   "compute",
                   fmt::format("{} rows x {} tokens", work.rollout_rows, work.rollout_tokens)});
    }
    if (model.vocab_size > 0 && work.rollout_rows > 0) {
      r.push_back({"sampling logits", work.rollout_rows * model.vocab_size * 4 * 3, "compute", ""});
    }
    fixed_lines(r);
  }

  plan.update_peak = sum(plan.update);
  plan.rollout_peak = sum(plan.rollout);
  plan.peak_per_rank = std::max(plan.update_peak, plan.rollout_peak);
  int64_t host_tier = 0, file_tier = 0;
  for (const auto& line : plan.update) {
    if (line.tier == "host") host_tier += line.bytes;
    if (line.tier == "file") file_tier += line.bytes;
  }
  for (const auto& line : plan.rollout) {
    if (line.tier == "file") file_tier = std::max(file_tier, line.bytes);
  }
  const int64_t per_rank_private = plan.peak_per_rank - plan.host_shared;
  plan.per_host = cpu ? layout.ranks_per_node * per_rank_private + plan.host_shared +
                            layout.ranks_per_node * host_tier
                      : layout.ranks_per_node * (host_tier + kProcessBaselineBytes);
  plan.file_per_host = layout.ranks_per_node * file_tier;
  return plan;
}

nlohmann::json MemoryPlan::to_json() const {
  auto lines = [](const std::vector<PlanLine>& v) {
    nlohmann::json out = nlohmann::json::array();
    for (const auto& l : v) {
      out.push_back({{"what", l.what}, {"bytes", l.bytes}, {"tier", l.tier}, {"note", l.note}});
    }
    return out;
  };
  return {{"nnodes", layout.nnodes},
          {"ranks_per_node", layout.ranks_per_node},
          {"device", c10::DeviceTypeName(layout.device, /*lower_case=*/true)},
          {"shard_size", shard_size},
          {"update", lines(update)},
          {"rollout", lines(rollout)},
          {"update_peak_bytes", update_peak},
          {"rollout_peak_bytes", rollout_peak},
          {"host_shared_bytes", host_shared},
          {"peak_per_rank_bytes", peak_per_rank},
          {"per_host_bytes", per_host},
          {"file_per_host_bytes", file_per_host}};
}

std::string MemoryPlan::describe() const {
  const bool cpu = layout.device == torch::kCPU;
  std::ostringstream out;
  out << fmt::format(
      "memory plan: {} node(s) x {} rank(s), {} device, shard group {}; per rank{}:\n",
      layout.nnodes, layout.ranks_per_node, c10::DeviceTypeName(layout.device, true), shard_size,
      cpu ? " (resident set)" : " (device memory)");
  auto phase = [&](const char* name, const std::vector<PlanLine>& lines, int64_t peak) {
    out << fmt::format("  {}:\n", name);
    for (const auto& l : lines) {
      out << fmt::format("    {:<44} {:>10}  {:<11} {}\n", l.what, gb(l.bytes), l.tier, l.note);
    }
    out << fmt::format("    {:<44} {:>10}\n", "in compute memory", gb(peak));
  };
  phase("update", update, update_peak);
  if (!rollout.empty()) phase("rollout", rollout, rollout_peak);
  out << "  " << summary();
  return out.str();
}

std::string MemoryPlan::summary() const {
  std::string line = fmt::format(
      "peak per rank {}; per host {}{}", gb(peak_per_rank), gb(per_host),
      host_shared > 0 ? fmt::format(" (the host-shared {} counted once)", gb(host_shared))
                      : std::string());
  if (file_per_host > 0) line += fmt::format("; file tier {} a host", gb(file_per_host));
  return line;
}

int64_t host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t value = 0;
  std::string unit;
  while (in >> key >> value) {
    std::getline(in, unit);
    if (key == "MemAvailable:") return value * 1024;
  }
  return 0;
}

}  // namespace shardrl::engine
