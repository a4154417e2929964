// One rank of the Ulysses tests (tests/test_ulysses.cpp): an Engine with
// ulysses_sequence_parallel_size --sp trains --steps steps on its data-parallel share of a global
// batch that every layout sees alike, and rank 0 writes each step's metrics and the final params.
//   --model llama   the LLaMA decoder (4 heads, --kv-heads key/value heads, tied or --untied
//                   embeddings, --lora-rank; --family qwen3: q/k norms and head_dim 12, --family
//                   llama3: Llama 3's RoPE scaling and head_dim 16); --loss policy: GRPO's
//                   dual-clip loss on the response log-probs of left-padded sequences of --length
//                   tokens, the first --prompt of them prompt (old log-probs from the model before
//                   the step, under no grad);
//                   --loss next_token: cross-entropy of the whole logits over the real tokens
//   --model sd3     the SD3 MMDiT of sd3_scenario.h (2 heads, a dual-attention block, qk RMSNorm)
//   on
//                   a --image x --image latent of 2 x 2 patches and --text text tokens: Flow-GRPO's
//                   registered loss on the rows of a rollout the engine's model samples
// --remove-padding packs the policy loss's sequences (verl's use_remove_padding).
// --checkpointing turns on activation checkpointing. OUT/metrics.txt: "loss grad_norm" a step;
// OUT/final: the gathered params; OUT/exchange.json: the bytes this rank sent in its Ulysses
// group's collectives over the run.
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

#include "shardrl/algos.h"
#include "shardrl/algos/diffusion_rl.h"
#include "shardrl/engine.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/sd3.h"
#include "shardrl/rollout/sampling.h"
#include "workers/param_files.h"
#include "workers/sd3_scenario.h"

using namespace shardrl;

namespace {

struct Args {
  std::string model = "llama", family = "llama", loss = "policy", out;
  int sp = 1, fsdp_size = -1;
  int64_t steps = 2, batch = 4, micro_batch = 1, kv_heads = 2, length = 13, prompt = 9,
          lora_rank = 0, image = 6, text = 5;
  bool untied = false, checkpointing = false, remove_padding = false;
};

engine::EngineConfig llama_config(const Args& a) {
  engine::EngineConfig c;
  c.model_type = "language_model";
  nlohmann::json model = {{"vocab_size", 61},
                          {"hidden_size", 32},
                          {"intermediate_size", 48},
                          {"num_hidden_layers", 2},
                          {"num_attention_heads", 4},
                          {"num_key_value_heads", a.kv_heads},
                          {"max_position_embeddings", 64},
                          {"tie_word_embeddings", !a.untied}};
  if (a.family == "qwen3") {
    model.update({{"model_type", "qwen3"}, {"head_dim", 12}});
  } else if (a.family == "llama3") {
    model.update({{"head_dim", 16},
                  {"rope_parameters",
                   {{"rope_type", "llama3"},
                    {"rope_theta", 5e5},
                    {"factor", 8.0},
                    {"low_freq_factor", 1.0},
                    {"high_freq_factor", 4.0},
                    {"original_max_position_embeddings", 1024}}}});
  }
  c.model = {{"family", "llama"},
             {"config", model},
             {"lora_rank", a.lora_rank},
             {"enable_gradient_checkpointing", a.checkpointing}};
  c.optim.lr = 1e-2;
  c.optim.weight_decay = 0.0;
  return c;
}

engine::EngineConfig sd3_config(const Args& a) {
  auto model = testing::sd3_test_config();  // SD3.5-style: qk RMSNorm, a dual-attention block
  model.sample_size = a.image;
  engine::EngineConfig c;
  c.model_type = "diffusion_model";
  c.model = {{"config", model.to_json()},
             {"lora_rank", a.lora_rank},
             {"enable_gradient_checkpointing", a.checkpointing}};
  c.optim.lr = 1e-3;
  c.loss = {{"clip_ratio", 0.2},
            {"sampler", {{"num_inference_steps", 3}, {"height", a.image}, {"width", a.image}}}};
  return c;
}

// The step's global batch of left-padded sequences, the same in every layout: row i has i % 3
// padding tokens before its prompt and ends i % 2 tokens before the last position.
engine::Batch llama_batch(const Args& a, int64_t step) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + step);
  auto sequences = torch::randint(1, 61, {a.batch, a.length + 1}, gen);
  auto attention_mask = torch::ones_like(sequences);
  auto response_mask = torch::ones({a.batch, a.length + 1 - a.prompt}, torch::kFloat);
  for (int64_t i = 0; i < a.batch; ++i) {
    attention_mask[i].narrow(0, 0, i % 3).zero_();
    sequences[i].narrow(0, 0, i % 3).zero_();
    if (i % 2) response_mask[i].narrow(0, response_mask.size(1) - 1, 1).zero_();
  }
  auto advantages = torch::randn({a.batch, 1}, gen).expand_as(response_mask) * response_mask;
  return {{"sequences", sequences},
          {"attention_mask", attention_mask},
          {"response_mask", response_mask},
          {"advantages", advantages.contiguous()}};
}

