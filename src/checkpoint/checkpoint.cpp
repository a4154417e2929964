// Sharded save and resharding load.
#include <ATen/core/Generator.h>
#include <fmt/format.h>
#include <malloc.h>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <system_error>
#include <unordered_map>

#include "checkpoint/io.h"
#include "checkpoint/reader.h"
#include "compat.h"
#include "shardrl/optim.h"
#include "shardrl/progress.h"

namespace shardrl::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kFormat = "shardrl-sharded-checkpoint";
constexpr const char* kLatest = "latest";
constexpr const char* kStepPrefix = "global_step_";
constexpr const char* kTmpPrefix = ".tmp-step-";
constexpr const char* kRngTensor = "rng.cpu";
constexpr std::array<const char*, 3> kMoments = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};

std::string model_file(int rank) {
  return fmt::format("model_rank{}.safetensors", rank);
}
std::string optim_file(int rank) {
  return fmt::format("optim_rank{}.safetensors", rank);
}

// Shards are stored as [valid_rows, rest of the global shape]; a 0-d parameter is one row.
std::vector<int64_t> rows_shape(const std::vector<int64_t>& global_shape, int64_t rows) {
  std::vector<int64_t> shape = global_shape.empty() ? std::vector<int64_t>{1} : global_shape;
  shape[0] = rows;
  return shape;
}

// Rank 0's string on every rank of group.
std::string broadcast_string(dist::ProcessGroup& group, const std::string& mine,
                             torch::Device device) {
  torch::Tensor length =
      torch::tensor({static_cast<int64_t>(mine.size())}, torch::kLong).to(device);
  group.broadcast(length, 0);
  const int64_t n = length.cpu().item<int64_t>();
  torch::Tensor bytes = torch::zeros({n}, torch::kByte);
  if (group.rank() == 0) std::memcpy(bytes.data_ptr(), mine.data(), mine.size());
  bytes = bytes.to(device);
  group.broadcast(bytes, 0);
  bytes = bytes.cpu();
  return std::string(reinterpret_cast<const char*>(bytes.data_ptr<uint8_t>()),
                     static_cast<size_t>(n));
}

// Every rank's JSON, in DeviceMesh::rank() order (replica-major).
std::vector<json> all_gather_json(const dist::DeviceMesh& mesh, const json& mine) {
  json shard_group = json::array();
  for (const auto& s : dist::all_gather_strings(mesh.shard_group(), mine.dump(), mesh.device()))
    shard_group.push_back(json::parse(s));
  std::vector<json> out;
  if (dist::ProcessGroup* replicas = mesh.replicate_group()) {
    for (const auto& s : dist::all_gather_strings(*replicas, shard_group.dump(), mesh.device())) {
      for (auto& j : json::parse(s)) out.push_back(std::move(j));
    }
  } else {
    for (auto& j : shard_group) out.push_back(std::move(j));
  }
  return out;
}

// True on every rank when `ok` is true on every rank, so one rank's I/O error fails the
// collective everywhere at once instead of leaving the others to time out.
bool all_ok(const dist::DeviceMesh& mesh, bool ok) {
  torch::Tensor failed =
      torch::full({1}, ok ? 0 : 1, torch::dtype(torch::kInt).device(mesh.device()));
  mesh.shard_group().all_reduce(failed, dist::ReduceOp::kMax);
  if (dist::ProcessGroup* replicas = mesh.replicate_group())
    replicas->all_reduce(failed, dist::ReduceOp::kMax);
  return failed.item<int>() == 0;
}

// Runs fn; every rank throws if it threw on any rank (the failing rank with its own message).
template <class Fn>
void collectively(const dist::DeviceMesh& mesh, const std::string& what, Fn&& fn) {
  std::string error;
  try {
    fn();
  } catch (const std::exception& e) {
    error = e.what();
  }
  if (all_ok(mesh, error.empty())) return;
  if (!error.empty()) throw std::runtime_error(error);
  throw std::runtime_error(fmt::format("{}: failed on another rank (see its log)", what));
}

// The leaf optimizer that steps each parameter: the optimizer itself, or the part of a grouped
// optimizer (base vs LoRA, say) whose param groups hold it. State is saved and loaded per
// parameter name, so which part holds a parameter never reaches the files: a checkpoint resumes
// under another grouping and at another world size alike. Every part that holds a parameter of
// the model must be AdamW; a parameter no part holds (a frozen one) has no state.
using StateOwners = std::unordered_map<const c10::TensorImpl*, torch::optim::AdamW*>;

