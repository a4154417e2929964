// Task "lm_grpo": GRPO for a LLaMA-style decoder on a verifiable task (arithmetic), in one of two
// settings:
//   - a model trained here (actor_rollout_ref.model.path empty): a short supervised stage on
//     "3+4=7\n" strings over a 15-character vocabulary teaches the format first (cached);
//   - a pretrained chat model (model.path: a Hugging Face directory, e.g. `shardrl import` of
//     SmolLM2): its tokenizer.json and chat template pose "What is 23 + 19?" as a user turn, and
//     the last integer of its answer is scored.
// Each RL step syncs the actor's weights into an unsharded rollout replica (with LoRA, the
// frozen base once and then the adapter alone, as verl loads a LoRA into vLLM), samples rollout.n
// answers per prompt with its KV cache (each prompt prefilled once, left-padded, temperature,
// top-p), scores them exactly, and takes one GRPO step: group-normalised outcome advantages, the
// PPO dual-clip loss, optionally a KL to the reference. rollout.dtype float16 packs the replica's
// weights into fbgemm's fp16 GEMM (with LoRA, the frozen base once; the adapter path stays fp32,
// unmerged): the samples then come from a policy a rounding away from the actor's, so the old
// log-probs are the actor's own (the step is on-policy: one optimizer step per batch, so they are
// its current log-probs, detached, as verl's actor takes them when on-policy) and the rollout's
// log-probs only measure the mismatch (rollout_probs_diff_mean, verl's metric). Held-out problems
// (data.val_size) are answered greedily before training, every trainer.test_freq steps and at the
// end.
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>

#include "config_table.h"
#include "shardrl/algos.h"
#include "shardrl/algos/arithmetic.h"
#include "shardrl/models/llama.h"
#include "shardrl/progress.h"
#include "shardrl/rollout/packed_linear.h"
#include "shardrl/rollout/sampling.h"
#include "shardrl/text/bpe_tokenizer.h"
#include "shardrl/text/chat_template.h"
#include "tasks.h"

namespace shardrl::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// The task's strings need only these characters; '\n' ends an answer (the eos token).
const std::string kVocab = "0123456789+-*=\n";
constexpr int64_t kEos = 14;

torch::Tensor encode(const std::vector<std::string>& texts) {
  const auto width = static_cast<int64_t>(texts.front().size());
  auto out = torch::full({static_cast<int64_t>(texts.size()), width}, kEos, torch::kLong);
  auto a = out.accessor<int64_t, 2>();
  for (size_t i = 0; i < texts.size(); ++i) {
    TORCH_CHECK(static_cast<int64_t>(texts[i].size()) <= width, "lm_grpo: ragged prompts");
    for (size_t k = 0; k < texts[i].size(); ++k) {
      const auto id = kVocab.find(texts[i][k]);
      TORCH_CHECK(id != std::string::npos, "lm_grpo: character '", texts[i][k],
                  "' is not in the task's vocabulary");
      a[i][k] = static_cast<int64_t>(id);
    }
  }
  return out;
}

std::string decode(const torch::Tensor& ids, const torch::Tensor& mask) {
  std::string s;
  for (int64_t k = 0; k < ids.size(0); ++k) {
    if (mask[k].item<float>() == 0) break;
    s += kVocab[ids[k].item<int64_t>()];
  }
  return s;
}

algos::ArithmeticTaskConfig task_config(const json& config) {
  algos::ArithmeticTaskConfig task;
  task.digits = get<int>(config, "data.digits");
  task.operators = get<std::string>(config, "data.operators");
  task.validate();
  return task;
}

json llama_json(const json& config) {
  json model = at(config, "actor_rollout_ref.model.config");
  model["vocab_size"] = static_cast<int64_t>(kVocab.size());
  return model;
}

