// One rank of the Engine tests: builds the built-in GPT through the registry, trains on its
// shard of a fixed global batch with train_batch, and writes the gathered parameters.
//   --mode train         train --steps steps (LoRA with --lora; LoRA+ with --loraplus-lr-ratio);
//                        --save-at N saves a checkpoint after step N into OUT/checkpoints,
//                        --resume DIR continues from a checkpoint (its step counts to --steps);
//                        --trace writes each step's FSDP schedule (fsdp/trace.h) to
//                        OUT/trace.RANK.json and the model's params (name, shape, requires_grad)
//                        to OUT/params.json
//   --mode forward_only  a reference engine: infer_batch only; writes params before and after
//   --mode weight_sync   two LoRA steps, then get_per_tensor_param as is, merged, in bf16 and
//                        trainable only;
//                        writes each, and the params gathered before and after the syncs
//   --mode pretrained    LoRA on the weights of --pretrained (model.path): writes the params as
//                        loaded, then trains one step
//   --mode diffusion     a tiny SD3 transformer of --model-type (diffusion_model,
//                        diffusion_nft_model or diffusion_dpo_model) with --lora-rank (0: full
//                        fine-tuning) trains --steps steps of its registered loss on rows of a
//                        rollout it samples: 6 samples per rank in groups of 2, 3 sampler steps
//                        (the SDE window: the first 2), so 12 rows per rank for Flow-GRPO, 18 for
//                        NFT, 3 pairs for DPO; --trace
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>

#include "fsdp/trace.h"
#include "shardrl/algos/diffusion_rl.h"
#include "shardrl/engine.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/sd3.h"
#include "shardrl/models/transformer.h"
#include "shardrl/optim.h"
#include "workers/param_files.h"

using namespace shardrl;

