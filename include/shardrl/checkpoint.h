// Sharded checkpoints that reload at any world size, safetensors I/O, consolidated export and
// streaming weight sync.
//
// A checkpoint is a directory `<root>/global_step_N` holding, per rank r of the mesh,
// `model_rank{r}.safetensors` (the valid rows of each fp32 master shard) and
// `optim_rank{r}.safetensors` (AdamW moments of those rows and the rank's RNG state), plus one
// `index.json` written by rank 0: each tensor's global shape and dtype, where every shard of it
// lives (file, first row, rows, byte offset, length), a crc32 and size per file, the world size,
// the optimizer steps, the LR-scheduler step and the caller's extra JSON (e.g. the model config);
// and `index.json.crc32`, the crc32 of index.json's bytes, checked before the index is trusted.
// So every byte of a checkpoint is covered by a checksum.
//
//   checkpoint::SaveOptions keep;  keep.max_ckpt_to_keep = 3;
//   checkpoint::save(root, step, model.fsdp(), *optimizer, &scheduler, {{"config", cfg}}, keep);
//   if (auto dir = checkpoint::find_latest(root))
//     step = checkpoint::load(*dir, model.fsdp(), *optimizer, &scheduler).step;
//
// Saving writes into `<root>/.tmp-step-N`, fsyncs, renames it to `global_step_N` and then
// replaces the `latest` pointer, so a crash at any point leaves the previous checkpoint loadable.
// All ranks must see the same filesystem.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardrl/fsdp.h"
#include "shardrl/lr_schedule.h"

namespace shardrl::checkpoint {

// ---- safetensors -------------------------------------------------------------------------------

// "F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL".
std::string dtype_name(torch::ScalarType dtype);
// Errors name `where` (a file, a field).
torch::ScalarType dtype_from_name(const std::string& name, const std::string& where);

struct TensorInfo {
  std::string name;
  torch::ScalarType dtype = torch::kFloat;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // absolute byte offset of the data in the file (set by writer and reader)
  int64_t nbytes() const;
};

// crc32 of each consecutive block_bytes-byte block of a file (the last may be shorter): a reader
// verifies exactly the bytes it reads, in the same pass, without reading the whole file first.
struct BlockChecksums {
  static constexpr int64_t kDefaultBlockBytes = int64_t{4} << 20;
  int64_t block_bytes = 0;  // 0: none
  std::vector<uint32_t> crc32;
  bool empty() const { return block_bytes == 0; }
};

struct FileSummary {
  std::string path;
  int64_t bytes = 0;
  uint32_t crc32 = 0;  // zlib crc32 of the whole file
  BlockChecksums blocks;
};

// Streams a safetensors file: the header is written from the declared tensors up front, then the
// data of one tensor at a time, so nothing but the tensor being written is held.
class SafetensorsWriter {
 public:
  // Called after every write of data with the file and the bytes written so far.
  using Progress = std::function<void(const std::string& path, int64_t bytes)>;

  SafetensorsWriter(std::string path, std::vector<TensorInfo> tensors,
                    const std::map<std::string, std::string>& metadata = {},
                    Progress progress = nullptr);
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  // The next declared tensor; any dtype/shape mismatch with the declaration throws.
  void write(const std::string& name, const torch::Tensor& tensor);
  // fsyncs and closes; every declared tensor must have been written.
  FileSummary close();
  // With offsets filled in.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }

 private:
  void write_bytes(const void* data, int64_t n);

  std::string path_;
  std::vector<TensorInfo> tensors_;
  Progress progress_;
  int fd_ = -1;
  size_t next_ = 0;
  int64_t written_ = 0;
  BlockChecksums blocks_;  // the last entry is the block being written
};

// Reads tensors (or row ranges of them) with a seek and a read each; only the header is parsed
// on open. Given block checksums, every byte read (the header included) is verified against them
// as it is read: a block read whole is checked in place, a block read in part is read whole into a
// one-block cache first. A mismatch throws "checkpoint file <path> is damaged".
class SafetensorsReader {
 public:
  explicit SafetensorsReader(std::string path, BlockChecksums checksums = {});
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  const TensorInfo& info(const std::string& name) const;
  // In file order.
  std::vector<std::string> names() const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  torch::Tensor read(const std::string& name) const;
  // Rows [first, first + rows) of dim 0 (a 0-d tensor has one row), into a fresh tensor.
  torch::Tensor read_rows(const std::string& name, int64_t first, int64_t rows) const;
  // Same, into `out` (contiguous, the file's dtype, rows * row size elements).
  void read_rows_into(const std::string& name, int64_t first, int64_t rows,
                      const torch::Tensor& out) const;