// The supervised stage: prompt + answer + eos, padded with eos, next-token loss on all of it.
std::string supervised_stage(const json& config, const std::shared_ptr<dist::World>& world) {
  const auto steps = get<int64_t>(config, "sft.steps");
  const auto batch = get<int64_t>(config, "sft.batch_size");
  const auto seed = get<int64_t>(config, "trainer.seed");
  const auto task = task_config(config);
  std::string cache = get<std::string>(config, "sft.cache_dir");
  if (cache.empty()) cache = get<std::string>(config, "trainer.default_local_dir") + "/cache";
  const auto model = llama_json(config);
  // Keyed by the whole model config too (model_type, tied embeddings, ...), not only its size.
  const std::string dir =
      fmt::format("{}/sft-{}-{}-d{}-{}-n{}-b{}-seed{}-{:08x}", cache, model.value("hidden_size", 0),
                  model.value("num_hidden_layers", 0), task.digits, task.operators, steps, batch,
                  seed, std::hash<std::string>{}(model.dump()) & 0xffffffffu);
  const bool lead = world->rank() == 0;
  if (fs::exists(dir + "/model.safetensors")) {
    if (lead) std::cout << "supervised stage: cached " << dir << "\n" << std::flush;
    return dir;
  }
  json sft = config;
  sft["actor_rollout_ref"]["model"]["config"] = model;
  sft["actor_rollout_ref"]["model"]["lora_rank"] = 0;
  sft["actor_rollout_ref"]["actor"]["optim"]["loraplus_lr_ratio"] = nullptr;  // no adapters here
  sft["actor_rollout_ref"]["actor"]["optim"]["lr"] = get<double>(config, "sft.lr");
  sft["trainer"]["total_training_steps"] = steps;
  torch::manual_seed(seed);
  auto engine =
      engine::EngineRegistry::create(engine_config(sft, "language_model", "actor"), world);
  const int64_t local = batch / engine->data_parallel_size();
  const auto width = algos::make_arithmetic_problems(task, 1, 0).front().prompt.size() +
                     static_cast<size_t>(2 * task.digits + 2);
  Progress progress("supervised stage", steps, {.unit = "steps", .enabled = lead});
  RecentMean loss;
  for (int64_t step = 1; step <= steps; ++step) {
    std::vector<std::string> texts;
    for (const auto& p : algos::make_arithmetic_problems(task, batch, seed * 7919 + step)) {
      std::string text = p.prompt + p.answer;
      text.resize(width, '\n');
      texts.push_back(text);
    }
    auto data = engine::slice_batch({{"tokens", encode(texts)}},
                                    engine->data_parallel_rank() * local, local);
    auto metrics = engine->train_batch(data, next_token_loss);
    loss.add(metrics["loss"]);
    progress.update(step, fmt::format("loss {:.4f}", loss.mean()));
  }
  progress.finish();
  if (lead) {
    std::cout << fmt::format(
                     "supervised stage: {} steps, final loss {:.4f} (mean of the last {})\n", steps,
                     loss.mean(), loss.count())
              << std::flush;
  }
  auto params = engine->fsdp().full_parameters();
  if (lead) {
    models::save_llama(params, models::LlamaConfig::from_json(model), dir + ".tmp");
    fs::remove_all(dir);
    fs::rename(dir + ".tmp", dir);
  }
  world->group().barrier();
  return dir;
}

// How the task's text meets the model's tokens.
class TaskText {
 public:
  virtual ~TaskText() = default;
  // Token ids [B, P], left-padded, and their attention mask [B, P] (undefined: no padding).
  virtual std::pair<torch::Tensor, torch::Tensor> prompts(
      const std::vector<algos::ArithmeticProblem>& problems) const = 0;
  // A response's text: its tokens under the response mask.
  virtual std::string response(const torch::Tensor& ids, const torch::Tensor& mask) const = 0;
  // The prompt's text as the model reads it, special tokens left out (verl's "input").
  virtual std::string prompt(const algos::ArithmeticProblem& problem) const = 0;
  virtual algos::AnswerAt answer_at() const = 0;
  int64_t eos = -1, pad = -1;
};

// The model trained here: its 15-character vocabulary, operands zero-padded to one width.
class CharacterText : public TaskText {
 public:
  CharacterText() { eos = pad = kEos; }
  std::pair<torch::Tensor, torch::Tensor> prompts(
      const std::vector<algos::ArithmeticProblem>& problems) const override {
    std::vector<std::string> texts;
    for (const auto& p : problems) texts.push_back(p.prompt);
    return {encode(texts), torch::Tensor()};
  }
  std::string response(const torch::Tensor& ids, const torch::Tensor& mask) const override {
    return decode(ids, mask);
  }
  std::string prompt(const algos::ArithmeticProblem& problem) const override {
    return problem.prompt;
  }
  algos::AnswerAt answer_at() const override { return algos::AnswerAt::kStart; }
};

// A pretrained chat model: "23+19=" becomes the user turn "What is 23 + 19?" in its chat
// template, tokenized by its tokenizer.json; the turn ends at its eos (SmolLM2's <|im_end|>).
class ChatText : public TaskText {
 public:
  ChatText(const std::string& dir, const models::LlamaConfig& model, int64_t prompt_length)
      : tokenizer_(text::ByteLevelBpeTokenizer::load_tokenizer_json(dir + "/tokenizer.json")),
        chat_(text::ChatTemplate::from_model_dir(dir)),
        prompt_length_(prompt_length) {
    // The ids as transformers finds them: generation_config.json, config.json, then the
    // tokenizer_config.json's token strings.
    const auto id_of = [&](const char* id_key, const char* token_key) -> int64_t {
      for (const char* file : {"generation_config.json", "config.json"}) {
        const json j = json::parse(std::ifstream(dir + "/" + file), nullptr, false);
        if (j.is_object() && j.contains(id_key) && j[id_key].is_number_integer()) {
          return j[id_key].get<int64_t>();
        }
      }
      const json j = json::parse(std::ifstream(dir + "/tokenizer_config.json"), nullptr, false);
      return j.is_object() && j.contains(token_key) && j[token_key].is_string()
                 ? tokenizer_.token_to_id(j[token_key].get<std::string>())
                 : -1;
    };
    eos = id_of("eos_token_id", "eos_token");
    if (eos < 0 || eos >= model.vocab_size) {
      throw std::invalid_argument(fmt::format(
          "config key 'actor_rollout_ref.model.path': {} names no eos token in the vocabulary "
          "(generation_config.json, config.json or tokenizer_config.json); a chat turn must end",
          dir));
    }
    pad = id_of("pad_token_id", "pad_token");
    if (pad < 0 || pad >= model.vocab_size) pad = eos;
  }