StateOwners adamw_owners(torch::optim::Optimizer& optimizer,
                         const std::vector<fsdp::ShardedParameter>& params,
                         const std::string& what) {
  std::unordered_map<const c10::TensorImpl*, torch::optim::Optimizer*> holder;
  for (torch::optim::Optimizer* leaf : optim::leaf_optimizers(optimizer)) {
    for (const auto& group : leaf->param_groups()) {
      for (const auto& p : group.params()) holder[p.unsafeGetTensorImpl()] = leaf;
    }
  }
  StateOwners owners;
  for (const auto& p : params) {
    auto it = holder.find(p.shard.unsafeGetTensorImpl());
    if (it == holder.end()) continue;
    auto* adamw = dynamic_cast<torch::optim::AdamW*>(it->second);
    if (!adamw) {
      const torch::optim::Optimizer& stepper = *it->second;
      throw std::invalid_argument(fmt::format(
          "{}: '{}' is stepped by an optimizer of type {}; only torch::optim::AdamW state is "
          "supported",
          what, p.name, c10::demangle(typeid(stepper).name())));
    }
    owners[p.shard.unsafeGetTensorImpl()] = adamw;
  }
  return owners;
}

at::Generator cpu_generator() {
  return at::detail::getDefaultCPUGenerator();
}

std::optional<int64_t> step_of(const std::string& dir_name) {
  const std::string prefix = kStepPrefix;
  if (dir_name.rfind(prefix, 0) != 0 || dir_name.size() == prefix.size()) return std::nullopt;
  const std::string digits = dir_name.substr(prefix.size());
  // 18 digits at most: stoll cannot overflow on a stray directory name.
  if (digits.size() > 18 || !std::all_of(digits.begin(), digits.end(), ::isdigit))
    return std::nullopt;
  return std::stoll(digits);
}