 private:
  // pread of [offset, offset + n), verified when checksums were given.
  void read_bytes(void* out, int64_t n, int64_t offset) const;
  void check_block(int64_t block, const char* data) const;

  std::string path_;
  int fd_ = -1;
  int64_t file_size_ = 0;
  BlockChecksums checksums_;
  mutable std::vector<bool> verified_;
  mutable std::vector<char> cache_;  // block cached_block_, verified
  mutable int64_t cached_block_ = -1;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// zlib crc32 of a whole file, read in blocks.
uint32_t file_crc32(const std::string& path);

// ---- sharded checkpoints -----------------------------------------------------------------------

struct SaveOptions {
  int max_ckpt_to_keep = 0;  // <= 0: keep all
  double max_mem_gb = 0.0;   // total bytes (GiB) of global_step_* under root; <= 0: unlimited
  // Called as each rank's files are written (bytes so far); for progress reporting and tests.
  SafetensorsWriter::Progress progress;
};

// Collective over every rank of model.mesh(). Writes `<root>/global_step_<step>`, updates
// `<root>/latest`, then rotates. Returns the checkpoint directory. The optimizer is AdamW or a
// GroupedOptimizer of AdamWs: state is saved per parameter name, whichever part steps it, and
// load() puts it back into the part that holds the parameter then.
std::string save(const std::string& root, int64_t step, fsdp::FSDPModule& model,
                 torch::optim::Optimizer& optimizer, const optim::LRScheduler* scheduler,
                 const nlohmann::json& extra = nlohmann::json::object(),
                 const SaveOptions& options = {});

struct LoadResult {
  int64_t step = 0;
  int saved_world_size = 0;
  nlohmann::json extra;
};

// Collective. Loads a checkpoint saved at any world size: each rank reads only the rows it holds
// now, from whichever files contain them, after checking each file's size and crc32 (a missing,
// truncated or damaged file throws std::runtime_error naming it, the model unchanged). Restores
// the AdamW state (optimizer may be null to load weights only), the scheduler's step (may be null)
// and the RNG. files_checked: the caller has just run find_damage on `dir` and found nothing, so
// the files are not read a second time for the check (a resume picking a whole checkpoint).
LoadResult load(const std::string& dir, fsdp::FSDPModule& model, torch::optim::Optimizer* optimizer,
                optim::LRScheduler* scheduler, bool files_checked = false);

// The directory `latest` points to, or the highest global_step_* when the pointer is absent;
// nullopt when root holds no checkpoint. Checks nothing but that the index exists; see
// find_latest_whole.
std::optional<std::string> find_latest(const std::string& root);

// Deletes global_step_* under root until both limits hold, never `keep`: first those of steps after
// `keep`'s (left behind by a resume from an earlier step), then the oldest.
void rotate(const std::string& root, const SaveOptions& options, const std::string& keep);

// Bytes of the regular files under `dir`.
int64_t directory_bytes(const std::string& dir);

// The parsed index.json of a checkpoint directory, checked against index.json.crc32 first (errors
// name the file: missing, not valid JSON, or not matching its checksum). An index of version 1,
// from before the checksum file, is read without one.
nlohmann::json read_index(const std::string& dir);

struct FileStatus {
  std::string file;
  int64_t expected_bytes = 0;
  int64_t bytes = -1;  // -1: missing
  bool ok = false;
  std::string problem;  // empty when ok
};
// Checks every file the index names (size and crc32). Index damage throws, as read_index.
std::vector<FileStatus> verify(const std::string& dir);

// Empty when the checkpoint in `dir` is whole, else what is first found wrong with it, naming the
// file and why: the index (missing, not valid JSON, not matching its checksum, lacking a field) or
// a file it lists (missing, truncated, not matching its crc32). Reads every byte; changes nothing.
std::string find_damage(const std::string& dir);

// Collective over `group` (tensors on `device`), every rank passing the same dir: find_damage
// with the files shared out among the ranks, so each reads only its share. Every rank returns the
// same answer (the first problem in rank order).
std::string find_damage(const std::string& dir, dist::ProcessGroup& group, torch::Device device);

// Collective over `group`. The checkpoint under root to resume from: the one `latest` names, then
// every other global_step_* from the highest step down, the first that find_damage (collective)
// finds whole; nullopt when none is. Rank 0 lists the candidates and sends them to the others, so
// every rank checks the same ones and returns the same directory. Each damaged checkpoint passed
// over is handed to on_damaged (on every rank) with what is wrong with it. Nothing is changed or
// deleted.
std::optional<std::string> find_latest_whole(
    const std::string& root, dist::ProcessGroup& group, torch::Device device,
    const std::function<void(const std::string& dir, const std::string& problem)>& on_damaged);

// One whole tensor of a checkpoint, assembled from its shards in its saved dtype. `section` is
// "model" or "optimizer" (optimizer names are "<param>.exp_avg", "<param>.exp_avg_sq").
torch::Tensor read_full_tensor(const std::string& dir, const std::string& section,
                               const std::string& name);
// Model tensors `names` one at a time, each released after `callback` returns; the index is read
// once.
void for_each_full_tensor(
    const std::string& dir, const std::vector<std::string>& names,
    const std::function<void(const std::string& name, const torch::Tensor& tensor)>& callback);

// The tensors of Hugging Face-style weights: a directory with model.safetensors.index.json (its
// weight_map names each tensor's file) or with model.safetensors (diffusers' folders:
// diffusion_pytorch_model.safetensors[.index.json]), or one .safetensors file. Files are opened
// when first read. Errors name the file and the tensor.
class HfWeights {
 public:
  explicit HfWeights(const std::string& path);
  ~HfWeights();
  HfWeights(const HfWeights&) = delete;
  HfWeights& operator=(const HfWeights&) = delete;