  std::pair<torch::Tensor, torch::Tensor> prompts(
      const std::vector<algos::ArithmeticProblem>& problems) const override {
    std::vector<std::vector<int64_t>> rows;
    size_t width = 0;
    for (const auto& p : problems) {
      rows.push_back(tokens(p));
      if (static_cast<int64_t>(rows.back().size()) > prompt_length_) {
        throw std::invalid_argument(fmt::format(
            "config key 'actor_rollout_ref.rollout.prompt_length' ({}) is shorter than the "
            "prompt of \"{}\" ({} tokens)",
            prompt_length_, question(p), rows.back().size()));
      }
      width = std::max(width, rows.back().size());
    }
    const auto n = static_cast<int64_t>(rows.size());
    auto tokens = torch::full({n, static_cast<int64_t>(width)}, pad, torch::kLong);
    auto mask = torch::zeros({n, static_cast<int64_t>(width)}, torch::kLong);
    for (int64_t i = 0; i < n; ++i) {
      const auto len = static_cast<int64_t>(rows[i].size());
      const auto at = static_cast<int64_t>(width) - len;
      tokens[i].narrow(0, at, len).copy_(torch::tensor(rows[i], torch::kLong));
      mask[i].narrow(0, at, len).fill_(1);
    }
    return {tokens, mask};
  }
  std::string response(const torch::Tensor& ids, const torch::Tensor& mask) const override {
    const auto length = mask.sum().item<int64_t>();
    const auto kept = ids.narrow(0, 0, length).contiguous();
    return tokenizer_.decode(
        std::vector<int64_t>(kept.data_ptr<int64_t>(), kept.data_ptr<int64_t>() + length),
        /*skip_special_tokens=*/true);
  }
  algos::AnswerAt answer_at() const override { return algos::AnswerAt::kLastInteger; }
  std::string prompt(const algos::ArithmeticProblem& problem) const override {
    return tokenizer_.decode(tokens(problem), /*skip_special_tokens=*/true);
  }

 private:
  // "23+19=" as the user's question "What is 23 + 19?".
  static std::string question(const algos::ArithmeticProblem& p) {
    const size_t op = p.prompt.find_first_of("+-*", 1);
    return fmt::format("What is {} {} {}?", p.prompt.substr(0, op), p.prompt[op],
                       p.prompt.substr(op + 1, p.prompt.size() - op - 2));
  }
  // The question as a user turn in the chat template, tokenized.
  std::vector<int64_t> tokens(const algos::ArithmeticProblem& p) const {
    return tokenizer_.encode(chat_.render({{"user", question(p)}}, true));
  }

  text::ByteLevelBpeTokenizer tokenizer_;
  text::ChatTemplate chat_;
  int64_t prompt_length_;
};

// Held-out problems and the training draws that avoid them.
class Problems {
 public:
  Problems(const algos::ArithmeticTaskConfig& task, int64_t val_size, int64_t seed)
      : task_(task), seed_(seed) {
    val_ = algos::make_arithmetic_problems(task, val_size, seed * 31337 + 17);
    for (const auto& p : val_) held_out_.insert(p.prompt);
  }
  const std::vector<algos::ArithmeticProblem>& validation() const { return val_; }
  // The step's problems, the same on every rank and in a resumed run.
  std::vector<algos::ArithmeticProblem> training(int64_t count, int64_t step) const {
    std::vector<algos::ArithmeticProblem> out;
    for (int64_t round = 0; static_cast<int64_t>(out.size()) < count; ++round) {
      if (round == 100) {
        throw std::invalid_argument(
            "config key 'data.val_size': the held-out problems leave too few to train on");
      }
      for (auto& p :
           algos::make_arithmetic_problems(task_, count, seed_ * 1000003 + step + round * 7919)) {
        if (!held_out_.count(p.prompt) && static_cast<int64_t>(out.size()) < count) {
          out.push_back(std::move(p));
        }
      }
    }
    return out;
  }

 private:
  algos::ArithmeticTaskConfig task_;
  int64_t seed_;
  std::vector<algos::ArithmeticProblem> val_;
  std::set<std::string> held_out_;
};

struct Validation {
  double accuracy = 0;                  // over every rank's share
  std::vector<nlohmann::json> samples;  // this rank's: {"input", "output", "score"}
};