// global_step_* directories under root, oldest first.
std::vector<std::pair<int64_t, fs::path>> list_checkpoints(const std::string& root) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    if (!entry.is_directory()) continue;
    if (auto step = step_of(entry.path().filename().string()))
      out.emplace_back(*step, entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<std::string> names_of(const std::vector<fsdp::ShardedParameter>& params) {
  std::vector<std::string> names;
  for (const auto& p : params) names.push_back(p.name);
  return names;
}

// A tensor shaped like p's shard whose padding rows are zero and whose valid rows are left for a
// read to fill (zeroing them too would write every loaded byte twice).
// The bytes of p's valid rows in fp32: what a load reads of it (and of each moment).
int64_t valid_bytes(const fsdp::ShardedParameter& p) {
  int64_t row = 1;
  for (size_t d = 1; d < p.global_shape.size(); ++d) row *= p.global_shape[d];
  return p.valid_rows * row * static_cast<int64_t>(sizeof(float));
}

torch::Tensor empty_with_zero_padding(const fsdp::ShardedParameter& p) {
  torch::Tensor t = torch::empty_like(p.shard.detach());
  if (t.dim() == 0) return t;
  t.narrow(0, p.valid_rows, t.size(0) - p.valid_rows).zero_();
  return t;
}

// Writes this rank's files and returns its part of the index.
json write_rank_files(const fs::path& dir, fsdp::FSDPModule& model, const StateOwners& owners,
                      const SaveOptions& options) {
  const auto& mesh = model.mesh();
  const int rank = mesh.rank();
  // Replicas hold the same shards: only the first replica writes them.
  const bool writes_shards =
      mesh.replicate_group() == nullptr || mesh.replicate_group()->rank() == 0;
  const auto params = model.sharded_parameters();
  json meta = {{"rank", rank},
               {"files", json::object()},
               {"model", json::object()},
               {"optimizer", json::object()},
               {"optimizer_step", json::object()}};
  auto shard_entry = [](const std::string& file, const TensorInfo& info, int64_t row_offset,
                        int64_t rows) {
    return json{{"file", file}, {"tensor", info.name},        {"row_offset", row_offset},
                {"rows", rows}, {"byte_offset", info.offset}, {"length", info.nbytes()}};
  };
  auto record_file = [&](const std::string& file, const FileSummary& summary) {
    meta["files"][file] = {{"bytes", summary.bytes},
                           {"crc32", summary.crc32},
                           {"block_bytes", summary.blocks.block_bytes},
                           {"block_crc32", summary.blocks.crc32}};
  };
  const std::map<std::string, std::string> file_metadata = {{"format", "pt"}};

  if (writes_shards) {
    std::vector<TensorInfo> infos;
    std::vector<const fsdp::ShardedParameter*> written;
    for (const auto& p : params) {
      if (p.valid_rows == 0) continue;
      infos.push_back({p.name, torch::kFloat, rows_shape(p.global_shape, p.valid_rows)});
      written.push_back(&p);
    }
    const std::string file = model_file(rank);
    SafetensorsWriter writer((dir / file).string(), infos, file_metadata, options.progress);
    // Unit by unit, each brought in from the offload tier only while it is written, so a model
    // whose state does not fit in memory saves too.
    size_t i = 0;
    model.for_each_resident(fsdp::ShardUse::kParams, [&](std::vector<fsdp::ShardedParameter>& in) {
      for (const auto& p : in) {
        if (p.valid_rows == 0) continue;
        writer.write(p.name, p.shard.detach().narrow(0, 0, p.valid_rows));
        meta["model"][p.name] = shard_entry(file, writer.tensors()[i], p.row_offset, p.valid_rows);
        ++i;
      }
    });
    TORCH_CHECK(i == written.size(), "checkpoint save: ", written.size(), " params to write, ", i,
                " came");
    record_file(file, writer.close());
  }

  // Optimizer moments of the valid rows, then this rank's RNG state.
  const std::string file = optim_file(rank);
  std::vector<TensorInfo> infos;
  struct MomentRows {
    const fsdp::ShardedParameter* param;
    size_t moment;
  };
  std::vector<MomentRows> pending;
  // The state's tensors by moment (their shapes are known while their bytes are offloaded).
  auto moments_of = [](const torch::optim::AdamWParamState& state) {
    return std::array<const torch::Tensor*, 3>{&state.exp_avg(), &state.exp_avg_sq(),
                                               &state.max_exp_avg_sq()};
  };
  auto state_of = [&](const fsdp::ShardedParameter& p) -> const torch::optim::AdamWParamState* {
    const auto owner = owners.find(p.shard.unsafeGetTensorImpl());
    if (owner == owners.end()) return nullptr;
    const auto& states = owner->second->state();
    auto it = states.find(compat::optimizer_state_key(p.shard));
    if (it == states.end()) return nullptr;
    return &static_cast<const torch::optim::AdamWParamState&>(*it->second);
  };
  for (const auto& p : params) {
    const auto* state = writes_shards ? state_of(p) : nullptr;
    if (!state) continue;
    meta["optimizer_step"][p.name] = state->step();
    if (p.valid_rows == 0) continue;
    const auto moments = moments_of(*state);
    for (size_t m = 0; m < kMoments.size(); ++m) {
      if (!moments[m]->defined()) continue;
      infos.push_back(
          {p.name + "." + kMoments[m], torch::kFloat, rows_shape(p.global_shape, p.valid_rows)});
      pending.push_back({&p, m});
    }
  }
  torch::Tensor rng;
  {
    auto gen = cpu_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state();
  }
  infos.push_back({kRngTensor, rng.scalar_type(), rng.sizes().vec()});
  SafetensorsWriter writer((dir / file).string(), infos, file_metadata, options.progress);
  size_t next = 0;
  if (!pending.empty()) {
    // Unit by unit, as the params: a unit's state is in memory only while it is written.
    model.for_each_resident(fsdp::ShardUse::kStep, [&](std::vector<fsdp::ShardedParameter>& in) {
      for (const auto& p : in) {
        while (next < pending.size() && pending[next].param->name == p.name) {
          const auto& item = pending[next];
          const auto* state = state_of(p);
          TORCH_CHECK(state, "checkpoint save: the optimizer state of ", p.name, " went away");
          writer.write(infos[next].name,
                       moments_of(*state)[item.moment]->narrow(0, 0, p.valid_rows));
          meta["optimizer"][p.name][kMoments[item.moment]] =
              shard_entry(file, writer.tensors()[next], p.row_offset, p.valid_rows);
          ++next;
        }
      }
    });
  }
  TORCH_CHECK(next == pending.size(), "checkpoint save: ", pending.size(),
              " optimizer tensors to write, ", next, " came");
  writer.write(kRngTensor, rng);
  record_file(file, writer.close());
  return meta;
}

json build_index(int64_t step, const fsdp::FSDPModule& model, const optim::LRScheduler* scheduler,
                 const json& extra, const std::vector<json>& ranks) {
  const auto& mesh = model.mesh();
  json index = {{"format", kFormat},
                {"version", kIndexVersion},
                {"step", step},
                {"world_size", mesh.size()},
                {"shard_size", mesh.shard_size()},
                {"replicate_size", mesh.replicate_size()},
                {"files", json::object()},
                {"model", json::object()},
                {"optimizer", {{"type", "adamw"}, {"state", json::object()}}},
                {"scheduler", scheduler ? json{{"last_step", scheduler->last_step()}} : json()},
                {"rng", json::array()},
                {"extra", extra}};
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& p : model.sharded_parameters()) {
    shapes[p.name] = p.global_shape;
    index["model"][p.name] = {
        {"dtype", "F32"}, {"shape", p.global_shape}, {"shards", json::array()}};
  }
  json& state = index["optimizer"]["state"];
  for (const json& meta : ranks) {
    const int rank = meta.at("rank").get<int>();
    for (const auto& [file, summary] : meta.at("files").items()) index["files"][file] = summary;
    for (const auto& [name, shard] : meta.at("model").items())
      index["model"][name]["shards"].push_back(shard);
    for (const auto& [name, step_count] : meta.at("optimizer_step").items()) {
      if (state.contains(name) && state[name]["step"] != step_count) {
        throw std::runtime_error(fmt::format(
            "checkpoint save: optimizer step of '{}' differs across ranks ({} on rank {}, {} "
            "before)",
            name, step_count.dump(), rank, state[name]["step"].dump()));
      }
      state[name]["step"] = step_count;
    }
    for (const auto& [name, moments] : meta.at("optimizer").items()) {
      for (const auto& [moment, shard] : moments.items()) {
        json& entry = state[name][moment];
        if (entry.is_null()) {
          entry = {{"dtype", "F32"}, {"shape", shapes.at(name)}, {"shards", json::array()}};
        }
        entry["shards"].push_back(shard);
      }
    }
    index["rng"].push_back({{"file", optim_file(rank)}, {"tensor", kRngTensor}});
  }
  return index;
}

