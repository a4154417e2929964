// Consolidated Hugging Face-style export and streaming weight sync.
#include <fmt/format.h>

#include <filesystem>

#include "checkpoint/io.h"
#include "checkpoint/reader.h"
#include "shardrl/progress.h"

namespace shardrl::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::string torch_dtype_name(torch::ScalarType dtype) {
  return dtype == torch::kBFloat16 ? "bfloat16" : dtype == torch::kHalf ? "float16" : "float32";
}

}  // namespace

std::vector<std::string> write_hf(const std::string& out_dir,
                                  const std::vector<HfTensorPlan>& tensors,
                                  const std::function<torch::Tensor(size_t index)>& read,
                                  nlohmann::json config, torch::ScalarType dtype,
                                  int64_t max_shard_bytes, const HfLayout& layout) {
  if (max_shard_bytes <= 0) {
    throw std::invalid_argument(
        fmt::format("export: max_shard_bytes must be > 0, got {}", max_shard_bytes));
  }
  // Files are planned from the shapes alone, so every header is known before any data is read.
  std::vector<std::vector<size_t>> files;  // indices into tensors
  int64_t in_current = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const int64_t bytes = TensorInfo{tensors[i].name, dtype, tensors[i].shape}.nbytes();
    if (files.empty() || in_current + bytes > max_shard_bytes) {
      files.emplace_back();
      in_current = 0;
    }
    in_current += bytes;
    files.back().push_back(i);
  }

  int64_t planned = 0;
  for (const auto& t : tensors) planned += TensorInfo{t.name, dtype, t.shape}.nbytes();
  Progress progress(fmt::format("writing {}", out_dir), planned, {.unit = "B"});

  fs::create_directories(out_dir);
  const bool indexed = files.size() > 1 || !layout.single_file_unindexed;
  json weight_map = json::object();
  int64_t total = 0;
  std::vector<std::string> written;
  for (size_t f = 0; f < files.size(); ++f) {
    const std::string name = indexed ? fmt::format("{}-{:05d}-of-{:05d}.safetensors",
                                                   layout.weights_stem, f + 1, files.size())
                                     : layout.weights_stem + ".safetensors";
    std::vector<TensorInfo> infos;
    for (size_t i : files[f]) infos.push_back({tensors[i].name, dtype, tensors[i].shape});
    SafetensorsWriter writer((fs::path(out_dir) / name).string(), infos, {{"format", "pt"}});
    for (size_t k = 0; k < files[f].size(); ++k) {
      // One full tensor at a time, released before the next is read.
      writer.write(infos[k].name, read(files[f][k]).to(dtype));
      weight_map[infos[k].name] = name;
      total += infos[k].nbytes();
      progress.update(total);
    }
    written.push_back(writer.close().path);
  }
  if (indexed) {
    const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    const std::string index_path =
        (fs::path(out_dir) / (layout.weights_stem + ".safetensors.index.json")).string();
    write_file_durably(index_path, index.dump(2));
    written.push_back(index_path);
  }
  if (layout.config_torch_dtype) config["torch_dtype"] = torch_dtype_name(dtype);
  const std::string config_path = (fs::path(out_dir) / "config.json").string();
  write_file_durably(config_path, config.dump(2));
  written.push_back(config_path);
  progress.finish();
  return written;
}