// Greedy accuracy on this rank's share of the held-out problems, averaged over the ranks.
Validation validate(engine::Engine& actor, const TaskText& text, const Problems& problems,
                    int64_t response_length) {
  const auto& all = problems.validation();
  const int64_t dp = actor.data_parallel_size();
  const int64_t share = static_cast<int64_t>(all.size()) / dp;
  const std::vector<algos::ArithmeticProblem> mine(
      all.begin() + actor.data_parallel_rank() * share,
      all.begin() + (actor.data_parallel_rank() + 1) * share);
  auto [tokens, mask] = text.prompts(mine);
  rollout::SamplingOptions greedy;
  greedy.max_new_tokens = response_length;
  greedy.eos_token_id = text.eos;
  greedy.pad_token_id = text.pad;
  const auto rollout =
      rollout::sample(actor.model<models::LlamaForCausalLM>(), tokens, greedy, mask);
  Validation v;
  double correct = 0;
  for (int64_t i = 0; i < share; ++i) {
    const std::string output = text.response(rollout.responses[i], rollout.response_mask[i]);
    const double score = algos::arithmetic_reward(output, mine[i].answer, text.answer_at());
    correct += score;
    v.samples.push_back({{"input", text.prompt(mine[i])}, {"output", output}, {"score", score}});
  }
  v.accuracy =
      actor.average_over_ranks({{"accuracy", correct / static_cast<double>(share)}})["accuracy"];
  return v;
}