namespace {

engine::EngineConfig config(bool forward_only, int64_t micro_batch, bool offload,
                            const std::string& offload_dir, bool lora, bool policy) {
  engine::EngineConfig c;
  c.model_type = "language_model";
  c.model = {{"family", "gpt"},
             {"config",
              {{"vocab_size", 97},
               {"max_seq_len", 16},
               {"d_model", 32},
               {"n_heads", 4},
               {"n_layers", 2}}}};
  if (lora) c.model["lora_rank"] = 4;  // on q_proj and v_proj, scaled by 16 / 4
  c.micro_batch_size_per_gpu = micro_batch;
  c.forward_only = forward_only;
  c.offload.param_offload = c.offload.optimizer_offload = offload || policy;
  c.offload_policy = policy;
  c.offload.dir = offload_dir;
  c.optim.lr = 3e-3;
  c.optim.clip_grad = 1.0;
  c.optim.schedule.warmup_style = "cosine";
  c.optim.schedule.total_training_steps = 4;
  c.optim.schedule.lr_warmup_steps_ratio = 0.25;
  return c;
}

// verl-omni's diffusion engines on a tiny SD3 transformer (8x8 latents of 1 channel, 2 blocks)
// with one sampler (3 steps) for the rollout and the loss, and a reference (Flow-GRPO's KL, NFT's
// ref_kl_coef; DPO always has one).
engine::EngineConfig diffusion_config(const std::string& model_type, int64_t lora_rank,
                                      int64_t micro_batch) {
  engine::EngineConfig c;
  c.model_type = model_type;
  c.model = {{"config",
              {{"sample_size", 8},
               {"patch_size", 2},
               {"in_channels", 1},
               {"out_channels", 1},
               {"num_layers", 2},
               {"attention_head_dim", 8},
               {"num_attention_heads", 2},
               {"joint_attention_dim", 12},
               {"caption_projection_dim", 16},
               {"pooled_projection_dim", 12},
               {"pos_embed_max_size", 4}}},
             {"lora_rank", lora_rank}};
  c.micro_batch_size_per_gpu = micro_batch;
  c.optim.lr = 1e-3;
  // The reverse-step KL belongs to Flow-GRPO's engine; NFT's reference term is ref_kl_coef.
  c.loss = {{"kl_loss_coef", model_type == "diffusion_model" ? 0.04 : 0.0},
            {"ref_kl_coef", 0.1},
            {"sampler", {{"num_inference_steps", 3}, {"height", 8}, {"width", 8}}}};
  return c;
}

void add_columns(engine::Batch& rows, const engine::Batch& columns) {
  for (const auto& [name, column] : columns) rows[name] = column;
}

// One step's rows for the engine's loss, from a rollout of the engine's own model on random
// prompt embeddings, with the frozen policies' columns: the reference is the base (adapters
// disabled) under LoRA and, under full fine-tuning, the weights as they are (this worker keeps no
// second engine: what the columns hold does not matter to what it tests, only that they are
// there). NFT's old policy is the "old" adapter, or the weights as they are.
engine::Batch diffusion_rows(engine::Engine& engine, int64_t step, int rank) {
  auto& model = engine.model<models::SD3Transformer2DModel>();
  const auto& loss_json = engine.config().loss;
  const auto sampler = loss_json.at("sampler").get<algos::SamplerConfig>();
  auto loss = loss_json.get<algos::DiffusionLossConfig>();
  const auto& type = engine.config().model_type;
  loss.loss_mode = type == "diffusion_model"       ? "flow_grpo"
                   : type == "diffusion_nft_model" ? "diffusion_nft"
                                                   : "dpo";
  const bool lora = engine.config().model.value("lora_rank", 0) > 0;
  constexpr int64_t kSamples = 6, kGroup = 2, kTextTokens = 4;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 * step + rank);
  auto shared = at::make_generator<at::CPUGeneratorImpl>(1000 * step + 999);
  algos::Conditioning cond;
  cond.prompt_embeds = torch::randn({kSamples, kTextTokens, 12}, gen);
  cond.pooled_prompt_embeds = torch::randn({kSamples, 12}, gen);
  const auto window = algos::draw_sde_window(sampler, shared);
  const auto rollout = algos::sample_with_logprob(model, cond, sampler, window, gen);
  const auto rewards = torch::rand({kSamples}, gen);
  const auto adv = algos::group_advantages(rewards, kGroup, {}, &engine.world().group());
  engine::Batch rows;
  if (loss.loss_mode == "flow_grpo") {
    rows = algos::flow_grpo_rows(rollout, adv.advantages, algos::flow_grpo_train_steps(window, 1));
  } else if (loss.loss_mode == "diffusion_nft") {
    rows = algos::nft_rows(
        rollout, algos::nft_reward_prob(adv.advantages, "continuous", loss.adv_clip_max), 1, gen);
    std::optional<models::lora::UseAdapter> old;
    if (lora) old.emplace(*model, "old");
    add_columns(rows, algos::frozen_outputs("old", model, rows, loss, sampler));
  } else {
    rows = algos::dpo_rows(rollout, rewards, adv.group_ids, sampler.shift, gen);
  }
  if (loss.needs_reference()) {
    std::optional<models::lora::DisableAdapters> base;
    if (lora) base.emplace(*model);
    add_columns(rows, algos::frozen_outputs("reference", model, rows, loss, sampler));
  }
  return rows;
}

engine::Batch global_batch(int64_t step, int64_t size) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + step);
  return {{"tokens", torch::randint(97, {size, 16}, gen)}};
}

engine::LossOutput next_token(engine::Engine& e, const engine::MicroBatch& mb) {
  const auto& tokens = mb.data.at("tokens");
  auto logits = e.model<models::Transformer>()(tokens);
  auto loss = models::next_token_loss(logits, tokens);
  return {loss / mb.count, {{"token_loss", loss.item<double>()}}, {{"logits", logits.detach()}}};
}

// The FSDP events one train_batch recorded, as test_engine.cpp reads them.
nlohmann::json take_trace() {
  nlohmann::json events = nlohmann::json::array();
  for (const auto& r : fsdp::trace::take()) {
    events.push_back({{"event", fsdp::trace::name(r.event)},
                      {"unit", r.unit},
                      {"dtype", std::string(c10::toString(r.dtype))},
                      {"bytes", r.bytes}});
  }
  return events;
}

