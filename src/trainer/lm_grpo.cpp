// Task "lm_grpo": GRPO for the LLaMA-style decoder on a verifiable task (arithmetic), after a
// short supervised stage on the task's format (cached, like the diffusion job's).
//   1. next-token training on "3+4=7\n" strings teaches the format (and some answers);
//   2. each RL step samples rollout.n answers per prompt with the KV cache (temperature, top-p,
//      recording log-probs), scores them exactly, and takes one GRPO step: group-normalised
//      outcome advantages, the PPO dual-clip loss, optionally a KL to the supervised model.
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <iostream>

#include "shardrl/algos.h"
#include "shardrl/algos/arithmetic.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/sampling.h"
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
  sft["actor_rollout_ref"]["actor"]["optim"]["lr"] = get<double>(config, "sft.lr");
  sft["trainer"]["total_training_steps"] = steps;
  torch::manual_seed(seed);
  auto engine =
      engine::EngineRegistry::create(engine_config(sft, "language_model", "actor"), world);
  const int64_t local = batch / engine->data_parallel_size();
  const auto width = algos::make_arithmetic_problems(task, 1, 0).front().prompt.size() +
                     static_cast<size_t>(2 * task.digits + 2);
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
    if (lead && (step % 50 == 0 || step == steps)) {
      std::cout << fmt::format("sft step {:4d}/{}  loss {:.4f}\n", step, steps, metrics["loss"])
                << std::flush;
    }
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

}  // namespace

json lm_grpo_defaults() {
  json d = {{"trainer",
             {{"task", "lm_grpo"},
              {"experiment_name", "arithmetic_grpo"},
              {"default_local_dir", "runs/lm_grpo"},
              {"total_training_steps", 40},
              {"save_freq", 20}}},
            {"data", {{"digits", 1}, {"operators", "+"}, {"train_batch_size", 16}}},
            {"sft", {{"steps", 300}, {"batch_size", 64}, {"lr", 3e-3}, {"cache_dir", ""}}},
            {"algorithm", {{"norm_adv_by_std_in_grpo", true}}},
            {"actor_rollout_ref", engine_defaults()}};
  auto& arr = d["actor_rollout_ref"];
  arr["model"]["family"] = "llama";
  arr["model"]["config"] = {{"model_type", "llama"},         {"hidden_size", 64},
                            {"intermediate_size", 176},      {"num_hidden_layers", 2},
                            {"num_attention_heads", 4},      {"num_key_value_heads", 2},
                            {"max_position_embeddings", 32}, {"tie_word_embeddings", true}};
  // verl's actor loss keys: clip_ratio_low / clip_ratio_high default to clip_ratio; the reference
  // model exists only with use_kl_loss.
  arr["actor"]["clip_ratio"] = 0.2;
  arr["actor"]["clip_ratio_low"] = nullptr;
  arr["actor"]["clip_ratio_high"] = nullptr;
  arr["actor"]["clip_ratio_c"] = 3.0;
  arr["actor"]["loss_agg_mode"] = "token-mean";
  arr["actor"]["use_kl_loss"] = false;
  arr["actor"]["kl_loss_coef"] = 0.001;
  arr["actor"]["kl_loss_type"] = "low_var_kl";
  arr["actor"]["optim"]["lr"] = 3e-4;
  arr["actor"]["optim"]["weight_decay"] = 0.0;
  arr["rollout"] = {{"n", 8}, {"temperature", 1.0}, {"top_p", 1.0}, {"response_length", 4}};
  return d;
}