// `rollout` as the first rank of `group` made it (no group: as it is).
rollout::Rollout same_in_group(rollout::Rollout rollout, dist::ProcessGroup* group) {
  if (!group) return rollout;
  auto response_length = torch::tensor({rollout.responses.size(1)}, torch::kLong);
  group->broadcast(response_length, 0);
  const int64_t length = response_length.item<int64_t>();
  const int64_t rows = rollout.prompts.size(0);
  if (group->rank() != 0) {
    rollout.responses = torch::empty({rows, length}, rollout.responses.options());
    rollout.log_probs = torch::empty({rows, length}, rollout.log_probs.options());
    rollout.response_mask = torch::empty({rows, length}, rollout.response_mask.options());
  }
  for (auto* t : {&rollout.responses, &rollout.log_probs, &rollout.response_mask}) {
    group->broadcast(*t, 0);
  }
  rollout.sequences = torch::cat({rollout.prompts, rollout.responses}, 1);
  rollout.attention_mask = torch::cat({rollout.attention_mask.narrow(1, 0, rollout.prompts.size(1)),
                                       torch::ones_like(rollout.responses)},
                                      1);
  return rollout;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

PlanInput lm_grpo_plan(const json& config, const engine::Layout& layout) {
  json rl = config;
  const auto path = get<std::string>(config, "actor_rollout_ref.model.path");
  rl["actor_rollout_ref"]["model"]["config"] =
      path.empty() ? llama_json(config)
                   : models::LlamaConfig::load(path + "/config.json").to_json();
  PlanInput in{engine_config(rl, "language_model", "actor"), {}};
  auto& w = in.workload;
  const std::string r = "actor_rollout_ref.rollout.";
  const int64_t dp = layout.world_size() / ulysses_sequence_parallel_size(config, "actor");
  const int64_t rows = std::max<int64_t>(1, get<int64_t>(config, "data.train_batch_size") / dp) *
                       get<int64_t>(config, r + "n");
  const int64_t micro = in.engine.micro_batch_size_per_gpu;
  w.micro_batch_rows = micro > 0 ? std::min(micro, rows) : rows;
  w.tokens_per_row =
      get<int64_t>(config, r + "prompt_length") + get<int64_t>(config, r + "response_length");
  w.gradient_checkpointing =
      get<bool>(config, "actor_rollout_ref.model.enable_gradient_checkpointing");
  w.logits = true;
  // The actor decodes token by token: gathered once for the whole rollout, not once a token.
  w.rollout = rollout_engine(config, engine::Workload::Rollout::kActorGathered);
  w.rollout_dtype =
      get<std::string>(config, r + "dtype") == "float16" ? torch::kHalf : torch::kFloat;
  w.rollout_rows = rows;
  w.rollout_tokens = w.tokens_per_row;
  w.reference = get<bool>(config, "actor_rollout_ref.actor.use_kl_loss");
  w.reference_param_offload = get<bool>(config, "actor_rollout_ref.ref.fsdp_config.param_offload");
  return in;
}

int run_lm_grpo(const json& config, std::shared_ptr<dist::World> world) {
  const auto t0 = std::chrono::steady_clock::now();
  auto task = task_config(config);
  const auto seed = get<int64_t>(config, "trainer.seed");
  const auto prompts_global = get<int64_t>(config, "data.train_batch_size");
  const auto val_size = get<int64_t>(config, "data.val_size");
  const auto test_freq = get<int64_t>(config, "trainer.test_freq");
  const auto n = get<int64_t>(config, "actor_rollout_ref.rollout.n");
  const auto temperature = get<double>(config, "actor_rollout_ref.rollout.temperature");
  const auto response_length = get<int64_t>(config, "actor_rollout_ref.rollout.response_length");
  const std::string actor_key = "actor_rollout_ref.actor.";
  const bool use_kl_loss = get<bool>(config, actor_key + "use_kl_loss");
  const auto kl_coef = use_kl_loss ? get<double>(config, actor_key + "kl_loss_coef") : 0.0;
  const auto kl_type = get<std::string>(config, actor_key + "kl_loss_type");
  const bool norm_by_std = get<bool>(config, "algorithm.norm_adv_by_std_in_grpo");
  const bool use_remove_padding = get<bool>(config, "actor_rollout_ref.model.use_remove_padding");
  algos::PolicyLossConfig policy;
  const auto clip_ratio = get<double>(config, actor_key + "clip_ratio");
  const auto clip_or_default = [&](const std::string& key) {
    return at(config, key).is_null() ? clip_ratio : get<double>(config, key);
  };
  policy.clip_ratio_low = clip_or_default(actor_key + "clip_ratio_low");
  policy.clip_ratio_high = clip_or_default(actor_key + "clip_ratio_high");
  policy.clip_ratio_c = get<double>(config, actor_key + "clip_ratio_c");
  policy.loss_agg_mode = get<std::string>(config, actor_key + "loss_agg_mode");

  // A pretrained model brings its own config, tokenizer and chat template; otherwise the
  // supervised stage makes one.
  json rl = config;
  const std::string pretrained = get<std::string>(config, "actor_rollout_ref.model.path");
  {
    const auto model = pretrained.empty() ? models::LlamaConfig::from_json(llama_json(config))
                                          : models::LlamaConfig::load(pretrained + "/config.json");
    for (const char* role : {"actor", "ref"}) {
      check_sequence_parallel_heads(config, role, model.num_attention_heads,
                                    model.num_key_value_heads);
    }
  }
  std::unique_ptr<TaskText> text;
  if (pretrained.empty()) {
    rl["actor_rollout_ref"]["model"]["config"] = llama_json(config);
    rl["actor_rollout_ref"]["model"]["path"] = supervised_stage(config, world);
    text = std::make_unique<CharacterText>();
  } else {
    const auto model = models::LlamaConfig::load(pretrained + "/config.json");
    rl["actor_rollout_ref"]["model"]["config"] = model.to_json();
    text = std::make_unique<ChatText>(
        pretrained, model, get<int64_t>(config, "actor_rollout_ref.rollout.prompt_length"));
    task.fixed_width = false;  // "What is 7 + 35?": prompts of several lengths, left-padded
  }
  torch::manual_seed(seed + 1);
  auto actor = engine::EngineRegistry::create(engine_config(rl, "language_model", "actor"), world);
  // The reference is the starting model, frozen: a forward-only engine (no optimizer).
  std::unique_ptr<engine::Engine> ref;
  if (use_kl_loss) {
    ref = engine::EngineRegistry::create(engine_config(rl, "language_model", "ref"), world);
  }
  const int64_t dp = actor->data_parallel_size();
  if (prompts_global % dp != 0) {
    throw std::invalid_argument(fmt::format(
        "config key 'data.train_batch_size' ({}) must divide by the {} data-parallel ranks",
        prompts_global, dp));
  }
  if (val_size % dp != 0) {
    throw std::invalid_argument(fmt::format(
        "config key 'data.val_size' ({}) must divide by the {} data-parallel ranks", val_size, dp));
  }
  const int64_t local = prompts_global / dp;
  const Problems problems(task, val_size, seed);
  const auto rollout_dtype = get<std::string>(config, "actor_rollout_ref.rollout.dtype");
  const bool rollout_in_fp16 = rollout_dtype == "float16";
  // verl's rollout.name: the replica (fed by the weight sync), or the actor itself (hf).
  const bool actor_samples = rollout_engine(config, engine::Workload::Rollout::kActorGathered) !=
                             engine::Workload::Rollout::kReplica;
  if (actor_samples && rollout_in_fp16) {
    throw std::invalid_argument(
        "config key 'actor_rollout_ref.rollout.dtype' float16 packs a rollout replica's weights; "
        "with actor_rollout_ref.rollout.name=hf the actor samples in its own fp32 weights");
  }
  // The rollout replica: unsharded on every rank, so sampling runs without collectives.
  models::LlamaForCausalLM rollout_model{nullptr};
  if (!actor_samples) {
    rollout_model = models::LlamaForCausalLM(
        models::LlamaConfig::from_json(at(rl, "actor_rollout_ref.model.config")));
    for (auto& p : rollout_model->parameters()) p.set_requires_grad(false);
    rollout_model->eval();
  }
  const bool lora = get<int64_t>(config, "actor_rollout_ref.model.lora_rank") > 0;
  if (lora && !actor_samples) {
    models::lora::apply_lora(
        *rollout_model,
        models::lora::config_from_peft(actor->export_info().at("lora").at("default"),
                                       "the actor's LoRA adapter"),
        "default", /*trainable=*/false);
  }
  // With LoRA the base never changes: it is synced (and packed) once, and each later step sends
  // the adapter alone, a few MB instead of the whole model, and repacks nothing. Full fine-tuning
  // changes every weight, so each step syncs and repacks them all.
  bool base_synced = false;
  auto sync_rollout_weights = [&] {
    sync_rollout_replica(*actor, *rollout_model, "", /*trainable_only=*/base_synced);
    if (rollout_in_fp16 && !base_synced) rollout::pack_for_inference(*rollout_model, torch::kHalf);
    base_synced = lora;
  };
  const bool lead = world->rank() == 0;

  // Response tokens sampled and trained on a step, all ranks together, per second of the step.
  Run run(config, *world, {"perf/response_tokens_per_s", "response tok/s"});
  auto& data_parallel = actor->mesh().data_parallel_group();
  const int64_t first_step = run.resume(*actor) + 1;
  if (val_size > 0 && first_step == 1 && get<bool>(config, "trainer.val_before_train")) {
    const auto before = validate(*actor, *text, problems, response_length);
    run.log(0, {{"val/accuracy", before.accuracy}});
    run.log_val_generations(0, before.samples, data_parallel);
    if (lead) {
      std::cout << fmt::format("before RL: greedy accuracy on {} held-out problems {:.3f}\n",
                               val_size, before.accuracy)
                << std::flush;
    }
  }
  const auto rl_start = std::chrono::steady_clock::now();
  for (int64_t step = first_step; step <= run.total_steps(); ++step) {
    const auto start = std::chrono::steady_clock::now();
    const auto all = problems.training(prompts_global, step);
    std::vector<algos::ArithmeticProblem> mine;
    std::vector<std::string> answers;
    for (int64_t i = actor->data_parallel_rank() * local;
         i < (actor->data_parallel_rank() + 1) * local; ++i) {
      mine.push_back(all[i]);
      for (int64_t k = 0; k < n; ++k) answers.push_back(all[i].answer);
    }
    const auto sync_start = std::chrono::steady_clock::now();
    // hf: the weight sync is the all-gather of every unit, held for the whole rollout (one
    // gather, not one a token), as verl's HFRollout samples under summon_full_params.
    std::optional<fsdp::UnshardScope> gathered;
    if (actor_samples) {
      gathered.emplace(actor->fsdp());
    } else {
      sync_rollout_weights();
    }
    const double sync_seconds = seconds_since(sync_start);
    rollout::SamplingOptions sampling;
    sampling.max_new_tokens = response_length;
    sampling.temperature = temperature;
    sampling.top_p = get<double>(config, "actor_rollout_ref.rollout.top_p");
    sampling.eos_token_id = text->eos;
    sampling.pad_token_id = text->pad;
    sampling.num_return_sequences = n;  // row i * n + k: the k-th answer to prompt i
    sampling.generator = at::make_generator<at::CPUGeneratorImpl>(seed * 7777 + step * 131 +
                                                                  actor->data_parallel_rank());
    const auto [prompt_tokens, prompt_mask] = text->prompts(mine);
    // The sequence-parallel ranks of a group sample the same prompts from the same seed; the
    // group's first rank's rollout is the one all of them train on (verl hands the group one
    // batch), whatever their kernels' last bits.
    auto& sampler = actor_samples ? actor->model<models::LlamaForCausalLM>() : rollout_model;
    const auto rollout =
        same_in_group(rollout::sample(sampler, prompt_tokens, sampling, prompt_mask),
                      actor->mesh().sequence_parallel_group().get());
    gathered.reset();  // resharded before the update
    const double rollout_seconds = seconds_since(start);

    std::vector<std::string> responses;
    for (int64_t i = 0; i < rollout.responses.size(0); ++i) {
      responses.push_back(text->response(rollout.responses[i], rollout.response_mask[i]));
    }
    const auto rewards = algos::arithmetic_rewards(responses, answers, text->answer_at());
    // The outcome reward sits on each response's last token, as verl's reward manager puts it.
    auto token_rewards = torch::zeros_like(rollout.response_mask);
    const auto last = (rollout.response_mask.sum(1) - 1).clamp_min(0).to(torch::kLong);
    token_rewards.scatter_(1, last.unsqueeze(1), rewards.to(torch::kFloat).unsqueeze(1));
    std::vector<int64_t> uids;
    for (int64_t i = 0; i < rollout.responses.size(0); ++i) uids.push_back(i / n);
    engine::Batch batch{
        {"sequences", rollout.sequences},
        {"attention_mask", rollout.attention_mask},
        {"rollout_log_probs", rollout.log_probs},
        {"advantages",
         algos::grpo_outcome_advantages(token_rewards, rollout.response_mask, uids, norm_by_std)},
        {"response_mask", rollout.response_mask}};
    const int64_t prompt_length = rollout.prompts.size(1);
    const auto log_probs_of = [&](engine::Engine& e, const engine::Batch& d) {
      auto& model = e.model<models::LlamaForCausalLM>();
      return use_remove_padding
                 ? rollout::packed_response_log_probs(model, d.at("sequences"), prompt_length,
                                                      temperature, d.at("attention_mask"),
                                                      d.at("response_mask"))
                 : rollout::response_log_probs(model, d.at("sequences"), prompt_length, temperature,
                                               d.at("attention_mask"));
    };
    if (ref) {
      torch::NoGradGuard no_grad;
      batch["ref_log_probs"] = log_probs_of(*ref, batch);
    }
    const engine::LossFn grpo_loss = [&](engine::Engine& e, const engine::MicroBatch& mb) {
      const auto& d = mb.data;
      auto log_probs = log_probs_of(e, d);
      const auto& mask = d.at("response_mask");
      const auto& rollout_log_probs = d.at("rollout_log_probs");
      // fp32 rollouts came from the actor's weights: their log-probs are the old policy's.
      const auto old_log_probs = rollout_in_fp16 ? log_probs.detach() : rollout_log_probs;
      auto out =
          algos::compute_policy_loss(old_log_probs, log_probs, d.at("advantages"), mask, policy);
      auto loss = out.pg_loss;
      const auto probs_diff =
          (log_probs.detach().exp() - rollout_log_probs.exp()).abs() * (mask > 0);
      engine::Metrics metrics{
          {"pg_loss", out.pg_loss.item<double>()},
          {"clipfrac", out.pg_clipfrac.item<double>()},
          {"ppo_kl", out.ppo_kl.item<double>()},
          {"rollout_probs_diff_mean", (probs_diff.sum() / mask.sum().clamp_min(1)).item<double>()}};
      if (d.count("ref_log_probs")) {
        auto kl = algos::agg_loss(algos::kl_penalty(log_probs, d.at("ref_log_probs"), kl_type),
                                  d.at("response_mask"), policy.loss_agg_mode);
        loss = loss + kl_coef * kl;
        metrics["kl"] = kl.item<double>();
      }
      return engine::LossOutput{loss / mb.count, metrics, {}};
    };
    auto metrics = actor->train_batch(batch, grpo_loss);
    const double update_end = seconds_since(start);
    const double tokens = rollout.response_mask.sum().item<double>();
    // Every rank holds as many samples, so means of means are global means.
    auto stats = actor->average_over_ranks(
        {{"reward_mean", rewards.mean().item<double>()},
         {"reward_sq", rewards.square().mean().item<double>()},
         {"response_length", rollout.response_mask.sum(1).mean().item<double>()},
         {"response_tokens", tokens},
         {"rollout_tokens_per_s", tokens / rollout_seconds}});
    metrics["reward_mean"] = stats["reward_mean"];
    metrics["reward_std"] =
        std::sqrt(std::max(0.0, stats["reward_sq"] - stats["reward_mean"] * stats["reward_mean"]));
    metrics["response_length"] = stats["response_length"];
    // Per rank, as verl's perf/throughput is per GPU.
    metrics["perf/rollout_tokens_per_s"] = stats["rollout_tokens_per_s"];
    // Every data-parallel rank's (the mean times their count), over the rollout and the update.
    metrics["perf/response_tokens_per_s"] =
        stats["response_tokens"] * static_cast<double>(dp) / std::max(update_end, 1e-9);
    metrics["time_rollout"] = rollout_seconds;  // the weight sync included
    metrics["time_weight_sync"] = sync_seconds;
    metrics["time_update"] = update_end - rollout_seconds;
    if (run.dumps_rollouts()) {
      std::vector<nlohmann::json> samples;
      for (size_t i = 0; i < responses.size(); ++i) {
        samples.push_back({{"input", text->prompt(mine[i / n])},
                           {"output", responses[i]},
                           {"gts", answers[i]},
                           {"score", rewards[static_cast<int64_t>(i)].item<double>()}});
      }
      run.dump_rollouts(step, std::move(samples), data_parallel);
    }
    if (val_size > 0 && ((test_freq > 0 && step % test_freq == 0) || step == run.total_steps())) {
      const auto validation = validate(*actor, *text, problems, response_length);
      metrics["val/accuracy"] = validation.accuracy;
      run.log_val_generations(step, validation.samples, data_parallel);
    }
    metrics["step_time"] = seconds_since(start);
    run.after_step(*actor, step, metrics);
  }
  if (lead) {
    const auto curve = run.uses("file")
                           ? summarize_run(run.dir(), "GRPO reward (exact answer) per step")
                           : RunCurve{};
    // From metrics.jsonl, so that a run resumed in parts reports its whole span.
    json summary = {{"rl_seconds", seconds_since(rl_start)},
                    {"total_seconds", seconds_since(t0)},
                    {"rl_phase_seconds_per_step", curve.phase_seconds_per_step}};
    const auto accuracy = curve.validation.find("val/accuracy");
    std::string after;
    if (accuracy != curve.validation.end()) {
      const auto& by_step = accuracy->second;
      if (by_step.count(0)) summary["eval_accuracy_before"] = by_step.at(0);
      if (by_step.count(run.total_steps())) {
        summary["eval_accuracy_after"] = by_step.at(run.total_steps());
        after = fmt::format("after RL: greedy accuracy on held-out problems {:.3f}\n",
                            by_step.at(run.total_steps()));
      }
    }
    write_json(run.dir() + "/summary.json", summary);
    std::cout << fmt::format("{}wrote {}/{}summary.json\n", after, run.dir(),
                             run.uses("file") ? "metrics.jsonl, reward_curve.png, " : "")
              << std::flush;
  }
  world->group().barrier();
  return 0;
}

Task lm_grpo_task() {
  const std::string m = "actor_rollout_ref.model.", a = "actor_rollout_ref.actor.",
                    r = "actor_rollout_ref.rollout.";
  Task task;
  task.description =
      "GRPO for a LLaMA-style decoder on arithmetic: a model trained here after a short "
      "supervised stage, or a pretrained chat model (model.path)";
  task.keys = {
      {"trainer.log_val_generations", 0, integer().at_least(0),
       "validation answers (prompt, answer, score) logged to TensorBoard as text at each "
       "validation (with the tensorboard logger)"},
      {"data.digits", 1, integer().at_least(1).at_most(9), "digits of each operand"},
      {"data.operators", "+", text().matching("[-+*]+", "+, - and * (at least one)"),
       "the operators problems draw from"},
      {"data.train_batch_size", 16, integer().at_least(1),
       "prompts a step, all ranks together (divides by the data-parallel ranks)"},
      {"data.val_size", 0, integer().at_least(0),
       "held-out problems, never drawn for training (0: no validation)"},
      {"sft.steps", 300, integer().at_least(1),
       "steps of the supervised stage that teaches the answer format (without model.path)"},
      {"sft.batch_size", 64, integer().at_least(1), "the supervised stage's batch, all ranks"},
      {"sft.lr", 3e-3, number().at_least(0), "the supervised stage's learning rate"},
      {"sft.cache_dir", "", text(),
       "where the supervised model is cached (empty: <default_local_dir>/cache)"},
      {"algorithm.norm_adv_by_std_in_grpo", true, boolean(),
       "divide each group's advantages by its reward std (Dr. GRPO: false)"},
      {m + "use_remove_padding", false, boolean(),
       "the update and the reference pass run on packed tokens, each row's prompt and response "
       "without their padding (verl's; false: on the padded rows)"},
      {m + "path", "", text().existing_folder("config.json"),
       "a pretrained chat model: a Hugging Face folder with config.json, safetensors, "
       "tokenizer.json and a chat template (empty: train one here)"},
      {a + "clip_ratio", 0.2, number().at_least(0), "PPO's ratio clip"},
      {a + "clip_ratio_low", nullptr, number().at_least(0).or_null("clip_ratio"),
       "the ratio clip below 1"},
      {a + "clip_ratio_high", nullptr, number().at_least(0).or_null("clip_ratio"),
       "the ratio clip above 1"},
      {a + "clip_ratio_c", 3.0, number().above(1),
       "dual-clip PPO's bound on negative-advantage losses"},
      {a + "loss_agg_mode", "token-mean",
       text().one_of({"token-mean", "seq-mean-token-sum", "seq-mean-token-mean"}),
       "how token losses are averaged into the batch's"},
      {a + "use_kl_loss", false, boolean(),
       "a KL to a frozen reference model in the loss (the ref exists only then)"},
      {a + "kl_loss_coef", 0.001, number().at_least(0), "the KL loss's weight"},
      {a + "kl_loss_type", "low_var_kl",
       text().one_of({"low_var_kl", "kl", "abs", "mse"}, {"k1", "k2", "k3"}),
       "the KL estimator: kl (k1), abs, mse (k2) or low_var_kl (k3, clamped)"},
      {r + "n", 8, integer().at_least(1), "answers sampled per prompt: the GRPO group"},
      {r + "dtype", "float32", text().one_of({"float32", "float16"}),
       "the rollout replica's weights: float32, or float16 with fp32 activations (verl: "
       "bfloat16, which CPUs without bf16 arithmetic run slowly)"},
      {r + "temperature", 1.0, number().above(0), "sampling temperature"},
      {r + "top_p", 1.0, number().above(0).at_most(1), "nucleus sampling's probability mass"},
      {r + "prompt_length", 512, integer().at_least(1),
       "tokens a prompt may have (a chat model's prompt is an error beyond it)"},
      {r + "response_length", 4, integer().at_least(1), "tokens an answer may have"},
  };
  for (auto& row : rollout_task_keys()) task.keys.push_back(std::move(row));
  task.defaults = {
      {"trainer.experiment_name", "arithmetic_grpo"},
      {"trainer.default_local_dir", "runs/lm_grpo"},
      {"trainer.total_training_steps", 40},
      {"trainer.save_freq", 20},
      {m + "family", "llama"},
      {m + "config",
       {{"model_type", "llama"},
        {"hidden_size", 64},
        {"intermediate_size", 176},
        {"num_hidden_layers", 2},
        {"num_attention_heads", 4},
        {"num_key_value_heads", 2},
        {"max_position_embeddings", 32},
        {"tie_word_embeddings", true}}},
      {a + "optim.lr", 3e-4},
      {a + "optim.weight_decay", 0.0},
  };
  task.run = run_lm_grpo;
  task.plan = lm_grpo_plan;
  return task;
}

}  // namespace shardrl::trainer