// Moves the finished temporary directory into place and points `latest` at it.
void publish(const fs::path& root, const fs::path& tmp, const fs::path& final_dir) {
  fsync_path(tmp.string());
  if (fs::exists(final_dir)) {
    // Re-saving a step: the old copy stays whole until the new one is in place.
    const fs::path old = root / (std::string(kTmpPrefix) + "old-" + final_dir.filename().string());
    fs::remove_all(old);
    fs::rename(final_dir, old);
    fs::rename(tmp, final_dir);
    fsync_path(root.string());
    fs::remove_all(old);
  } else {
    fs::rename(tmp, final_dir);
  }
  fsync_path(root.string());
  const fs::path pointer_tmp = root / (std::string(kTmpPrefix) + kLatest);
  write_file_durably(pointer_tmp.string(), final_dir.filename().string() + "\n");
  fs::rename(pointer_tmp, root / kLatest);
  fsync_path(root.string());
}

}  // namespace

std::string save(const std::string& root, int64_t step, fsdp::FSDPModule& model,
                 torch::optim::Optimizer& optimizer, const optim::LRScheduler* scheduler,
                 const json& extra, const SaveOptions& options) {
  const auto& mesh = model.mesh();
  const bool leader = mesh.rank() == 0;
  const fs::path root_path(root);
  const fs::path tmp = root_path / fmt::format("{}{}", kTmpPrefix, step);
  const fs::path final_dir = root_path / fmt::format("{}{}", kStepPrefix, step);
  const std::string what = fmt::format("checkpoint save to {}", final_dir.string());

  collectively(mesh, what, [&] {
    if (!leader) return;
    fs::create_directories(root_path);
    // Leftovers of saves that died midway; only one save runs at a time.
    for (const auto& entry : fs::directory_iterator(root_path)) {
      if (entry.path().filename().string().rfind(kTmpPrefix, 0) == 0) fs::remove_all(entry.path());
    }
    fs::create_directory(tmp);
  });
  try {
    json mine;
    collectively(mesh, what, [&] {
      const auto owners = adamw_owners(optimizer, model.sharded_parameters(), what);
      mine = write_rank_files(tmp, model, owners, options);
    });
    const auto ranks = all_gather_json(mesh, mine);
    collectively(mesh, what, [&] {
      if (!leader) return;
      const json index = build_index(step, model, scheduler, extra, ranks);
      const std::string text = index.dump(1);
      write_file_durably((tmp / kIndexFile).string(), text);
      write_file_durably((tmp / kIndexChecksumFile).string(), index_checksum_line(text));
      publish(root_path, tmp, final_dir);
      rotate(root, options, final_dir.string());
    });
  } catch (...) {
    // The last checkpoint is untouched. The partial files go too, or a save that failed for a
    // full disk would leave it full. Every rank is past its writes once collectively() agreed on
    // the failure, and a rank that died writes no more.
    if (leader) {
      std::error_code ignored;
      fs::remove_all(tmp, ignored);
    }
    throw;
  }
  return final_dir.string();
}