  const std::string& path() const { return path_; }
  std::vector<std::string> names() const;
  bool contains(const std::string& name) const { return file_of_.count(name) > 0; }
  // The file holding `name`, opened; an unknown name is an error naming `path()`.
  const SafetensorsReader& reader(const std::string& name);

 private:
  std::string path_, dir_;
  std::map<std::string, std::string> file_of_;  // tensor -> file name under dir_
  std::map<std::string, std::unique_ptr<SafetensorsReader>> open_;
};

// ---- GGUF
// ----------------------------------------------------------------------------------------

// A GGUF file (llama.cpp's format, versions 2 and 3): its metadata and tensor table are parsed on
// open, every count, length and offset checked against the file's size before anything is
// allocated; tensor data is read on demand and dequantized to fp32. Readable types: F32, F16, BF16,
// Q8_0, Q4_0, Q4_1; another type is an error naming it and the tensor. Errors name the file and
// the field or tensor.
class GgufFile {
 public:
  struct Tensor {
    std::string name;
    std::vector<int64_t> shape;  // torch order (GGUF lists the fastest-varying dim first)
    std::string type;            // ggml's name: "F32", "Q4_1", "Q6_K", ...
    int64_t offset = 0;          // of the data in the file
    int64_t bytes = 0;
  };

  explicit GgufFile(const std::string& path);

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  // key -> value: numbers, booleans, strings and arrays of them, as JSON.
  const nlohmann::json& metadata() const { return metadata_; }
  // The value of `key`; absent is an error naming the key and the file.
  const nlohmann::json& at(const std::string& key) const;
  // In file order.
  const std::vector<Tensor>& tensors() const { return tensors_; }
  bool contains(const std::string& name) const { return index_.count(name) > 0; }
  // An unknown name is an error naming it and the file.
  const Tensor& tensor(const std::string& name) const;
  // The tensor dequantized to fp32, in torch order.
  torch::Tensor read(const std::string& name) const;

