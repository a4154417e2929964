// The `shardrl` command line.
#include <CLI/CLI.hpp>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "shardrl/checkpoint.h"
#include "shardrl/fsdp.h"
#include "shardrl/launcher.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/sampling.h"
#include "shardrl/trainer.h"

namespace {

// `shardrl inspect CKPT`: what a checkpoint holds and whether its files are intact.
int inspect(const std::string& dir) {
  namespace ckpt = shardrl::checkpoint;
  const auto index = ckpt::read_index(dir);
  std::cout << fmt::format("checkpoint {}\nstep {}\nworld size {} (shard {} x replicate {})\n", dir,
                           index["step"].get<int64_t>(), index["world_size"].get<int>(),
                           index.value("shard_size", 0), index.value("replicate_size", 0));
  if (!index["scheduler"].is_null())
    std::cout << fmt::format("lr scheduler step {}\n", index["scheduler"]["last_step"].dump());
  int64_t params = 0;
  std::cout << "tensors:\n";
  for (const auto& [name, entry] : index["model"].items()) {
    int64_t numel = 1;
    for (const auto& d : entry["shape"]) numel *= d.get<int64_t>();
    params += numel;
    std::cout << fmt::format("  {} {} {} ({} shards)\n", name, entry["dtype"].get<std::string>(),
                             entry["shape"].dump(), entry["shards"].size());
  }
  std::cout << fmt::format("{} tensors, {} parameters, {} with optimizer state\n",
                           index["model"].size(), params, index["optimizer"]["state"].size());
  bool all_ok = true;
  int64_t bytes = 0;
  std::cout << "files:\n";
  for (const auto& f : ckpt::verify(dir)) {
    all_ok &= f.ok;
    bytes += std::max<int64_t>(f.bytes, 0);
    std::cout << fmt::format("  {} {} bytes: {}\n", f.file, f.expected_bytes,
                             f.ok ? "ok" : f.problem);
  }
  std::cout << fmt::format("{} bytes in files; checksums {}\n", bytes, all_ok ? "ok" : "FAILED");
  return all_ok ? 0 : 1;
}

struct GenerateOptions {
  std::string model_dir, adapter_dir, token_ids, logits_out;
  int64_t max_new_tokens = 32;
  int64_t eos_token_id = -2;  // -2: config.json's eos_token_id, or none
};

std::vector<int64_t> parse_token_ids(const std::string& csv) {
  std::vector<int64_t> ids;
  std::stringstream in(csv);
  for (std::string item; std::getline(in, item, ',');) {
    size_t used = 0;
    int64_t id = -1;
    try {
      id = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != item.size() || id < 0) {
      throw std::invalid_argument(fmt::format("--token-ids: '{}' is not a token id", item));
    }
    ids.push_back(id);
  }
  if (ids.empty()) throw std::invalid_argument("--token-ids: no ids given");
  return ids;
}

// `shardrl generate MODEL_DIR`: greedy continuation of a prompt by a Hugging Face-layout LLaMA /
// Qwen2 directory (an export, or transformers' save_pretrained), with a PEFT adapter on top if
// given; prints the new token ids. --logits-out writes the prompt's fp32 logits [1, T, vocab] as
// safetensors ("logits"), for comparison with another implementation.
int generate(const GenerateOptions& o) {
  namespace models = shardrl::models;
  torch::NoGradGuard no_grad;
  auto model = models::load_llama(o.model_dir);
  if (!o.adapter_dir.empty()) models::lora::load_peft_adapter(*model, o.adapter_dir);
  model->eval();
  const auto ids = parse_token_ids(o.token_ids);
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= model->config().vocab_size) {
      throw std::invalid_argument(
          fmt::format("--token-ids: id {} at position {} is outside the "
                      "vocabulary ({} tokens)",
                      ids[i], i, model->config().vocab_size));
    }
  }
  const torch::Tensor prompt = torch::tensor(ids, torch::kLong).unsqueeze(0);
  if (!o.logits_out.empty()) {
    const torch::Tensor logits = model(prompt).to(torch::kFloat).contiguous();
    shardrl::checkpoint::SafetensorsWriter writer(
        o.logits_out, {{"logits", torch::kFloat, logits.sizes().vec()}}, {{"format", "pt"}});
    writer.write("logits", logits);
    writer.close();
  }
  int64_t eos = o.eos_token_id;
  if (eos == -2) {
    const auto config =
        nlohmann::json::parse(std::ifstream(std::filesystem::path(o.model_dir) / "config.json"));
    eos = config.contains("eos_token_id") && config["eos_token_id"].is_number_integer()
              ? config["eos_token_id"].get<int64_t>()
              : -1;
  }
  models::SamplingOptions sampling;
  sampling.max_new_tokens = o.max_new_tokens;
  sampling.eos_token_id = eos;
  const torch::Tensor responses = models::sample(model, prompt, sampling).responses;
  std::string out;
  for (int64_t i = 0; i < responses.size(1); ++i) {
    const int64_t id = responses[0][i].item<int64_t>();
    out += (out.empty() ? "" : " ") + std::to_string(id);
    if (id == eos) break;
  }
  std::cout << out << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL: fully sharded data-parallel training and RL post-training in C++"};
  app.require_subcommand(1);

  shardrl::dist::LaunchOptions launch;
  auto* launch_cmd = app.add_subcommand(
      "launch", "Start N local ranks of a command with the torchrun environment");
  launch_cmd->add_option("-n,--nproc-per-node", launch.nproc, "Ranks to start")
      ->required()
      ->check(CLI::PositiveNumber);
  launch_cmd
      ->add_option("--master-port", launch.master_port, "Rendezvous port (default: a free one)")
      ->check(CLI::Range(0, 65535));
  launch_cmd->add_option("--master-addr", launch.master_addr, "Rendezvous address");
  launch_cmd->add_option("--threads", launch.threads_per_rank,
                         "Compute threads per rank (default: cores / N, or OMP_NUM_THREADS)");
  launch_cmd->add_option("--grace", launch.grace_seconds,
                         "Seconds the other ranks get to report after one fails");
  launch_cmd->add_option("command", launch.command, "Command to run on every rank (after --)")
      ->required();

  std::string ckpt_dir, export_dir, export_dtype = "bf16", adapter, merge_adapter;
  int64_t max_shard_bytes = int64_t{5} << 30;
  auto* export_cmd = app.add_subcommand(
      "export", "Write a sharded checkpoint as Hugging Face-style safetensors shards");
  export_cmd->add_option("checkpoint", ckpt_dir, "Checkpoint directory (global_step_N)")
      ->required();
  export_cmd->add_option("out", export_dir, "Output directory")->required();
  export_cmd->add_option("--dtype", export_dtype, "bf16 or fp32 (also fp16)");
  export_cmd->add_option("--max-shard-size", max_shard_bytes, "Bytes per output file at most")
      ->check(CLI::PositiveNumber);
  export_cmd->add_option("--adapter", adapter,
                         "Export only this LoRA adapter, as PEFT's adapter_model.safetensors and "
                         "adapter_config.json (fp32 unless --dtype is given)");
  export_cmd
      ->add_option("--merge-adapter", merge_adapter,
                   "Fold this LoRA adapter into the base weights (without it, adapters are left "
                   "out and the base model is exported)")
      ->excludes("--adapter");
  auto* inspect_cmd = app.add_subcommand(
      "inspect", "Print a checkpoint's step, world size, tensors and checksum status");
  inspect_cmd->add_option("checkpoint", ckpt_dir, "Checkpoint directory (global_step_N)")
      ->required();

  GenerateOptions gen;
  auto* generate_cmd = app.add_subcommand(
      "generate", "Continue a prompt greedily with a Hugging Face-layout LLaMA / Qwen2 directory");
  generate_cmd->add_option("model", gen.model_dir, "Model directory (config.json + safetensors)")
      ->required()
      ->check(CLI::ExistingDirectory);
  generate_cmd->add_option("--adapter", gen.adapter_dir, "PEFT LoRA adapter directory")
      ->check(CLI::ExistingDirectory);
  generate_cmd->add_option("--token-ids", gen.token_ids, "Prompt token ids, comma-separated")
      ->required();
  generate_cmd->add_option("--max-new-tokens", gen.max_new_tokens, "Tokens to generate at most")
      ->check(CLI::NonNegativeNumber);
  generate_cmd->add_option("--eos-token-id", gen.eos_token_id,
                           "Stop at this id (default: config.json's eos_token_id)");
  generate_cmd->add_option("--logits-out", gen.logits_out,
                           "Write the prompt's fp32 logits here (safetensors, tensor 'logits')");

  std::string train_config;
  std::vector<std::string> train_overrides;
  auto* train_cmd = app.add_subcommand(
      "train", "Run a training task from a YAML config, e.g. the Flow-GRPO demo");
  train_cmd->add_option("config", train_config, "YAML config file")->required();
  train_cmd->add_option("overrides", train_overrides, "dotted.key=value overrides");

  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand(train_cmd)) {
      return shardrl::trainer::train_main(train_config, train_overrides,
                                          std::filesystem::read_symlink("/proc/self/exe"));
    }
    if (app.got_subcommand(launch_cmd)) return shardrl::dist::launch(launch);
    if (app.got_subcommand(inspect_cmd)) return inspect(ckpt_dir);
    if (app.got_subcommand(generate_cmd)) return generate(gen);
    if (app.got_subcommand(export_cmd) && !adapter.empty()) {
      const auto dtype = export_cmd->count("--dtype") > 0
                             ? shardrl::fsdp::parse_dtype(export_dtype, "--dtype")
                             : torch::kFloat;
      for (const auto& file :
           shardrl::models::lora::export_peft_adapter(ckpt_dir, export_dir, adapter, dtype))
        std::cout << file << "\n";
      return 0;
    }
    if (app.got_subcommand(export_cmd)) {
      shardrl::checkpoint::ExportOptions options;
      options.dtype = shardrl::fsdp::parse_dtype(export_dtype, "--dtype");
      options.max_shard_bytes = max_shard_bytes;
      for (const auto& file :
           shardrl::models::lora::export_base(ckpt_dir, export_dir, merge_adapter, options))
        std::cout << file << "\n";
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "shardrl: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