// Every param of the model as its module holds it (the full shape, also once sharded), for the
// test to work out from shapes alone what each unit's reduce-scatter carries.
nlohmann::json param_shapes(torch::nn::Module& module) {
  nlohmann::json params = nlohmann::json::array();
  for (const auto& item : module.named_parameters()) {
    params.push_back({{"name", item.key()},
                      {"shape", item.value().sizes().vec()},
                      {"requires_grad", item.value().requires_grad()}});
  }
  return params;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"engine test worker"};
  std::string mode = "train", out;
  int64_t steps = 3, batch = 8, micro_batch = 2;
  bool uneven = false, offload = false;
  app.add_option("--mode", mode);
  app.add_option("--out", out)->required();
  app.add_option("--steps", steps);
  app.add_option("--batch", batch);
  app.add_option("--micro-batch", micro_batch);
  app.add_flag("--uneven", uneven, "2 ranks: rank 0 takes 2/3 of the batch, rank 1 the rest");
  app.add_flag("--offload", offload, "param_offload + optimizer_offload with train_mode scopes");
  bool policy = false;
  app.add_flag("--offload-policy", policy, "offload_policy: the state stays offloaded in training");
  std::string pretrained;
  app.add_option("--pretrained", pretrained, "model.path");
  bool lora = false;
  app.add_flag("--lora", lora, "train LoRA adapters (mode train)");
  double loraplus_lr_ratio = 0;
  app.add_option("--loraplus-lr-ratio", loraplus_lr_ratio, "optim.loraplus_lr_ratio; 0: unset");
  int64_t save_at = 0;
  app.add_option("--save-at", save_at, "save a checkpoint after this step");
  std::string resume;
  app.add_option("--resume", resume, "checkpoint to continue from");
  bool trace = false;
  app.add_flag("--trace", trace, "record each step's FSDP schedule (modes train, diffusion)");
  std::string model_type = "diffusion_model";
  app.add_option("--model-type", model_type, "model_type (mode diffusion)");
  int64_t lora_rank = 4;
  app.add_option("--lora-rank", lora_rank, "model.lora_rank (mode diffusion)");
  CLI11_PARSE(app, argc, argv);

  auto world = dist::World::init_from_env();
  torch::manual_seed(0);  // the same initial weights at every world size
  auto engine_config = mode == "diffusion"
                           ? diffusion_config(model_type, lora_rank, micro_batch)
                           : config(mode == "forward_only", micro_batch, offload, out + "/offload",
                                    lora || mode == "weight_sync" || mode == "pretrained", policy);
  if (loraplus_lr_ratio > 0) engine_config.optim.loraplus_lr_ratio = loraplus_lr_ratio;
  if (!pretrained.empty()) engine_config.model["path"] = pretrained;
  auto engine = engine::EngineRegistry::create(engine_config, world);
  int64_t local = batch / engine->data_parallel_size();
  int64_t first = engine->data_parallel_rank() * local;
  if (uneven) {
    local = world->rank() == 0 ? 2 * batch / 3 : batch - 2 * batch / 3;
    first = world->rank() == 0 ? 0 : 2 * batch / 3;
  }
  auto gathered = [&] { return engine->fsdp().full_parameters(); };
  auto write = [&](const std::string& dir, const std::map<std::string, torch::Tensor>& params) {
    if (world->rank() != 0) return;
    std::filesystem::create_directories(dir);
    testing::write_params(params, dir);
  };

  nlohmann::json traced = nlohmann::json::array();
  auto write_trace = [&] {
    if (!trace) return;
    std::ofstream(out + "/trace." + std::to_string(world->rank()) + ".json") << traced.dump();
    if (world->rank() == 0)
      std::ofstream(out + "/params.json") << param_shapes(engine->module()).dump();
  };

  if (mode == "train") {
    std::ofstream metrics_out(out + "/metrics." + std::to_string(world->rank()) + ".txt");
    const int64_t first_step = resume.empty() ? 0 : engine->load_checkpoint(resume).step;
    fsdp::trace::set_enabled(trace);
    for (int64_t step = first_step; step < steps; ++step) {
      auto data = engine::slice_batch(global_batch(step, batch), first, local);
      engine::Metrics metrics;
      {
        auto scope = engine->train_mode();
        metrics = engine->train_batch(data, next_token);
      }
      if (trace) traced.push_back(take_trace());
      if (offload) {
        // Between phases the state waits in the file tier: nothing of it is resident.
        const auto memory = engine->memory();
        TORCH_CHECK(memory.params.resident == 0 && memory.optimizer.resident == 0,
                    "train_mode left state resident: ", memory.params.resident, " param bytes, ",
                    memory.optimizer.resident, " optimizer bytes");
        // Seen from the optimizers themselves, not through offload's own accounting: every part
        // of a grouped optimizer (verl's MultiOptimizer bug offloaded only the first).
        for (auto* leaf : optim::leaf_optimizers(*engine->optimizer())) {
          for (const auto& entry : leaf->state()) {
            for (const auto& t : optim::state_tensors(*entry.second)) {
              TORCH_CHECK(t.storage().nbytes() == 0, "optimizer state of ", t.numel(),
                          " elements is still resident after train_mode");
            }
          }
        }
      }
      metrics_out << metrics.at("loss") << " " << metrics.at("grad_norm") << " " << metrics.at("lr")
                  << "\n";
      if (step + 1 == save_at) engine->save_checkpoint(out + "/checkpoints", save_at);
    }
    write_trace();
    write(out + "/final", gathered());
  } else if (mode == "diffusion") {
    for (int64_t step = 0; step < steps; ++step) {
      const auto rows = diffusion_rows(*engine, step, world->rank());
      // Only the update is traced: the rollout and the frozen columns gather too.
      fsdp::trace::set_enabled(trace);
      const auto metrics = engine->train_batch(rows);
      fsdp::trace::set_enabled(false);
      if (trace) traced.push_back(take_trace());
      TORCH_CHECK(std::isfinite(metrics.at("loss")), "loss ", metrics.at("loss"));
    }
    write_trace();
  } else if (mode == "forward_only") {
    write(out + "/before", gathered());
    auto data = engine::slice_batch(global_batch(0, batch), first, local);
    auto outputs = engine->infer_batch(data, next_token);
    TORCH_CHECK(outputs.at("logits").size(0) == local, "infer_batch lost samples");
    write(out + "/after", gathered());
  } else if (mode == "weight_sync") {
    for (int64_t step = 0; step < 2; ++step) {  // the first step's warmup lr is 0
      auto scope = engine->train_mode();
      engine->train_batch(engine::slice_batch(global_batch(step, batch), first, local), next_token);
    }
    auto gathered_in_scope = [&] {
      if (policy) {  // the policy's state lives in the tier: bring it in by hand
        engine->onload();
        auto params = gathered();
        engine->offload();
        return params;
      }
      auto scope = engine->train_mode();
      return gathered();
    };
    write(out + "/before", gathered_in_scope());
    auto sync = [&](const std::string& name, engine::Engine::WeightSyncOptions options) {
      std::map<std::string, torch::Tensor> received;
      engine->get_per_tensor_param(
          [&](const std::string& n, const torch::Tensor& t) {
            TORCH_CHECK(t.scalar_type() == options.dtype, n, " came as ", t.scalar_type());
            received[n] = t.to(torch::kFloat);
          },
          options);
      if (offload || policy) {
        const auto memory = engine->memory();
        TORCH_CHECK(memory.params.resident == 0 && memory.optimizer.resident == 0,
                    "the weight sync left state resident");
      }
      write(out + "/" + name, received);
    };
    sync("plain", {torch::kFloat, "", ""});
    sync("merged", {torch::kFloat, "", "default"});
    sync("bf16", {torch::kBFloat16, "model.", ""});
    sync("trainable", {torch::kFloat, "", "", /*trainable_only=*/true});
    write(out + "/after", gathered_in_scope());
  } else if (mode == "pretrained") {
    write(out + "/loaded", gathered());
    auto scope = engine->train_mode();
    for (int64_t step = 0; step < 2; ++step) {  // the first step's warmup lr is 0
      auto metrics = engine->train_batch(
          engine::slice_batch(global_batch(step, batch), first, local), next_token);
      TORCH_CHECK(std::isfinite(metrics.at("loss")), "loss ", metrics.at("loss"));
    }
    write(out + "/trained", gathered());
  } else {
    throw std::invalid_argument("--mode: unknown mode " + mode);
  }
  return 0;
}