 private:
  std::string path_;
  uint32_t version_ = 0;
  nlohmann::json metadata_;
  std::vector<Tensor> tensors_;
  std::map<std::string, size_t> index_;
};

// ---- export and weight sync --------------------------------------------------------------------

// How a Hugging Face-style folder names its files: transformers' layout by default, diffusers'
// with weights_stem "diffusion_pytorch_model", single_file_unindexed and no config_torch_dtype.
struct HfLayout {
  // `<weights_stem>-0000k-of-0000n.safetensors` with `<weights_stem>.safetensors.index.json`.
  std::string weights_stem = "model";
  // What fits one file is written as `<weights_stem>.safetensors` alone, without an index.
  bool single_file_unindexed = false;
  // config.json gets transformers' `torch_dtype` field.
  bool config_torch_dtype = true;
};

struct ExportOptions {
  torch::ScalarType dtype = torch::kBFloat16;
  int64_t max_shard_bytes = int64_t{5} << 30;  // a tensor larger than this gets a file alone
  std::string prefix;                          // prepended to every tensor name
  // The checkpoint tensors to write (all when unset), e.g. all but LoRA adapters.
  std::function<bool(const std::string& name)> select;
  // Applied to each full tensor (fp32 or its saved dtype) before the cast to `dtype`, e.g. to fold
  // an adapter into its base weight.
  std::function<torch::Tensor(const std::string& name, const torch::Tensor& full)> transform;
  HfLayout layout;
  // Tensors the checkpoint does not hold that the folder's loader expects (e.g. a fixed buffer it
  // keeps in its state dict), written after the checkpoint's own, cast to `dtype`.
  std::vector<std::pair<std::string, torch::Tensor>> extra_tensors;
};

// One tensor of a Hugging Face model folder, as planned before any data is read.
struct HfTensorPlan {
  std::string name;
  std::vector<int64_t> shape;
};

// Writes a Hugging Face model folder: `model-0000k-of-0000n.safetensors` (a new file once one
// would pass max_shard_bytes), `model.safetensors.index.json` and `config.json` (`config` with
// `torch_dtype` set to `dtype`), the names as `layout` says. `read(i)` gives tensor i of
// `tensors`, called once each in order; each is cast to `dtype` and released before the next.
// Returns the files written.
std::vector<std::string> write_hf(const std::string& out_dir,
                                  const std::vector<HfTensorPlan>& tensors,
                                  const std::function<torch::Tensor(size_t index)>& read,
                                  nlohmann::json config, torch::ScalarType dtype,
                                  int64_t max_shard_bytes = int64_t{5} << 30,
                                  const HfLayout& layout = {});

// Writes Hugging Face-style `model-0000k-of-0000n.safetensors`, `model.safetensors.index.json`
// and `config.json` from a sharded checkpoint, reading one tensor at a time. config.json is the
// checkpoint's extra["config"] (which the trainer's checkpoints carry: Hugging Face's config for
// llama / qwen2) with `torch_dtype` set to the exported dtype; a checkpoint without one is an
// error, since nothing could load the export. options.layout and options.extra_tensors make other
// libraries' folders (convert::export_model says which a model family needs). Returns the files
// written.
std::vector<std::string> export_hf(const std::string& ckpt_dir, const std::string& out_dir,
                                   const ExportOptions& options = {});

// Collective. Initialises the shards from Hugging Face-style safetensors (a directory with
// model.safetensors.index.json or model.safetensors, or one .safetensors file; tensors named
// prefix + parameter name): the
// first rank of each shard group reads one tensor at a time and broadcasts it; every rank keeps its
// rows. At most one full tensor is held per rank. Optimizer and RNG are left alone. With `select`,
// only the params it accepts are loaded (it must answer the same on every rank), e.g. all but
// LoRA adapters; the others are left as they are. Params built under fsdp::EmptyInit count as
// loaded afterwards.
void load_hf(const std::string& hf_dir, fsdp::FSDPModule& model, const std::string& prefix = "",
             const std::function<bool(const std::string& name)>& select = nullptr);

// Collective. As load_hf, for initialising from a full model without any other rank holding a
// full tensor: only the first rank of each shard group reads (one tensor at a time) and sends every
// other rank just its rows, as one shard-sized broadcast per rank, received into the shard itself.
// The other ranks hold their shards plus one shard-sized buffer; build the model under
// fsdp::EmptyInit so that constructing it allocates nothing unsharded either.
void load_hf_from_rank0(const std::string& hf_dir, fsdp::FSDPModule& model,
                        const std::string& prefix = "",
                        const std::function<bool(const std::string& name)>& select = nullptr);

// Collective over model.mesh()'s shard group. Calls `callback(prefix + name, full tensor)` for
// every parameter (or those `select` accepts; it must answer the same on every rank), in the
// model's order, gathered in `dtype`: a large one alone, small ones (shards up to 1 MiB) up to
// 16 MiB a collective. The tensor is released after the callback returns, and the shards, grads
// and optimizer are left untouched.
void for_each_full_parameter(
    const fsdp::FSDPModule& model, torch::ScalarType dtype, const std::string& prefix,
    const std::function<void(const std::string& name, const torch::Tensor& tensor)>& callback,
    const std::function<bool(const std::string& name)>& select = nullptr);

}  // namespace shardrl::checkpoint