int run_lm_grpo(const json& config, std::shared_ptr<dist::World> world) {
  const auto task = task_config(config);
  const auto seed = get<int64_t>(config, "trainer.seed");
  const auto prompts_global = get<int64_t>(config, "data.train_batch_size");
  const auto n = get<int64_t>(config, "actor_rollout_ref.rollout.n");
  const auto temperature = get<double>(config, "actor_rollout_ref.rollout.temperature");
  const std::string actor_key = "actor_rollout_ref.actor.";
  const bool use_kl_loss = get<bool>(config, actor_key + "use_kl_loss");
  const auto kl_coef = use_kl_loss ? get<double>(config, actor_key + "kl_loss_coef") : 0.0;
  const auto kl_type = get<std::string>(config, actor_key + "kl_loss_type");
  const bool norm_by_std = get<bool>(config, "algorithm.norm_adv_by_std_in_grpo");
  algos::PolicyLossConfig policy;
  const auto clip_ratio = get<double>(config, actor_key + "clip_ratio");
  const auto clip_or_default = [&](const std::string& key) {
    return at(config, key).is_null() ? clip_ratio : get<double>(config, key);
  };
  policy.clip_ratio_low = clip_or_default(actor_key + "clip_ratio_low");
  policy.clip_ratio_high = clip_or_default(actor_key + "clip_ratio_high");
  policy.clip_ratio_c = get<double>(config, actor_key + "clip_ratio_c");
  policy.loss_agg_mode = get<std::string>(config, actor_key + "loss_agg_mode");

  const std::string sft_dir = supervised_stage(config, world);
  json rl = config;
  rl["actor_rollout_ref"]["model"]["config"] = llama_json(config);
  rl["actor_rollout_ref"]["model"]["path"] = sft_dir;
  torch::manual_seed(seed + 1);
  auto actor = engine::EngineRegistry::create(engine_config(rl, "language_model", "actor"), world);
  // The reference is the supervised model, frozen: a forward-only engine (no optimizer).
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
  const int64_t local = prompts_global / dp;

  Run run(config, *world);
  for (int64_t step = run.resume(*actor) + 1; step <= run.total_steps(); ++step) {
    const auto start = std::chrono::steady_clock::now();
    const auto problems =
        algos::make_arithmetic_problems(task, prompts_global, seed * 1000003 + step);
    std::vector<std::string> prompts, answers;
    for (int64_t i = actor->data_parallel_rank() * local;
         i < (actor->data_parallel_rank() + 1) * local; ++i) {
      for (int64_t k = 0; k < n; ++k) {
        prompts.push_back(problems[i].prompt);
        answers.push_back(problems[i].answer);
      }
    }
    models::SamplingOptions sampling;
    sampling.max_new_tokens = get<int64_t>(config, "actor_rollout_ref.rollout.response_length");
    sampling.temperature = temperature;
    sampling.top_p = get<double>(config, "actor_rollout_ref.rollout.top_p");
    sampling.eos_token_id = kEos;
    sampling.generator =
        at::make_generator<at::CPUGeneratorImpl>(seed * 7777 + step * 131 + world->rank());
    const auto prompt_tokens = encode(prompts);
    const auto rollout =
        models::sample(actor->model<models::LlamaForCausalLM>(), prompt_tokens, sampling);
    const auto t_rollout = std::chrono::steady_clock::now();

    std::vector<std::string> responses;
    for (int64_t i = 0; i < rollout.responses.size(0); ++i) {
      responses.push_back(decode(rollout.responses[i], rollout.response_mask[i]));
    }
    const auto rewards = algos::arithmetic_rewards(responses, answers);
    // The outcome reward sits on each response's last token, as verl's reward manager puts it.
    auto token_rewards = torch::zeros_like(rollout.response_mask);
    const auto last = (rollout.response_mask.sum(1) - 1).clamp_min(0).to(torch::kLong);
    token_rewards.scatter_(1, last.unsqueeze(1), rewards.to(torch::kFloat).unsqueeze(1));
    std::vector<int64_t> uids;
    for (int64_t i = 0; i < rollout.responses.size(0); ++i) uids.push_back(i / n);
    engine::Batch batch{
        {"sequences", rollout.sequences},
        {"old_log_probs", rollout.log_probs},
        {"advantages",
         algos::grpo_outcome_advantages(token_rewards, rollout.response_mask, uids, norm_by_std)},
        {"response_mask", rollout.response_mask}};
    const int64_t prompt_length = prompt_tokens.size(1);
    if (ref) {
      torch::NoGradGuard no_grad;
      batch["ref_log_probs"] = models::response_log_probs(
          ref->model<models::LlamaForCausalLM>(), rollout.sequences, prompt_length, temperature);
    }
    const engine::LossFn grpo_loss = [&](engine::Engine& e, const engine::MicroBatch& mb) {
      const auto& d = mb.data;
      auto log_probs = models::response_log_probs(e.model<models::LlamaForCausalLM>(),
                                                  d.at("sequences"), prompt_length, temperature);
      auto out = algos::compute_policy_loss(d.at("old_log_probs"), log_probs, d.at("advantages"),
                                            d.at("response_mask"), policy);
      auto loss = out.pg_loss;
      engine::Metrics metrics{{"pg_loss", out.pg_loss.item<double>()},
                              {"clipfrac", out.pg_clipfrac.item<double>()},
                              {"ppo_kl", out.ppo_kl.item<double>()}};
      if (d.count("ref_log_probs")) {
        auto kl = algos::agg_loss(algos::kl_penalty(log_probs, d.at("ref_log_probs"), kl_type),
                                  d.at("response_mask"), policy.loss_agg_mode);
        loss = loss + kl_coef * kl;
        metrics["kl"] = kl.item<double>();
      }
      return engine::LossOutput{loss / mb.count, metrics, {}};
    };
    auto metrics = actor->train_batch(batch, grpo_loss);
    // Every rank holds as many samples, so means of means are global means.
    auto stats = actor->average_over_ranks(
        {{"reward_mean", rewards.mean().item<double>()},
         {"reward_sq", rewards.square().mean().item<double>()},
         {"response_length", rollout.response_mask.sum(1).mean().item<double>()}});
    metrics["reward_mean"] = stats["reward_mean"];
    metrics["reward_std"] =
        std::sqrt(std::max(0.0, stats["reward_sq"] - stats["reward_mean"] * stats["reward_mean"]));
    metrics["response_length"] = stats["response_length"];
    metrics["time_rollout"] = std::chrono::duration<double>(t_rollout - start).count();
    metrics["step_time"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    run.after_step(*actor, step, metrics);
  }
  return 0;
}

}  // namespace shardrl::trainer