namespace {

// A load's buffers (whole tensors on the reading rank, a full-size broadcast buffer on every rank)
// are freed once it ends, but glibc keeps freed heap for reuse (World's allocator tuning sets
// M_TRIM_THRESHOLD to its maximum, for the steps' sake): without this, a rank's resident set keeps
// the largest tensor's bytes for the whole job (1.1-1.5 GB on Qwen2.5-1.5B's rank 0,
// BENCHMARKS.md).
void return_freed_heap() {
#ifdef __GLIBC__
  malloc_trim(0);
#endif
}

// This rank's saved RNG state (undefined when the checkpoint was saved at fewer ranks).
torch::Tensor read_rng(const json& index, CheckpointReader& reader, int rank,
                       const std::string& dir) {
  if (rank < static_cast<int>(index.at("rng").size())) {
    const json& where = index["rng"][rank];
    return reader.file(where.at("file").get<std::string>())
        .read(where.at("tensor").get<std::string>());
  }
  spdlog::info("checkpoint {}: saved at {} ranks, rank {} keeps its RNG state", dir,
               index["rng"].size(), rank);
  return {};
}

// What a load sets once the model and optimizer have theirs: the schedule, the RNG, the result.
void finish_load(const json& index, CheckpointReader& reader, int rank, const std::string& dir,
                 optim::LRScheduler* scheduler, LoadResult& result) {
  const torch::Tensor rng = read_rng(index, reader, rank, dir);
  if (scheduler && !index.at("scheduler").is_null())
    scheduler->set_last_step(index["scheduler"].at("last_step").get<int64_t>());
  if (rng.defined()) {
    auto gen = cpu_generator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  }
  result.step = index.at("step").get<int64_t>();
  result.saved_world_size = index.at("world_size").get<int>();
  result.extra = index.value("extra", json::object());
}

// One param's AdamW state as a checkpoint saved it (`saved`: its entry under optimizer.state), its
// padding rows zero, as a fresh AdamW state would have them.
std::unique_ptr<torch::optim::AdamWParamState> read_adamw_state(CheckpointReader& reader,
                                                                const json& saved,
                                                                const fsdp::ShardedParameter& p,
                                                                Progress& progress) {
  auto state = std::make_unique<torch::optim::AdamWParamState>();
  state->step(saved.at("step").get<int64_t>());
  for (const char* moment : kMoments) {
    if (!saved.contains(moment)) continue;
    torch::Tensor t = empty_with_zero_padding(p);
    reader.read_rows(saved[moment], p.name + "." + moment, p.row_offset, p.valid_rows,
                     t.narrow(0, 0, p.valid_rows));
    progress.advance(valid_bytes(p));
    if (std::string(moment) == "exp_avg") state->exp_avg(t);
    if (std::string(moment) == "exp_avg_sq") state->exp_avg_sq(t);
    if (std::string(moment) == "max_exp_avg_sq") state->max_exp_avg_sq(t);
  }
  return state;
}

}  // namespace

