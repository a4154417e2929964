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
// top-p), scores them exactly, and takes one policy-gradient step: the advantages of verl's
// algorithm.adv_estimator (grpo's group-normalised outcome by default; rloo, reinforce_plus_plus
// [_baseline], remax with one greedy answer a prompt as its baseline), the loss of
// actor.policy_loss.loss_mode (PPO's dual clip by default; gspo, gpg, geo_mean), optionally a KL
// to the reference and an entropy bonus. With gae it is PPO: a critic (verl's value_model, a
// second trainable engine made from the actor's folder) gives the values GAE needs and trains
// first on the clipped value loss; the actor waits trainer.critic_warmup steps, and the run saves
// and resumes both. DAPO's dynamic sampling (algorithm.filter_groups) drops
// the groups whose answers all score alike and draws more until the batch is full; its overlong
// penalty (reward_model.overlong_buffer) lowers the reward of answers near response_length.
// rollout.dtype float16 packs the replica's weights into fbgemm's fp16 GEMM (with LoRA, the frozen
// base once; the adapter path stays fp32, unmerged): the samples then come from a policy a rounding
// away from the actor's, so the old log-probs are the actor's own (the step is on-policy: one
// optimizer step per batch, so they are its current log-probs, detached, as verl's actor takes them
// when on-policy) and the rollout's log-probs only measure the mismatch (rollout_probs_diff_mean,
// verl's metric). Held-out problems (data.val_size) are answered greedily before training, every
// trainer.test_freq steps and at the end.
#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include <cmath>
#include <deque>
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
  // The step's problems, the same on every rank and in a resumed run; gen_batch > 0: the step's
  // further draws when dynamic sampling asks for more.
  std::vector<algos::ArithmeticProblem> training(int64_t count, int64_t step,
                                                 int64_t gen_batch = 0) const {
    std::vector<algos::ArithmeticProblem> out;
    for (int64_t round = 0; static_cast<int64_t>(out.size()) < count; ++round) {
      if (round == 100) {
        throw std::invalid_argument(
            "config key 'data.val_size': the held-out problems leave too few to train on");
      }
      for (auto& p : algos::make_arithmetic_problems(
               task_, count, seed_ * 1000003 + step + round * 7919 + gen_batch * 104729)) {
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
    if (rollout.entropy.defined()) {
      rollout.entropy = torch::empty({rows, length}, rollout.entropy.options());
    }
  }
  for (auto* t : {&rollout.responses, &rollout.log_probs, &rollout.response_mask}) {
    group->broadcast(*t, 0);
  }
  if (rollout.entropy.defined()) group->broadcast(rollout.entropy, 0);
  rollout.sequences = torch::cat({rollout.prompts, rollout.responses}, 1);
  rollout.attention_mask = torch::cat({rollout.attention_mask.narrow(1, 0, rollout.prompts.size(1)),
                                       torch::ones_like(rollout.responses)},
                                      1);
  return rollout;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// The algorithm's choices (verl's algorithm.* and actor.policy_loss / DAPO's keys), read once.
struct Algorithm {
  algos::AdvantageConfig advantage;
  algos::PolicyLossConfig policy;
  double entropy_coeff = 0;
  // DAPO's dynamic sampling (algorithm.filter_groups).
  bool filter_groups = false;
  std::string filter_metric;
  int64_t max_num_gen_batches = 0;
  // DAPO's overlong penalty (reward_model.overlong_buffer).
  bool overlong = false;
  int64_t overlong_len = 0;
  double overlong_penalty_factor = 0;
  // PPO's critic (critic.*): on with gae.
  bool critic = false;
  double cliprange_value = 0.5;
  std::string critic_loss_agg_mode;
  int64_t critic_warmup = 0;  // the actor trains from this step on, as verl's

  explicit Algorithm(const json& config) {
    const std::string a = "actor_rollout_ref.actor.";
    advantage.adv_estimator = get<std::string>(config, "algorithm.adv_estimator");
    advantage.gamma = get<double>(config, "algorithm.gamma");
    advantage.norm_adv_by_std_in_grpo = get<bool>(config, "algorithm.norm_adv_by_std_in_grpo");
    advantage.lam = get<double>(config, "algorithm.lam");
    // verl's need_critic: critic.enable when set, else whether the estimator is gae.
    const bool gae = advantage.adv_estimator == "gae";
    critic = at(config, "critic.enable").is_null() ? gae : get<bool>(config, "critic.enable");
    if (gae != critic) {
      throw std::invalid_argument(
          gae ? "config key 'critic.enable' is false, but algorithm.adv_estimator gae needs the "
                "critic's values"
              : fmt::format("config key 'critic.enable' is true, but algorithm.adv_estimator {} "
                            "never reads a critic's values (gae does)",
                            advantage.adv_estimator));
    }
    cliprange_value = get<double>(config, "critic.cliprange_value");
    critic_warmup = get<int64_t>(config, "trainer.critic_warmup");
    const auto clip_ratio = get<double>(config, a + "clip_ratio");
    const auto clip_or_default = [&](const std::string& key) {
      return at(config, key).is_null() ? clip_ratio : get<double>(config, key);
    };
    policy.loss_mode = get<std::string>(config, a + "policy_loss.loss_mode");
    policy.clip_ratio_low = clip_or_default(a + "clip_ratio_low");
    policy.clip_ratio_high = clip_or_default(a + "clip_ratio_high");
    policy.clip_ratio_c = get<double>(config, a + "clip_ratio_c");
    policy.loss_agg_mode = get<std::string>(config, a + "loss_agg_mode");
    if (!at(config, a + "loss_scale_factor").is_null()) {
      policy.loss_scale_factor = get<double>(config, a + "loss_scale_factor");
    }
    critic_loss_agg_mode = at(config, "critic.loss_agg_mode").is_null()
                               ? policy.loss_agg_mode
                               : get<std::string>(config, "critic.loss_agg_mode");
    entropy_coeff = get<double>(config, a + "entropy_coeff");
    filter_groups = get<bool>(config, "algorithm.filter_groups.enable");
    if (filter_groups) {
      if (at(config, "algorithm.filter_groups.metric").is_null()) {
        throw std::invalid_argument(
            "config key 'algorithm.filter_groups.metric' must be set when "
            "algorithm.filter_groups.enable is true (acc, score, seq_reward or seq_final_reward)");
      }
      filter_metric = get<std::string>(config, "algorithm.filter_groups.metric");
    }
    max_num_gen_batches = get<int64_t>(config, "algorithm.filter_groups.max_num_gen_batches");
    overlong = get<bool>(config, "reward_model.overlong_buffer.enable");
    overlong_len = get<int64_t>(config, "reward_model.overlong_buffer.len");
    overlong_penalty_factor = get<double>(config, "reward_model.overlong_buffer.penalty_factor");
    const auto response_length = get<int64_t>(config, "actor_rollout_ref.rollout.response_length");
    if (overlong && overlong_len < 1) {
      throw std::invalid_argument(
          "config key 'reward_model.overlong_buffer.len' must be at least 1 when "
          "reward_model.overlong_buffer.enable is true");
    }
    if (overlong && overlong_len > response_length) {
      throw std::invalid_argument(fmt::format(
          "config key 'reward_model.overlong_buffer.len' ({}) must not exceed "
          "actor_rollout_ref.rollout.response_length ({}): the penalty starts that many tokens "
          "before the longest answer",
          overlong_len, response_length));
    }
    if (entropy_coeff != 0 && get<bool>(config, "actor_rollout_ref.model.use_remove_padding")) {
      throw std::invalid_argument(
          "config key 'actor_rollout_ref.actor.entropy_coeff': the entropy bonus needs the "
          "response's logits, which the packed update (actor_rollout_ref.model.use_remove_padding) "
          "never forms; set one of them off");
    }
    if (get<bool>(config, "actor_rollout_ref.actor.use_prefix_grouper") &&
        !get<bool>(config, "actor_rollout_ref.model.use_remove_padding")) {
      throw std::invalid_argument(
          "config key 'actor_rollout_ref.actor.use_prefix_grouper': a group's prompt is shared "
          "inside the packed rows, so it needs actor_rollout_ref.model.use_remove_padding: true");
    }
  }
  bool remax() const { return advantage.adv_estimator == "remax"; }
};

// One generation batch on this rank: its prompts, the sampled answers and their scores.
struct Generation {
  std::vector<algos::ArithmeticProblem> prompts;  // this rank's, one per group
  rollout::Rollout rollout;                       // rollout.n rows a prompt, consecutive
  std::vector<std::string> answers, responses;    // per row
  torch::Tensor acc;                              // [rows] the exact-match score
  torch::Tensor rewards;                          // [rows] acc plus the overlong penalty
  torch::Tensor baselines;                        // [rows] remax: the prompt's greedy reward
};

// The rows of the groups `groups` (prompt indices in g) of each generation, in one batch: prompts
// left-padded and responses right-padded to the widest.
Generation concat_groups(const std::vector<std::pair<const Generation*, int64_t>>& groups,
                         int64_t n, int64_t pad) {
  int64_t prompt_width = 0, response_width = 0;
  for (const auto& [g, i] : groups) {
    prompt_width = std::max(prompt_width, g->rollout.prompts.size(1));
    response_width = std::max(response_width, g->rollout.responses.size(1));
  }
  std::vector<torch::Tensor> prompts, prompt_mask, responses, log_probs, response_mask, entropy,
      acc, rewards, baselines;
  Generation out;
  for (const auto& group : groups) {
    const Generation* g = group.first;
    const int64_t i = group.second;
    const auto& r = g->rollout;
    const int64_t p = r.prompts.size(1), l = r.responses.size(1);
    const auto rows = [&](const torch::Tensor& t) { return t.narrow(0, i * n, n); };
    namespace F = torch::nn::functional;
    prompts.push_back(F::pad(rows(r.prompts), F::PadFuncOptions({prompt_width - p, 0}).value(pad)));
    prompt_mask.push_back(
        F::pad(rows(r.attention_mask.narrow(1, 0, p)), F::PadFuncOptions({prompt_width - p, 0})));
    const auto right = F::PadFuncOptions({0, response_width - l});
    responses.push_back(
        F::pad(rows(r.responses), F::PadFuncOptions({0, response_width - l}).value(pad)));
    log_probs.push_back(F::pad(rows(r.log_probs), right));
    response_mask.push_back(F::pad(rows(r.response_mask), right));
    if (r.entropy.defined()) entropy.push_back(F::pad(rows(r.entropy), right));
    acc.push_back(rows(g->acc));
    rewards.push_back(rows(g->rewards));
    if (g->baselines.defined()) baselines.push_back(rows(g->baselines));
    out.prompts.push_back(g->prompts[i]);
    for (int64_t k = i * n; k < (i + 1) * n; ++k) {
      out.answers.push_back(g->answers[k]);
      out.responses.push_back(g->responses[k]);
    }
  }
  auto& r = out.rollout;
  r.prompts = torch::cat(prompts);
  r.responses = torch::cat(responses);
  r.log_probs = torch::cat(log_probs);
  r.response_mask = torch::cat(response_mask);
  if (!entropy.empty()) r.entropy = torch::cat(entropy);
  r.sequences = torch::cat({r.prompts, r.responses}, 1);
  r.attention_mask = torch::cat({torch::cat(prompt_mask), torch::ones_like(r.responses)}, 1);
  out.acc = torch::cat(acc);
  out.rewards = torch::cat(rewards);
  if (!baselines.empty()) out.baselines = torch::cat(baselines);
  return out;
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
  if (get<bool>(config, "actor_rollout_ref.actor.use_prefix_grouper")) {
    w.shared_prompt_tokens = get<int64_t>(config, r + "prompt_length");
    w.rows_per_prompt = get<int64_t>(config, r + "n");
    w.update_rows = rows;
  }
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
  if (Algorithm(config).critic) {
    const auto critic = engine_config(rl, "value_model", "critic");
    w.critic_params = engine::EngineRegistry::model_size(critic).params();
    w.critic_fsdp_size = critic.fsdp_size;
    w.critic_param_offload = critic.offload.param_offload;
    w.critic_optimizer_offload = critic.offload.optimizer_offload;
    w.critic_host_shared_params = critic.fsdp.host_shared_params;
  }
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
  const bool use_remove_padding = get<bool>(config, "actor_rollout_ref.model.use_remove_padding");
  const bool use_prefix_grouper = get<bool>(config, actor_key + "use_prefix_grouper");
  Algorithm algorithm(config);
  const auto& policy = algorithm.policy;

  // A pretrained model brings its own config, tokenizer and chat template; otherwise the
  // supervised stage makes one.
  json rl = config;
  const std::string pretrained = get<std::string>(config, "actor_rollout_ref.model.path");
  {
    const auto model = pretrained.empty() ? models::LlamaConfig::from_json(llama_json(config))
                                          : models::LlamaConfig::load(pretrained + "/config.json");
    std::vector<std::string> roles = {"actor", "ref"};
    if (algorithm.critic) roles.push_back("critic");
    for (const auto& role : roles) {
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
  // PPO's critic: the actor's model with a value head (verl's value_model), trained beside it.
  std::unique_ptr<engine::Engine> critic;
  if (algorithm.critic) {
    critic = engine::EngineRegistry::create(engine_config(rl, "value_model", "critic"), world);
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
  if (critic) run.save_critic_with(*critic);
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
  // Whitening's statistics are the whole batch's, every data-parallel rank's rows.
  algorithm.advantage.sum_over_ranks = [&](torch::Tensor t) {
    data_parallel.all_reduce(t);
    return t;
  };
  for (int64_t step = first_step; step <= run.total_steps(); ++step) {
    const auto start = std::chrono::steady_clock::now();
    const auto sync_start = std::chrono::steady_clock::now();
    if (!actor_samples) sync_rollout_weights();
    const double sync_seconds = seconds_since(sync_start);
    // The step's generation batch number `gen_batch`: this rank's prompts, sampled and scored.
    const auto generate = [&](int64_t gen_batch) {
      Generation g;
      const auto all = problems.training(prompts_global, step, gen_batch);
      for (int64_t i = actor->data_parallel_rank() * local;
           i < (actor->data_parallel_rank() + 1) * local; ++i) {
        g.prompts.push_back(all[i]);
        for (int64_t k = 0; k < n; ++k) g.answers.push_back(all[i].answer);
      }
      // hf: the weight sync is the all-gather of every unit, held for the whole rollout (one
      // gather, not one a token), as verl's HFRollout samples under summon_full_params.
      std::optional<fsdp::UnshardScope> gathered;
      if (actor_samples) gathered.emplace(actor->fsdp());
      rollout::SamplingOptions sampling;
      sampling.max_new_tokens = response_length;
      sampling.temperature = temperature;
      sampling.top_p = get<double>(config, "actor_rollout_ref.rollout.top_p");
      sampling.eos_token_id = text->eos;
      sampling.pad_token_id = text->pad;
      sampling.num_return_sequences = n;  // row i * n + k: the k-th answer to prompt i
      sampling.record_entropy = true;
      sampling.generator = at::make_generator<at::CPUGeneratorImpl>(
          seed * 7777 + step * 131 + actor->data_parallel_rank() + gen_batch * 1000003);
      const auto [prompt_tokens, prompt_mask] = text->prompts(g.prompts);
      // The sequence-parallel ranks of a group sample the same prompts from the same seed; the
      // group's first rank's rollout is the one all of them train on (verl hands the group one
      // batch), whatever their kernels' last bits.
      auto& sampler = actor_samples ? actor->model<models::LlamaForCausalLM>() : rollout_model;
      auto* sp_group = actor->mesh().sequence_parallel_group().get();
      g.rollout =
          same_in_group(rollout::sample(sampler, prompt_tokens, sampling, prompt_mask), sp_group);
      // The reward as the reward manager gives it: the exact answer, then DAPO's overlong ramp.
      const auto score = [&](const rollout::Rollout& r, const std::vector<std::string>& answers,
                             std::vector<std::string>* texts) {
        std::vector<std::string> out;
        for (int64_t i = 0; i < r.responses.size(0); ++i) {
          out.push_back(text->response(r.responses[i], r.response_mask[i]));
        }
        auto acc = algos::arithmetic_rewards(out, answers, text->answer_at()).to(torch::kFloat);
        auto reward = acc;
        if (algorithm.overlong) {
          reward = acc + algos::overlong_penalty(r.response_mask.sum(1), response_length,
                                                 algorithm.overlong_len,
                                                 algorithm.overlong_penalty_factor);
        }
        if (texts) *texts = std::move(out);
        return std::make_pair(acc, reward);
      };
      std::tie(g.acc, g.rewards) = score(g.rollout, g.answers, &g.responses);
      if (algorithm.remax()) {
        // ReMax's baseline: one greedy answer a prompt from the same policy, scored alike.
        rollout::SamplingOptions greedy = sampling;
        greedy.temperature = 0;
        greedy.num_return_sequences = 1;
        greedy.record_entropy = false;
        greedy.generator.reset();
        const auto baseline =
            same_in_group(rollout::sample(sampler, prompt_tokens, greedy, prompt_mask), sp_group);
        std::vector<std::string> answers;
        for (const auto& p : g.prompts) answers.push_back(p.answer);
        g.baselines = score(baseline, answers, nullptr).second.repeat_interleave(n);
      }
      return g;
    };

    // DAPO's dynamic sampling: groups whose rewards are all equal teach nothing; more batches
    // are drawn until every rank holds `local` groups that do (or the limit).
    std::deque<Generation> generations;  // kept groups point into it: a deque never moves them
    Generation batch_rows;
    int64_t num_gen_batches = 0;
    if (!algorithm.filter_groups) {
      batch_rows = generate(0);
      num_gen_batches = 1;
    } else {
      std::vector<std::pair<const Generation*, int64_t>> kept;
      for (;;) {
        generations.push_back(generate(num_gen_batches++));
        const auto& g = generations.back();
        // acc and score: the answer's score; seq_reward and seq_final_reward: the reward the
        // advantages see, the overlong penalty included (no KL in the reward here).
        const bool answer_score =
            algorithm.filter_metric == "acc" || algorithm.filter_metric == "score";
        const auto metric = answer_score ? g.acc : g.rewards;
        std::vector<int64_t> uids;
        for (int64_t i = 0; i < g.rollout.responses.size(0); ++i) uids.push_back(i / n);
        for (int64_t group : algos::groups_to_keep(metric, uids)) {
          if (static_cast<int64_t>(kept.size()) < local) kept.emplace_back(&g, group);
        }
        // Every rank draws as many batches: the hf rollout and the update are collective.
        auto short_ranks =
            torch::tensor({static_cast<int64_t>(kept.size()) < local ? 1.0 : 0.0}, torch::kDouble);
        data_parallel.all_reduce(short_ranks);
        if (short_ranks.item<double>() == 0) break;
        // With no limit (max_num_gen_batches 0) a policy that solves or fails every problem
        // draws forever, as verl's does: say so from the 10th batch on, so the run is not silent.
        if (lead && num_gen_batches % 10 == 0) {
          spdlog::warn(
              "algorithm.filter_groups: step {} has drawn {} generation batches and a rank still "
              "holds fewer than {} groups whose {} varies (the limit, "
              "algorithm.filter_groups.max_num_gen_batches, is {})",
              step, num_gen_batches, local, algorithm.filter_metric,
              algorithm.max_num_gen_batches > 0 ? std::to_string(algorithm.max_num_gen_batches)
                                                : std::string("0: none"));
        }
        if (algorithm.max_num_gen_batches > 0 && num_gen_batches >= algorithm.max_num_gen_batches) {
          throw std::runtime_error(fmt::format(
              "algorithm.filter_groups: {} generation batches (algorithm.filter_groups."
              "max_num_gen_batches) left fewer than {} groups with varied {} on a rank: the "
              "problems are all solved or all failed; raise the limit or turn the filter off",
              num_gen_batches, local, algorithm.filter_metric));
        }
      }
      batch_rows = concat_groups(kept, n, text->pad);
    }
    const double rollout_seconds = seconds_since(start);
    const auto& rollout = batch_rows.rollout;
    const auto& mine = batch_rows.prompts;
    const auto& answers = batch_rows.answers;
    const auto& responses = batch_rows.responses;
    const auto& rewards = batch_rows.rewards;

    // The outcome reward sits on each response's last token, as verl's reward manager puts it.
    auto token_rewards = torch::zeros_like(rollout.response_mask);
    const auto last = (rollout.response_mask.sum(1) - 1).clamp_min(0).to(torch::kLong);
    token_rewards.scatter_(1, last.unsqueeze(1), rewards.to(torch::kFloat).unsqueeze(1));
    algos::AdvantageInputs advantage_inputs;
    advantage_inputs.token_level_rewards = token_rewards;
    advantage_inputs.response_mask = rollout.response_mask;
    for (int64_t i = 0; i < rollout.responses.size(0); ++i) {
      advantage_inputs.uids.push_back(i / n);
    }
    advantage_inputs.reward_baselines = batch_rows.baselines;
    engine::Batch batch{{"sequences", rollout.sequences},
                        {"attention_mask", rollout.attention_mask},
                        {"rollout_log_probs", rollout.log_probs},
                        {"response_mask", rollout.response_mask}};
    const int64_t prompt_length = rollout.prompts.size(1);
    const auto values_of = [&](engine::Engine& e, const engine::Batch& d) {
      auto& model = e.model<models::LlamaForTokenClassification>();
      return use_remove_padding
                 ? rollout::packed_response_values(model, d.at("sequences"), prompt_length,
                                                   d.at("attention_mask"), d.at("response_mask"))
                 : rollout::response_values(model, d.at("sequences"), prompt_length,
                                            d.at("attention_mask"), d.at("response_mask"));
    };
    double values_seconds = 0;
    if (critic) {
      // The critic's values of the rollout, before either model changes (verl's compute_values).
      const auto values_start = std::chrono::steady_clock::now();
      batch["values"] =
          critic
              ->infer_batch(
                  batch,
                  [&](engine::Engine& e, const engine::MicroBatch& mb) {
                    return engine::LossOutput{{}, {}, {{"values", values_of(e, mb.data)}}};
                  })
              .at("values");
      advantage_inputs.values = batch["values"];
      values_seconds = seconds_since(values_start);
    }
    const auto advantages = algos::compute_advantage(advantage_inputs, algorithm.advantage);
    batch["advantages"] = advantages.advantages;
    if (critic) batch["returns"] = advantages.returns;
    const auto log_probs_of = [&](engine::Engine& e, const engine::Batch& d) {
      auto& model = e.model<models::LlamaForCausalLM>();
      return use_remove_padding
                 ? rollout::packed_response_log_probs(model, d.at("sequences"), prompt_length,
                                                      temperature, d.at("attention_mask"),
                                                      d.at("response_mask"), use_prefix_grouper)
                 : rollout::response_log_probs(model, d.at("sequences"), prompt_length, temperature,
                                               d.at("attention_mask"));
    };
    // With the entropy bonus: the responses' logits, from which both the log-probs and the
    // entropy come (the fused paths above never form them).
    const auto log_probs_and_entropy = [&](engine::Engine& e, const engine::Batch& d) {
      auto& model = e.model<models::LlamaForCausalLM>();
      const auto& sequences = d.at("sequences");
      const int64_t total = sequences.size(1), length = total - prompt_length;
      auto logits = model(sequences.narrow(1, 0, total - 1), nullptr,
                          d.at("attention_mask").narrow(1, 0, total - 1), length)
                        .to(torch::kFloat);
      if (temperature > 0) logits = logits / temperature;
      auto log_probs = torch::log_softmax(logits, -1)
                           .gather(-1, sequences.narrow(1, prompt_length, length).unsqueeze(-1))
                           .squeeze(-1);
      return std::make_pair(log_probs, algos::entropy_from_logits(logits));
    };
    if (ref) {
      torch::NoGradGuard no_grad;
      batch["ref_log_probs"] = log_probs_of(*ref, batch);
    }
    const engine::LossFn grpo_loss = [&](engine::Engine& e, const engine::MicroBatch& mb) {
      const auto& d = mb.data;
      torch::Tensor log_probs, entropy;
      if (algorithm.entropy_coeff != 0) {
        std::tie(log_probs, entropy) = log_probs_and_entropy(e, d);
      } else {
        log_probs = log_probs_of(e, d);
      }
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
          {"pg_clipfrac_lower", out.pg_clipfrac_lower.item<double>()},
          {"ppo_kl", out.ppo_kl.item<double>()},
          {"rollout_probs_diff_mean", (probs_diff.sum() / mask.sum().clamp_min(1)).item<double>()}};
      if (entropy.defined()) {
        // verl's bonus: the aggregated entropy, subtracted with its coefficient.
        const auto entropy_loss =
            algos::agg_loss(entropy, mask, policy.loss_agg_mode, policy.loss_scale_factor);
        loss = loss - algorithm.entropy_coeff * entropy_loss;
        metrics["actor/entropy_loss"] = entropy_loss.item<double>();
      }
      if (d.count("ref_log_probs")) {
        auto kl =
            algos::agg_loss(algos::kl_penalty(log_probs, d.at("ref_log_probs"), kl_type),
                            d.at("response_mask"), policy.loss_agg_mode, policy.loss_scale_factor);
        loss = loss + kl_coef * kl;
        metrics["kl"] = kl.item<double>();
      }
      return engine::LossOutput{loss / mb.count, metrics, {}};
    };
    engine::Metrics metrics;
    double critic_seconds = 0;
    if (critic) {
      // verl updates the critic first, on the values and returns computed above.
      const auto critic_start = std::chrono::steady_clock::now();
      const engine::LossFn value_loss = [&](engine::Engine& e, const engine::MicroBatch& mb) {
        const auto& d = mb.data;
        const auto& mask = d.at("response_mask");
        const auto vpreds = values_of(e, d);
        const auto out = algos::compute_value_loss(
            vpreds, d.at("returns"), d.at("values"), mask, algorithm.cliprange_value,
            algorithm.critic_loss_agg_mode, policy.loss_scale_factor);
        return engine::LossOutput{
            out.vf_loss / mb.count,
            {{"critic/vf_loss", out.vf_loss.item<double>()},
             {"critic/vf_clipfrac", out.vf_clipfrac.item<double>()},
             {"critic/vpred_mean", algos::masked_mean(vpreds.detach(), mask).item<double>()}},
            {}};
      };
      for (const auto& [name, value] : critic->train_batch(batch, value_loss)) {
        metrics[name.rfind("critic/", 0) == 0 ? name : "critic/" + name] = value;
      }
      const auto& mask = rollout.response_mask;
      const auto stats = critic->average_over_ranks(
          {{"values", algos::masked_mean(batch.at("values"), mask).item<double>()},
           {"returns", algos::masked_mean(batch.at("returns"), mask).item<double>()}});
      metrics["critic/values/mean"] = stats.at("values");
      metrics["critic/returns/mean"] = stats.at("returns");
      critic_seconds = seconds_since(critic_start);
    }
    const auto actor_start = std::chrono::steady_clock::now();
    // verl's critic warmup: until step critic_warmup the critic alone learns.
    if (step >= algorithm.critic_warmup) {
      for (const auto& [name, value] : actor->train_batch(batch, grpo_loss)) {
        metrics[name] = value;
      }
    }
    const double actor_seconds = seconds_since(actor_start);
    const double update_end = seconds_since(start);
    const double tokens = rollout.response_mask.sum().item<double>();
    // Every rank holds as many samples, so means of means are global means.
    auto stats = actor->average_over_ranks(
        {{"reward_mean", rewards.mean().item<double>()},
         {"reward_sq", rewards.square().mean().item<double>()},
         {"response_length", rollout.response_mask.sum(1).mean().item<double>()},
         {"response_tokens", tokens},
         {"rollout_tokens_per_s", tokens / rollout_seconds},
         // verl's actor/entropy: the policy's entropy on the responses, aggregated as the loss.
         {"actor/entropy", algos::agg_loss(rollout.entropy, rollout.response_mask,
                                           policy.loss_agg_mode, policy.loss_scale_factor)
                               .item<double>()}});
    metrics["reward_mean"] = stats["reward_mean"];
    metrics["reward_std"] =
        std::sqrt(std::max(0.0, stats["reward_sq"] - stats["reward_mean"] * stats["reward_mean"]));
    metrics["response_length"] = stats["response_length"];
    metrics["actor/entropy"] = stats["actor/entropy"];
    if (algorithm.filter_groups)
      metrics["train/num_gen_batches"] = static_cast<double>(num_gen_batches);
    // Per rank, as verl's perf/throughput is per GPU.
    metrics["perf/rollout_tokens_per_s"] = stats["rollout_tokens_per_s"];
    // Every data-parallel rank's (the mean times their count), over the rollout and the update.
    metrics["perf/response_tokens_per_s"] =
        stats["response_tokens"] * static_cast<double>(dp) / std::max(update_end, 1e-9);
    metrics["time_rollout"] = rollout_seconds;  // the weight sync included
    metrics["time_weight_sync"] = sync_seconds;
    // The actor's update; with a critic, its values and its update are their own phases.
    metrics["time_update"] = actor_seconds;
    if (critic) {
      metrics["time_values"] = values_seconds;
      metrics["time_update_critic"] = critic_seconds;
    }
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
      "GRPO, PPO with a critic and verl's other estimators for a LLaMA-style decoder on "
      "arithmetic: a model trained here after a short supervised stage, or a pretrained chat "
      "model (model.path)";
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
      {a + "use_prefix_grouper", false, boolean(),
       "each group's prompt packed once for its answers in the update and the reference pass, "
       "which attend to that copy (verl's; needs model.use_remove_padding)"},
      {m + "path", "", text().existing_folder("config.json"),
       "a pretrained chat model: a Hugging Face folder with config.json, safetensors, "
       "tokenizer.json and a chat template (empty: train one here)"},
      {a + "clip_ratio", 0.2, number().at_least(0), "PPO's ratio clip"},
      {a + "clip_ratio_low", nullptr, number().at_least(0).or_null("clip_ratio"),
       "the ratio clip below 1"},
      {a + "clip_ratio_high", nullptr, number().at_least(0).or_null("clip_ratio"),
       "the ratio clip above 1"},
      {a + "clip_ratio_c", 3.0, number().above(1),
       "dual-clip PPO's bound on negative-advantage losses (vanilla)"},
      {a + "loss_agg_mode", "token-mean",
       text().one_of({"token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"}),
       "how token losses are aggregated into the batch's (per rank; gspo always "
       "seq-mean-token-mean, geo_mean the mean over sequences, as verl)"},
      {a + "loss_scale_factor", nullptr, number().above(0).or_null("the response length"),
       "seq-mean-token-sum-norm's divisor"},
      {a + "policy_loss.loss_mode", "vanilla",
       text().one_of({"vanilla", "gspo", "gpg", "geo_mean"}),
       "the policy loss: PPO's clipped ratio (vanilla), GSPO's sequence ratio, GPG's plain policy "
       "gradient, GMPO's geometric mean of the token ratios (geo_mean)"},
      {a + "entropy_coeff", 0.0, number(),
       "the entropy bonus's weight: loss - entropy_coeff * entropy (not with "
       "model.use_remove_padding)"},
      {"algorithm.adv_estimator", "grpo",
       text().one_of(
           {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"}),
       "the advantage estimator (verl's; gae trains a critic, critic.*)"},
      {"algorithm.gamma", 1.0, number().at_least(0).at_most(1),
       "the discount of the returns (gae, reinforce_plus_plus)"},
      {"algorithm.lam", 1.0, number().at_least(0).at_most(1), "GAE's lambda"},
      {"algorithm.filter_groups.enable", false, boolean(),
       "DAPO's dynamic sampling: drop the groups whose metric is the same for every answer and "
       "draw more prompts until the batch is full"},
      {"algorithm.filter_groups.metric", nullptr,
       text().one_of({"acc", "score", "seq_reward", "seq_final_reward"}).or_null("unset"),
       "what must vary within a group: acc or score (the answer's score), seq_reward or "
       "seq_final_reward (with the overlong penalty)"},
      {"algorithm.filter_groups.max_num_gen_batches", 0, integer().at_least(0),
       "generation batches a step may draw before it fails (0: no limit)"},
      {"reward_model.overlong_buffer.enable", false, boolean(),
       "DAPO's overlong penalty on answers in the last overlong_buffer.len tokens"},
      {"reward_model.overlong_buffer.len", 0, integer().at_least(0),
       "the buffer's tokens before rollout.response_length"},
      {"reward_model.overlong_buffer.penalty_factor", 0.0, number().at_least(0),
       "the penalty at rollout.response_length tokens (linear from 0 at the buffer's start)"},
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
  for (auto& row : critic_keys()) task.keys.push_back(std::move(row));
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
