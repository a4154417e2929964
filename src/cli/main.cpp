// The `shardrl` command line.
#include <CLI/CLI.hpp>

#include <fmt/format.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include "shardrl/checkpoint.h"
#include "shardrl/convert/export_model.h"
#include "shardrl/convert/gguf_import.h"
#include "shardrl/fsdp.h"
#include "shardrl/launcher.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/lora.h"
#include "shardrl/rollout/sampling.h"
#include "shardrl/text/bpe_tokenizer.h"
#include "shardrl/text/chat_template.h"
#include "shardrl/trainer.h"

namespace {

// `shardrl inspect CKPT`: what a checkpoint holds and whether its files are intact. Exits 1 on any
// damage, naming it: the index (missing, not JSON, not matching its checksum) or a file it lists.
int inspect(const std::string& dir) {
  namespace ckpt = shardrl::checkpoint;
  nlohmann::json index;
  try {
    index = ckpt::read_index(dir);
  } catch (const std::exception& e) {
    std::cout << fmt::format("checkpoint {}\nindex: {}\nchecksums FAILED\n", dir, e.what());
    return 1;
  }
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
  // Version 1 indexes predate index.json.crc32.
  std::cout << fmt::format("  index.json: {}\n", index.value("version", 0) >= 2
                                                     ? "ok (index.json.crc32)"
                                                     : "not covered (saved before checksums)");
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
  std::string prompt, chat, system;  // text prompts, tokenized by the model's tokenizer.json
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

nlohmann::json read_json_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(fmt::format("{}: cannot be read", path.string()));
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(fmt::format("{}: not valid JSON: {}", path.string(), e.what()));
  }
}

