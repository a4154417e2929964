// Consolidated Hugging Face-style export and streaming weight sync.
#include <fmt/format.h>

#include <filesystem>

#include "checkpoint/io.h"
#include "checkpoint/reader.h"

namespace shardrl::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::vector<std::string> export_hf(const std::string& ckpt_dir, const std::string& out_dir,
                                   const ExportOptions& options) {
  if (options.max_shard_bytes <= 0) {
    throw std::invalid_argument(
        fmt::format("export: max_shard_bytes must be > 0, got {}", options.max_shard_bytes));
  }
  CheckpointReader reader(ckpt_dir);
  const json& model = reader.index().at("model");

  // Files are planned from the index alone, so every header is known before any data is read.
  struct Planned {
    std::string source;  // name in the checkpoint
    TensorInfo info;     // as exported
  };
  std::vector<std::vector<Planned>> files;
  int64_t in_current = 0;
  for (const auto& [name, entry] : model.items()) {
    Planned p{
        name,
        {options.prefix + name, options.dtype, entry.at("shape").get<std::vector<int64_t>>()}};
    if (files.empty() || in_current + p.info.nbytes() > options.max_shard_bytes) {
      files.emplace_back();
      in_current = 0;
    }
    in_current += p.info.nbytes();
    files.back().push_back(std::move(p));
  }

  fs::create_directories(out_dir);
  json weight_map = json::object();
  int64_t total = 0;
  std::vector<std::string> written;
  for (size_t i = 0; i < files.size(); ++i) {
    const std::string name = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, files.size());
    std::vector<TensorInfo> infos;
    for (const auto& p : files[i]) infos.push_back(p.info);
    SafetensorsWriter writer((fs::path(out_dir) / name).string(), infos, {{"format", "pt"}});
    for (const auto& p : files[i]) {
      // One full tensor at a time, released before the next is read.
      writer.write(p.info.name, reader.read_full(model[p.source], p.source).to(options.dtype));
      weight_map[p.info.name] = name;
      total += p.info.nbytes();
    }
    written.push_back(writer.close().path);
  }
  const json index = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
  const std::string index_path = (fs::path(out_dir) / "model.safetensors.index.json").string();
  write_file_durably(index_path, index.dump(2));
  written.push_back(index_path);
  const json& extra = reader.index().value("extra", json::object());
  json config = extra.is_object() && extra.contains("config") ? extra["config"] : json::object();
  config["torch_dtype"] = options.dtype == torch::kBFloat16 ? "bfloat16"
                          : options.dtype == torch::kHalf   ? "float16"
                                                            : "float32";
  const std::string config_path = (fs::path(out_dir) / "config.json").string();
  write_file_durably(config_path, config.dump(2));
  written.push_back(config_path);
  return written;
}

void for_each_full_parameter(
    const fsdp::FSDPModule& model, torch::ScalarType dtype, const std::string& prefix,
    const std::function<void(const std::string& name, const torch::Tensor& tensor)>& callback,
    const std::function<bool(const std::string& name)>& select) {
  torch::NoGradGuard no_grad;
  auto& group = model.mesh().shard_group();
  for (const auto& p : model.sharded_parameters()) {
    if (select && !select(p.name)) continue;
    // Cast before gathering so the wire and the one full buffer carry the target dtype. A gather
    // only copies bytes, and Gloo before 2.2 rejects bf16, so 2-byte types travel as fp16.
    const torch::Tensor shard = p.shard.detach().to(dtype).reshape(-1);
    const torch::ScalarType wire = dtype == torch::kBFloat16 ? torch::kHalf : dtype;
    torch::Tensor gathered =
        torch::empty({group.size() * shard.numel()}, shard.options().dtype(wire));
    group.all_gather(shard.view(wire), gathered);
    const int64_t rows = p.global_shape.empty() ? 1 : p.global_shape[0];
    const int64_t chunk_rows = p.shard.dim() == 0 ? 1 : p.shard.size(0);
    const torch::Tensor full = gathered.view(dtype)
                                   .view({group.size() * chunk_rows, -1})
                                   .narrow(0, 0, rows)
                                   .view(p.global_shape);
    callback(prefix + p.name, full);
  }
}

}  // namespace shardrl::checkpoint