// The response log-probs of the batch's rows: padded, or packed (--remove-padding).
torch::Tensor llama_log_probs(const Args& a, engine::Engine& e, const engine::Batch& d) {
  auto& model = e.model<models::LlamaForCausalLM>();
  if (!a.remove_padding) {
    return rollout::response_log_probs(model, d.at("sequences"), a.prompt, 1.0,
                                       d.at("attention_mask"));
  }
  return rollout::packed_response_log_probs(model, d.at("sequences"), a.prompt, 1.0,
                                            d.at("attention_mask"), d.at("response_mask"));
}

engine::LossOutput llama_loss(const Args& a, engine::Engine& e, const engine::MicroBatch& mb) {
  auto& model = e.model<models::LlamaForCausalLM>();
  const auto& d = mb.data;
  if (a.loss == "next_token") {
    const auto& tokens = d.at("sequences");
    const auto mask = d.at("attention_mask").narrow(1, 1, tokens.size(1) - 1).to(torch::kFloat);
    auto logits = model(tokens, nullptr, d.at("attention_mask")).narrow(1, 0, tokens.size(1) - 1);
    auto nll = -torch::log_softmax(logits.to(torch::kFloat), -1)
                    .gather(-1, tokens.narrow(1, 1, tokens.size(1) - 1).unsqueeze(-1))
                    .squeeze(-1);
    auto loss = ((nll * mask).sum(1) / mask.sum(1)).mean();
    return {loss / mb.count, {}, {}};
  }
  auto log_probs = llama_log_probs(a, e, d);
  algos::PolicyLossConfig policy;
  policy.loss_agg_mode = "seq-mean-token-mean";  // per-sample means: any split of the batch agrees
  auto out = algos::compute_policy_loss(d.at("old_log_probs"), log_probs, d.at("advantages"),
                                        d.at("response_mask"), policy);
  return {out.pg_loss / mb.count, {{"pg_clipfrac", out.pg_clipfrac.item<double>()}}, {}};
}