// `shardrl generate MODEL_DIR`: greedy continuation of a prompt by a Hugging Face-layout LLaMA /
// Qwen2 directory (an export, an import, or transformers' save_pretrained), with a PEFT adapter on
// top if given. The prompt is token ids (the new ids are printed) or text: --prompt as it is,
// --chat as a user turn in the model's chat template, tokenized by the directory's tokenizer.json
// (the new text is printed). --logits-out writes the prompt's fp32 logits [1, T, vocab] as
// safetensors ("logits"), for comparison with another implementation.
int generate(const GenerateOptions& o) {
  namespace models = shardrl::models;
  namespace text = shardrl::text;
  namespace rollout = shardrl::rollout;
  const std::filesystem::path dir(o.model_dir);
  std::optional<text::ByteLevelBpeTokenizer> tokenizer;
  std::vector<int64_t> ids;
  if (o.token_ids.empty() && o.prompt.empty() && o.chat.empty()) {
    throw std::invalid_argument("generate: give the prompt as --token-ids, --prompt or --chat");
  }
  if (!o.token_ids.empty()) {
    ids = parse_token_ids(o.token_ids);
  } else {
    tokenizer = text::ByteLevelBpeTokenizer::load_tokenizer_json((dir / "tokenizer.json").string());
    std::string prompt = o.prompt;
    if (!o.chat.empty()) {
      std::vector<text::ChatMessage> messages;
      if (!o.system.empty()) messages.push_back({"system", o.system});
      messages.push_back({"user", o.chat});
      prompt = text::ChatTemplate::from_model_dir(o.model_dir)
                   .render(messages, /*add_generation_prompt=*/true);
    }
    ids = tokenizer->encode(prompt);
    if (ids.empty()) throw std::invalid_argument("the prompt has no tokens");
  }

  torch::NoGradGuard no_grad;
  auto model = models::load_llama(o.model_dir);
  if (!o.adapter_dir.empty()) models::lora::load_peft_adapter(*model, o.adapter_dir);
  model->eval();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] >= model->config().vocab_size) {
      throw std::invalid_argument(
          fmt::format("prompt: token id {} at position {} is outside the vocabulary ({} tokens)",
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
    const auto config = read_json_file(dir / "config.json");
    eos = config.contains("eos_token_id") && config["eos_token_id"].is_number_integer()
              ? config["eos_token_id"].get<int64_t>()
              : -1;
  }
  rollout::SamplingOptions sampling;
  sampling.max_new_tokens = o.max_new_tokens;
  sampling.eos_token_id = eos;
  const torch::Tensor responses = rollout::sample(model, prompt, sampling).responses;
  std::vector<int64_t> generated;
  for (int64_t i = 0; i < responses.size(1); ++i) {
    generated.push_back(responses[0][i].item<int64_t>());
    if (generated.back() == eos) break;
  }
  if (tokenizer) {
    std::cout << tokenizer->decode(generated, /*skip_special_tokens=*/true) << "\n";
  } else {
    std::string out;
    for (int64_t id : generated) out += (out.empty() ? "" : " ") + std::to_string(id);
    std::cout << out << "\n";
  }
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
      "export",
      "Write a sharded checkpoint as Hugging Face-style safetensors shards (an SD3 checkpoint as "
      "a diffusers folder)");
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
  auto* token_ids_opt =
      generate_cmd->add_option("--token-ids", gen.token_ids, "Prompt token ids, comma-separated");
  auto* prompt_opt =
      generate_cmd->add_option("--prompt", gen.prompt, "Prompt text (needs tokenizer.json)");
  auto* chat_opt = generate_cmd->add_option(
      "--chat", gen.chat, "A user message, in the model's chat template (needs tokenizer.json)");
  generate_cmd->add_option("--system", gen.system, "A system message for --chat")->needs(chat_opt);
  token_ids_opt->excludes(prompt_opt)->excludes(chat_opt);
  prompt_opt->excludes(chat_opt);
  generate_cmd->add_option("--max-new-tokens", gen.max_new_tokens, "Tokens to generate at most")
      ->check(CLI::NonNegativeNumber);
  generate_cmd->add_option("--eos-token-id", gen.eos_token_id,
                           "Stop at this id (default: config.json's eos_token_id)");
  generate_cmd->add_option("--logits-out", gen.logits_out,
                           "Write the prompt's fp32 logits here (safetensors, tensor 'logits')");

  std::string gguf_path, import_dir, import_dtype = "fp32";
  auto* import_cmd =
      app.add_subcommand("import",
                         "Convert a llama.cpp GGUF model into a Hugging Face folder (safetensors, "
                         "config.json, tokenizer.json)");
  import_cmd->add_option("gguf", gguf_path, "GGUF file")->required()->check(CLI::ExistingFile);
  import_cmd->add_option("out", import_dir, "Output directory")->required();
  import_cmd->add_option("--dtype", import_dtype, "fp32 (default), bf16 or fp16");

  std::string train_config;
  std::vector<std::string> train_overrides;
  auto* train_cmd = app.add_subcommand(
      "train", "Run a training task from a YAML config, e.g. the Flow-GRPO demo");
  train_cmd->add_option("config", train_config, "YAML config file")->required();
  train_cmd->add_option("overrides", train_overrides, "dotted.key=value overrides");

  std::string config_task;
  bool config_list = false, config_markdown = false;
  auto* config_cmd = app.add_subcommand(
      "config",
      "Print every config key of a task with its default and what it does, as YAML (a config to "
      "start from)");
  auto* config_task_opt = config_cmd->add_option("task", config_task, "The task (trainer.task)");
  auto* config_list_opt = config_cmd->add_flag("--list", config_list, "List the tasks");
  auto* config_markdown_opt = config_cmd->add_flag(
      "--markdown", config_markdown, "Every task's keys as markdown tables (docs/config.md)");
  config_task_opt->excludes(config_list_opt)->excludes(config_markdown_opt);
  config_list_opt->excludes(config_markdown_opt);

  std::string plan_config, plan_device;
  std::vector<std::string> plan_overrides;
  double plan_memory_gb = 0;
  bool plan_json = false;
  auto* plan_cmd = app.add_subcommand(
      "plan",
      "Print a training config's memory plan (per rank: params, grads, optimizer state, gathered "
      "units, activations, rollout, and the tier of each) without running it; exits 1 when it "
      "does not fit, naming the settings that would make it fit");
  plan_cmd->add_option("config", plan_config, "YAML config file")->required();
  plan_cmd->add_option("overrides", plan_overrides,
                       "dotted.key=value overrides (trainer.nnodes, trainer.n_gpus_per_node, ...)");
  plan_cmd->add_option("--device", plan_device, "cpu or cuda (default: cuda when a GPU is visible)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  plan_cmd
      ->add_option("--memory-gb", plan_memory_gb,
                   "Memory to fit in, GB: a host's on cpu, a GPU's on cuda (default: this host's "
                   "available memory on cpu, no check on cuda)")
      ->check(CLI::PositiveNumber);
  plan_cmd->add_flag("--json", plan_json, "Print the plan as JSON");

  CLI11_PARSE(app, argc, argv);
  try {
    if (app.got_subcommand(train_cmd)) {
      return shardrl::trainer::train_main(train_config, train_overrides,
                                          std::filesystem::read_symlink("/proc/self/exe"));
    }
    if (app.got_subcommand(config_cmd)) {
      if (config_task.empty() && !config_list && !config_markdown) {
        std::cerr << "shardrl config: name a task, or --list them\n";
        return 2;
      }
      return shardrl::trainer::config_main(config_task, config_list, config_markdown);
    }
    if (app.got_subcommand(plan_cmd)) {
      shardrl::trainer::PlanOptions options;
      if (!plan_device.empty()) {
        options.device = plan_device == "cuda" ? torch::kCUDA : torch::kCPU;
      }
      options.capacity_bytes = static_cast<int64_t>(plan_memory_gb * 1e9);
      options.json = plan_json;
      return shardrl::trainer::plan_main(plan_config, plan_overrides, options);
    }
    if (app.got_subcommand(launch_cmd)) return shardrl::dist::launch(launch);
    if (app.got_subcommand(inspect_cmd)) return inspect(ckpt_dir);
    if (app.got_subcommand(generate_cmd)) return generate(gen);
    if (app.got_subcommand(import_cmd)) {
      for (const auto& file : shardrl::convert::import_gguf(
               gguf_path, import_dir, shardrl::fsdp::parse_dtype(import_dtype, "--dtype")))
        std::cout << file << "\n";
      return 0;
    }
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
           shardrl::convert::export_model(ckpt_dir, export_dir, merge_adapter, options))
        std::cout << file << "\n";
      return 0;
    }
  } catch (const std::exception& e) {
    std::cerr << "shardrl: " << e.what() << "\n";
    return 2;
  }
  return 0;
}