std::vector<std::string> export_hf(const std::string& ckpt_dir, const std::string& out_dir,
                                   const ExportOptions& options) {
  CheckpointReader reader(ckpt_dir);
  const json& model = reader.index().at("model");
  const json& extra = reader.index().value("extra", json::object());
  if (!extra.is_object() || !extra.contains("config") || !extra["config"].is_object()) {
    throw std::invalid_argument(fmt::format(
        "export: checkpoint {} has no model config (extra.config in its index.json): it was not "
        "saved by shardrl train or Engine::save_checkpoint, and nothing could load the export",
        ckpt_dir));
  }
  std::vector<std::string> sources;  // names in the checkpoint
  std::vector<HfTensorPlan> plan;    // as exported
  for (const auto& [name, entry] : model.items()) {
    if (options.select && !options.select(name)) continue;
    sources.push_back(name);
    plan.push_back({options.prefix + name, entry.at("shape").get<std::vector<int64_t>>()});
  }
  for (const auto& [name, tensor] : options.extra_tensors) {
    if (model.contains(name)) {
      throw std::invalid_argument(fmt::format(
          "export: checkpoint {} holds tensor {}, which the export was to add", ckpt_dir, name));
    }
    plan.push_back({options.prefix + name, tensor.sizes().vec()});
  }
  return write_hf(
      out_dir, plan,
      [&](size_t i) {
        if (i >= sources.size())
          return options.extra_tensors[i - sources.size()].second.contiguous();
        torch::Tensor full = reader.read_full(model[sources[i]], sources[i]);
        return options.transform ? options.transform(sources[i], full) : full;
      },
      extra["config"], options.dtype, options.max_shard_bytes, options.layout);
}

void for_each_full_parameter(
    const fsdp::FSDPModule& model, torch::ScalarType dtype, const std::string& prefix,
    const std::function<void(const std::string& name, const torch::Tensor& tensor)>& callback,
    const std::function<bool(const std::string& name)>& select) {
  torch::NoGradGuard no_grad;
  auto& group = model.mesh().shard_group();
  const int64_t ranks = group.size();
  // Gloo before 2.2 rejects bf16, and a gather only copies bytes: 2-byte types travel as fp16.
  const torch::ScalarType wire = dtype == torch::kBFloat16 ? torch::kHalf : dtype;
  const int64_t element_bytes = static_cast<int64_t>(c10::elementSize(dtype));
  // Small params (a LoRA adapter's A and B, norms, biases) share one all-gather per batch: one
  // collective each cost more in latency than in bytes (a rank-16 adapter on every projection of
  // a 30-layer model is 420 tensors). A large one is gathered alone, straight into its full
  // tensor, so the peak stays one full tensor plus one batch.
  constexpr int64_t kSmallShardBytes = 1 << 20, kBatchBytes = 16 << 20;
  std::vector<fsdp::ShardedParameter> batch;
  int64_t batch_numel = 0;
  auto flush = [&] {
    if (batch.empty()) return;
    std::vector<torch::Tensor> shards;
    for (const auto& p : batch) shards.push_back(p.shard.detach().to(dtype).reshape(-1));
    const torch::Tensor input = shards.size() == 1 ? shards[0] : torch::cat(shards);
    torch::Tensor gathered = torch::empty({ranks * input.numel()}, input.options().dtype(wire));
    group.all_gather(input.view(wire), gathered);
    // Rank-major: row r holds rank r's shards, each param's at the same offset on every rank.
    const torch::Tensor by_rank = gathered.view(dtype).view({ranks, input.numel()});
    int64_t offset = 0;
    for (const auto& p : batch) {
      const int64_t numel = p.shard.numel();
      const int64_t rows = p.global_shape.empty() ? 1 : p.global_shape[0];
      const int64_t chunk_rows = p.shard.dim() == 0 ? 1 : p.shard.size(0);
      const torch::Tensor full = by_rank.narrow(1, offset, numel)
                                     .reshape({ranks * chunk_rows, -1})
                                     .narrow(0, 0, rows)
                                     .view(p.global_shape);
      callback(prefix + p.name, full);
      offset += numel;
    }
    batch.clear();
    batch_numel = 0;
  };
  for (auto& p : model.sharded_parameters()) {
    if (select && !select(p.name)) continue;
    const bool small = p.shard.numel() * element_bytes <= kSmallShardBytes;
    if (!small) flush();  // the callbacks keep the model's order
    batch_numel += p.shard.numel();
    batch.push_back(std::move(p));
    if (!small || batch_numel * element_bytes >= kBatchBytes) flush();
  }
  flush();
}

}  // namespace shardrl::checkpoint