LoadResult load(const std::string& dir, fsdp::FSDPModule& model, torch::optim::Optimizer* optimizer,
                optim::LRScheduler* scheduler, bool files_checked) {
  const auto& mesh = model.mesh();
  LoadResult result;
  collectively(mesh, fmt::format("checkpoint load from {}", dir), [&] {
    // Every file is checked first, unless the caller just did (size and crc32, one read pass split
    // over the shard group, before anything that could fail on one rank alone): a damaged file
    // then leaves the model as it was, and the state loads in place, with no second copy of it in
    // memory. Reading it all into fresh tensors first once doubled the shards for the load
    // (SD3.5-medium's resume peaked 1.5x its plan).
    if (!files_checked) {
      if (const auto problem = find_damage(dir, mesh.shard_group(), mesh.device());
          !problem.empty()) {
        throw std::runtime_error(problem);
      }
    }
    CheckpointReader reader(dir);
    const json& index = reader.index();
    torch::NoGradGuard no_grad;
    const auto params = model.sharded_parameters();
    for (const auto& p : params) {
      const json& entry = reader.model_entry(p.name);
      const auto shape = entry.at("shape").get<std::vector<int64_t>>();
      if (shape != p.global_shape) {
        throw std::runtime_error(fmt::format("checkpoint {}: '{}' has shape {}, the model {}", dir,
                                             p.name, entry.at("shape").dump(),
                                             c10::str(c10::IntArrayRef(p.global_shape))));
      }
    }
    // A large model's load takes a while: rank 0 shows its progress through its own rows.
    const json& saved = index.at("optimizer").at("state");
    int64_t planned = 0;
    for (const auto& p : params) {
      int64_t tensors = 1;
      if (optimizer && saved.contains(p.name)) {
        for (const char* moment : kMoments) tensors += saved[p.name].contains(moment) ? 1 : 0;
      }
      planned += tensors * valid_bytes(p);
    }
    Progress progress(fmt::format("checkpoint load from {}", dir), planned,
                      {.unit = "B", .enabled = mesh.rank() == 0});
    StateOwners owners;
    if (optimizer)
      owners = adamw_owners(*optimizer, params, fmt::format("checkpoint load from {}", dir));
    // Unit by unit when an offload layer keeps the state out of memory (FSDP2's offload policy,
    // the file tier: a model whose state does not fit in memory loads too), else all at once. A
    // param's old AdamW state goes before its saved one is read; a param the checkpoint has no
    // state for starts fresh, as it would have.
    model.for_each_resident(fsdp::ShardUse::kStep, [&](std::vector<fsdp::ShardedParameter>& in) {
      for (const auto& p : in) {
        reader.read_rows(reader.model_entry(p.name), p.name, p.row_offset, p.valid_rows,
                         p.shard.detach().narrow(0, 0, p.valid_rows));
        progress.advance(valid_bytes(p));
        const auto owner = owners.find(p.shard.unsafeGetTensorImpl());
        if (owner == owners.end()) continue;
        const auto key = compat::optimizer_state_key(p.shard);
        owner->second->state().erase(key);
        if (!saved.contains(p.name)) continue;
        owner->second->state()[key] = read_adamw_state(reader, saved[p.name], p, progress);
      }
    });
    model.mark_loaded(names_of(params));
    finish_load(index, reader, mesh.rank(), dir, scheduler, result);
    progress.finish();
  });
  return_freed_heap();
  return result;
}

namespace {

// The tensors of Hugging Face-style weights for the params of a model, shape-checked by the
// reading rank.
class HfTensors {
 public:
  HfTensors(const std::string& hf_dir, const std::string& prefix,
            const std::vector<fsdp::ShardedParameter>& params)
      : weights_(hf_dir), prefix_(prefix) {
    for (const auto& p : params) {
      const auto& info = reader_of(p).info(prefix_ + p.name);
      if (info.shape != p.global_shape) {
        throw std::runtime_error(fmt::format(
            "{}: '{}' has shape {}, the model {}", reader_of(p).path(), prefix_ + p.name,
            c10::str(c10::IntArrayRef(info.shape)), c10::str(c10::IntArrayRef(p.global_shape))));
      }
    }
  }

  // p's full tensor in fp32, viewed as [rows, row numel] (a scalar is one row).
  torch::Tensor read_rows_view(const fsdp::ShardedParameter& p, torch::Device device) {
    const int64_t rows = p.global_shape.empty() ? 1 : p.global_shape[0];
    return reader_of(p).read(prefix_ + p.name).to(device, torch::kFloat).reshape({rows, -1});
  }

 private:
  const SafetensorsReader& reader_of(const fsdp::ShardedParameter& p) {
    const std::string name = prefix_ + p.name;
    if (!weights_.contains(name)) {
      throw std::runtime_error(
          fmt::format("{}: no tensor '{}' for parameter '{}'", weights_.path(), name, p.name));
    }
    return weights_.reader(name);
  }