// The step's rows of a Flow-GRPO rollout of the engine's model over the global batch, drawn from
// one seed on every rank (so alike in every layout).
engine::Batch sd3_rows(const Args& a, engine::Engine& engine, int64_t step) {
  auto& model = engine.model<models::SD3Transformer2DModel>();
  const auto sampler = engine.config().loss.at("sampler").get<algos::SamplerConfig>();
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2000 + step);
  algos::Conditioning cond;
  const auto& config = model->config();
  cond.prompt_embeds = torch::randn({a.batch, a.text, config.joint_attention_dim}, gen);
  cond.pooled_prompt_embeds = torch::randn({a.batch, config.pooled_projection_dim}, gen);
  const auto window = algos::draw_sde_window(sampler, gen);
  const auto rollout = algos::sample_with_logprob(model, cond, sampler, window, gen);
  const auto adv = algos::group_advantages(torch::rand({a.batch}, gen), 2, {});
  return algos::flow_grpo_rows(rollout, adv.advantages, algos::flow_grpo_train_steps(window, 1));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Ulysses test worker"};
  Args a;
  app.add_option("--model", a.model);
  app.add_option("--loss", a.loss);
  app.add_option("--family", a.family, "llama, qwen3 or llama3 (--model llama)");
  app.add_option("--out", a.out)->required();
  app.add_option("--sp", a.sp);
  app.add_option("--fsdp-size", a.fsdp_size);
  app.add_option("--steps", a.steps);
  app.add_option("--batch", a.batch);
  app.add_option("--micro-batch", a.micro_batch, "rows a micro-batch (the same in every layout)");
  app.add_option("--kv-heads", a.kv_heads);
  app.add_option("--length", a.length, "tokens a sequence takes in (llama)");
  app.add_option("--prompt", a.prompt, "prompt tokens of a sequence (llama)");
  app.add_option("--lora-rank", a.lora_rank);
  app.add_option("--image", a.image, "latent side (sd3)");
  app.add_option("--text", a.text, "text tokens (sd3)");
  app.add_flag("--untied", a.untied, "an lm_head of its own (llama)");
  app.add_flag("--checkpointing", a.checkpointing, "activation checkpointing");
  app.add_flag("--remove-padding", a.remove_padding,
               "policy log-probs on packed sequences (verl's use_remove_padding)");
  CLI11_PARSE(app, argc, argv);

  auto world = dist::World::init_from_env();
  torch::manual_seed(0);  // the same initial weights in every layout
  auto config = a.model == "sd3" ? sd3_config(a) : llama_config(a);
  config.fsdp_size = a.fsdp_size;
  config.ulysses_sequence_parallel_size = a.sp;
  config.micro_batch_size_per_gpu = a.micro_batch;
  auto engine = engine::EngineRegistry::create(config, world);
  const auto& sp_group = engine->mesh().sequence_parallel_group();
  const int64_t dp = engine->data_parallel_size(), dp_rank = engine->data_parallel_rank();

  std::ofstream metrics_out;
  if (world->rank() == 0) {
    std::filesystem::create_directories(a.out);
    metrics_out.open(a.out + "/metrics.txt");
  }
  for (int64_t step = 0; step < a.steps; ++step) {
    engine::Batch global;
    engine::LossFn loss;
    if (a.model == "sd3") {
      global = sd3_rows(a, *engine, step);
    } else {
      global = llama_batch(a, step);
      if (a.loss == "policy") {
        // The rollout policy's log-probs: the model as it is, without grad, over the global
        // batch (a forward under sequence parallelism too).
        torch::NoGradGuard no_grad;
        global["old_log_probs"] = llama_log_probs(a, *engine, global);
      }
      loss = [&a](engine::Engine& e, const engine::MicroBatch& mb) { return llama_loss(a, e, mb); };
    }
    const int64_t rows = engine::batch_size(global);
    TORCH_CHECK(rows % dp == 0, rows, " rows do not split over ", dp, " data-parallel ranks");
    const auto mine = engine::slice_batch(global, dp_rank * (rows / dp), rows / dp);
    const auto metrics = loss ? engine->train_batch(mine, loss) : engine->train_batch(mine);
    if (world->rank() == 0) {
      metrics_out << fmt::format("{:.9e} {:.9e}\n", metrics.at("loss"), metrics.at("grad_norm"))
                  << std::flush;
    }
  }
  const auto params = engine->fsdp().full_parameters();
  if (world->rank() == 0) {
    std::filesystem::create_directories(a.out + "/final");
    testing::write_params(params, a.out + "/final");
  }
  nlohmann::json exchange = {{"rank", world->rank()},
                             {"sp", engine->mesh().sequence_parallel_size()},
                             {"bytes_sent", sp_group ? sp_group->bytes_sent() : 0}};
  std::ofstream(a.out + "/exchange." + std::to_string(world->rank()) + ".json") << exchange.dump();
  return 0;
}