  HfWeights weights_;
  std::string prefix_;
};

// Opens the HF tensors on the first rank of each shard group (every replica's group has its own),
// failing every rank when that fails.
std::unique_ptr<HfTensors> open_hf_on_group_leader(
    const std::string& hf_dir, const std::string& prefix, const fsdp::FSDPModule& model,
    const std::vector<fsdp::ShardedParameter>& params, const std::string& what) {
  std::unique_ptr<HfTensors> tensors;
  collectively(model.mesh(), fmt::format("{} from {}", what, hf_dir), [&] {
    if (model.mesh().shard_group().rank() == 0)
      tensors = std::make_unique<HfTensors>(hf_dir, prefix, params);
  });
  return tensors;
}

std::vector<fsdp::ShardedParameter> selected_parameters(
    const fsdp::FSDPModule& model, const std::function<bool(const std::string&)>& select) {
  auto params = model.sharded_parameters();
  if (select) {
    params.erase(std::remove_if(params.begin(), params.end(),
                                [&](const fsdp::ShardedParameter& p) { return !select(p.name); }),
                 params.end());
  }
  return params;
}

// The fp32 bytes of p's full tensor.
int64_t full_bytes(const fsdp::ShardedParameter& p) {
  int64_t numel = 1;
  for (const int64_t d : p.global_shape) numel *= d;
  return numel * static_cast<int64_t>(sizeof(float));
}

// A large model's weights take a while to load: rank 0 shows its progress through them.
Progress weights_progress(const std::string& hf_dir, const fsdp::FSDPModule& model,
                          const std::vector<fsdp::ShardedParameter>& params) {
  int64_t planned = 0;
  for (const auto& p : params) planned += full_bytes(p);
  return Progress(fmt::format("loading {}", hf_dir), planned,
                  {.unit = "B", .enabled = model.mesh().rank() == 0});
}

// [chunk rows, row numel] view of a shard (a scalar's shard is one row).
torch::Tensor shard_rows(const fsdp::ShardedParameter& p) {
  const torch::Tensor shard = p.shard.detach();
  return shard.view({shard.dim() == 0 ? 1 : shard.size(0), -1});
}

}  // namespace

void load_hf(const std::string& hf_dir, fsdp::FSDPModule& model, const std::string& prefix,
             const std::function<bool(const std::string&)>& select) {
  const auto& mesh = model.mesh();
  auto& group = mesh.shard_group();
  const auto params = selected_parameters(model, select);
  auto tensors = open_hf_on_group_leader(hf_dir, prefix, model, params, "load_hf");
  Progress progress = weights_progress(hf_dir, model, params);
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    // The one full tensor this rank holds, released before the next.
    const int64_t rows = p.global_shape.empty() ? 1 : p.global_shape[0];
    torch::Tensor full =
        tensors ? tensors->read_rows_view(p, mesh.device())
                : torch::empty(p.global_shape, torch::dtype(torch::kFloat).device(mesh.device()))
                      .view({rows, -1});
    group.broadcast(full, 0);
    torch::Tensor shard = shard_rows(p);
    shard.narrow(0, 0, p.valid_rows).copy_(full.narrow(0, p.row_offset, p.valid_rows));
    shard.narrow(0, p.valid_rows, shard.size(0) - p.valid_rows).zero_();
    progress.advance(full_bytes(p));
  }
  progress.finish();
  model.mark_loaded(names_of(params));
}

void load_hf_from_rank0(const std::string& hf_dir, fsdp::FSDPModule& model,
                        const std::string& prefix,
                        const std::function<bool(const std::string&)>& select) {
  const auto& mesh = model.mesh();
  auto& group = mesh.shard_group();
  const int me = group.rank(), n = group.size();
  const auto params = selected_parameters(model, select);
  auto tensors = open_hf_on_group_leader(hf_dir, prefix, model, params, "load_hf_from_rank0");
  Progress progress = weights_progress(hf_dir, model, params);
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    torch::Tensor shard = shard_rows(p);
    const int64_t chunk = shard.size(0);
    torch::Tensor full;
    if (tensors) full = tensors->read_rows_view(p, mesh.device());
    // Rank r's rows go out as one shard-sized broadcast, received straight into rank r's shard;
    // a rank never holds more than its shards plus one shard-sized buffer.
    torch::Tensor passing;
    for (int r = 0; r < n; ++r) {
      torch::Tensor buffer = shard;
      if (r != me) {
        if (!passing.defined()) passing = torch::empty_like(shard);
        buffer = passing;
      }
      if (me == 0) {
        const int64_t first = std::min<int64_t>(r * chunk, full.size(0));
        const int64_t valid = std::min<int64_t>(chunk, full.size(0) - first);
        buffer.narrow(0, 0, valid).copy_(full.narrow(0, first, valid));
        buffer.narrow(0, valid, chunk - valid).zero_();
      }
      group.broadcast(buffer, 0);
    }
    progress.advance(full_bytes(p));
  }
  progress.finish();
  model.mark_loaded(names_of(params));
  return_freed_heap();
}

std::optional<std::string> find_latest(const std::string& root) {
  std::ifstream pointer(fs::path(root) / kLatest);
  std::string name;
  if (pointer && std::getline(pointer, name) && step_of(name) &&
      fs::exists(fs::path(root) / name / kIndexFile)) {
    return (fs::path(root) / name).string();
  }
  auto all = list_checkpoints(root);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (fs::exists(it->second / kIndexFile)) return it->second.string();
  }
  return std::nullopt;
}

std::string find_damage(const std::string& dir, dist::ProcessGroup& group, torch::Device device) {
  const std::string mine =
      find_damage(dir, static_cast<size_t>(group.rank()), static_cast<size_t>(group.size()));
  for (const auto& problem : dist::all_gather_strings(group, mine, device)) {
    if (!problem.empty()) return problem;
  }
  return "";
}

std::optional<std::string> find_latest_whole(
    const std::string& root, dist::ProcessGroup& group, torch::Device device,
    const std::function<void(const std::string& dir, const std::string& problem)>& on_damaged) {
  // Ranks on different hosts may list a shared directory differently for a moment (NFS caches
  // listings): rank 0's list is the one all check. A global_step_* without index.json is a
  // candidate too: a save only publishes complete directories, so it is damaged, not unfinished.
  json candidates = json::array();
  if (group.rank() == 0) {
    std::vector<std::pair<int64_t, fs::path>> all = list_checkpoints(root);
    std::ifstream pointer(fs::path(root) / kLatest);
    std::string latest;
    if (pointer && std::getline(pointer, latest) && step_of(latest) &&
        fs::is_directory(fs::path(root) / latest)) {
      candidates.push_back((fs::path(root) / latest).string());
    }
    for (auto it = all.rbegin(); it != all.rend(); ++it) {
      if (it->second.filename().string() != latest) candidates.push_back(it->second.string());
    }
  }
  candidates = json::parse(broadcast_string(group, candidates.dump(), device));
  for (const auto& candidate : candidates) {
    const std::string dir = candidate.get<std::string>();
    const std::string problem = find_damage(dir, group, device);
    if (problem.empty()) return dir;
    on_damaged(dir, problem);
  }
  return std::nullopt;
}

int64_t directory_bytes(const std::string& dir) {
  int64_t total = 0;
  std::error_code ec;
  for (const auto& entry : fs::recursive_directory_iterator(dir, ec)) {
    if (entry.is_regular_file()) total += static_cast<int64_t>(entry.file_size());
  }
  return total;
}

void rotate(const std::string& root, const SaveOptions& options, const std::string& keep) {
  auto all = list_checkpoints(root);
  const fs::path kept = fs::weakly_canonical(keep);
  const int64_t kept_step =
      step_of(kept.filename().string()).value_or(std::numeric_limits<int64_t>::max());
  // Checkpoints of steps after the one just saved go first: the run resumed from an earlier step
  // (past a damaged checkpoint, or from resume_from_path), so they belong to a course of training
  // it has left. Removing them before the oldest keeps a whole earlier checkpoint rather than
  // a damaged later one. Then the oldest first; never `keep`.
  std::vector<std::pair<fs::path, int64_t>> candidates, left_behind;
  int64_t total = 0;
  for (const auto& [step, path] : all) {
    const int64_t bytes = directory_bytes(path.string());
    total += bytes;
    if (fs::weakly_canonical(path) == kept) continue;
    (step > kept_step ? left_behind : candidates).emplace_back(path, bytes);
  }
  candidates.insert(candidates.begin(), left_behind.begin(), left_behind.end());
  size_t count = all.size();
  const double limit = options.max_mem_gb * double(int64_t{1} << 30);
  for (const auto& [path, bytes] : candidates) {
    const bool too_many =
        options.max_ckpt_to_keep > 0 && count > static_cast<size_t>(options.max_ckpt_to_keep);
    const bool too_big = options.max_mem_gb > 0 && static_cast<double>(total) > limit;
    if (!too_many && !too_big) break;
    spdlog::info("checkpoint rotation: removing {} ({} bytes)", path.string(), bytes);
    fs::remove_all(path);
    --count;
    total -= bytes;
  }
  if (options.max_mem_gb > 0 && static_cast<double>(total) > limit) {
    spdlog::warn("checkpoint rotation: {} alone takes {} bytes, over max_mem_gb = {}", keep, total,
                 options.max_mem_gb);
  }
}

}  // namespace shardrl::checkpoint
