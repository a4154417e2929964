// Task "diffusion_rl": RL post-training of a class-conditional diffusion transformer on real
// images (Fashion-MNIST), the main job `make demo` runs.
//   1. a small CNN classifier trains on the images: the reward model;
//   2. a DiT pretrains on them with flow matching (the supervised stage);
//   3. Flow-GRPO, DiffusionNFT or Diffusion-DPO (algorithm.name) tunes LoRA adapters on the DiT,
//      built by the engine registry, so that samples become unmistakable instances of the
//      requested class (reward: the classifier's probability of that class).
// Every stage is sharded over the ranks. Stages 1 and 2 are cached under pretrain.cache_dir, so
// a second run goes straight to RL; the RL stage checkpoints every trainer.save_freq steps and
// trainer.resume=auto continues it.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>

#include "shardrl/algos/dit_rl.h"
#include "shardrl/data.h"
#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/lr_schedule.h"
#include "shardrl/models/classifier.h"
#include "shardrl/models/dit.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/weights.h"
#include "shardrl/optim.h"
#include "tasks.h"

namespace shardrl::trainer {
namespace {

namespace fs = std::filesystem;

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Options {
  std::string data_dir, run_dir, cache_dir;
  uint64_t seed = 0;
  int64_t image_size, patch_size, hidden, depth, heads;
  int64_t classifier_steps, classifier_batch;
  int64_t pretrain_steps, pretrain_batch;
  double pretrain_lr;
  std::string algorithm;
  int64_t rl_steps, groups_per_rank, group_size, micro_batch, mini_batches;
  int64_t sample_steps;
  double noise_level, guidance, shift, beta;
  double clip_range, timestep_fraction, nft_beta, dpo_beta;
  std::string reward_mode;
  int64_t eval_per_class;

  explicit Options(const nlohmann::json& c) {
    data_dir = get<std::string>(c, "data.data_dir");
    run_dir = get<std::string>(c, "trainer.default_local_dir");
    cache_dir = get<std::string>(c, "pretrain.cache_dir");
    if (cache_dir.empty()) cache_dir = run_dir + "/cache";
    seed = get<uint64_t>(c, "trainer.seed");
    image_size = get<int64_t>(c, "data.image_size");
    const auto& dit = at(c, "actor_rollout_ref.model.config");
    patch_size = get<int64_t>(dit, "patch_size");
    hidden = get<int64_t>(dit, "hidden_size");
    depth = get<int64_t>(dit, "depth");
    heads = get<int64_t>(dit, "num_heads");
    classifier_steps = get<int64_t>(c, "reward_model.steps");
    classifier_batch = get<int64_t>(c, "reward_model.batch_size");
    reward_mode = get<std::string>(c, "reward_model.reward_mode");
    pretrain_steps = get<int64_t>(c, "pretrain.steps");
    pretrain_batch = get<int64_t>(c, "pretrain.batch_size");
    pretrain_lr = get<double>(c, "pretrain.lr");
    algorithm = get<std::string>(c, "algorithm.name");
    rl_steps = get<int64_t>(c, "trainer.total_training_steps");
    groups_per_rank = get<int64_t>(c, "actor_rollout_ref.rollout.groups_per_gpu");
    group_size = get<int64_t>(c, "actor_rollout_ref.rollout.n");
    sample_steps = get<int64_t>(c, "actor_rollout_ref.rollout.num_steps");
    noise_level = get<double>(c, "actor_rollout_ref.rollout.noise_level");
    guidance = get<double>(c, "actor_rollout_ref.rollout.guidance_scale");
    shift = get<double>(c, "actor_rollout_ref.rollout.shift");
    micro_batch = get<int64_t>(c, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu");
    mini_batches = get<int64_t>(c, "actor_rollout_ref.actor.ppo_mini_batches");
    beta = get<double>(c, "algorithm.kl_beta");
    clip_range = get<double>(c, "algorithm.clip_range");
    timestep_fraction = get<double>(c, "algorithm.timestep_fraction");
    nft_beta = get<double>(c, "algorithm.nft_beta");
    dpo_beta = get<double>(c, "algorithm.dpo_beta");
    eval_per_class = get<int64_t>(c, "evaluation.per_class");
  }
};

std::string classifier_key(const Options& o) {
  return fmt::format("classifier-s{}-n{}-seed{}", o.image_size, o.classifier_steps, o.seed);
}
std::string dit_key(const Options& o) {
  return fmt::format("dit-s{}-p{}-h{}-d{}-n{}-b{}-seed{}", o.image_size, o.patch_size, o.hidden,
                     o.depth, o.pretrain_steps, o.pretrain_batch, o.seed);
}

int64_t count_params(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

// The reward classifier, trained sharded (rank 0 writes the cache while the others wait), then
// loaded unsharded on every rank: rewards need no collectives.
models::ImageClassifier reward_model(const Options& o, const data::ImageDataset& train,
                                     const data::ImageDataset& test, const dist::DeviceMesh& mesh,
                                     dist::World& world) {
  const bool lead = world.rank() == 0;
  const std::string dir = o.cache_dir + "/" + classifier_key(o);
  models::ClassifierConfig config;
  config.input_size = o.image_size;
  if (!fs::exists(dir + "/model.safetensors")) {
    const auto start = Clock::now();
    torch::manual_seed(o.seed);
    models::ImageClassifier net(config);
    fsdp::fully_shard(net, mesh, {});
    models::ClassifierFitOptions fit;
    fit.steps = o.classifier_steps;
    fit.global_batch = o.classifier_batch;
    fit.seed = o.seed;
    fit.log = [&](int64_t step, double loss, double acc) {
      if (lead) {
        std::cout << fmt::format("classifier step {:4d}/{}  loss {:.4f}  batch acc {:.3f}\n", step,
                                 fit.steps, loss, acc)
                  << std::flush;
      }
    };
    models::fit_classifier(net, train.images, train.labels, fit);
    auto params = net.fsdp().full_parameters();
    if (lead) {
      fs::create_directories(dir);
      models::save_weights(params, dir + "/model.safetensors.tmp");
      write_json(dir + "/config.json", config.to_json());
      fs::rename(dir + "/model.safetensors.tmp", dir + "/model.safetensors");
      std::cout << fmt::format("classifier trained in {:.1f} s -> {}\n", since(start), dir);
    }
    world.group().barrier();
  } else if (lead) {
    std::cout << "classifier: cached " << dir << "\n";
  }
  models::ImageClassifier net(config);
  models::load_weights(*net, dir + "/model.safetensors");
  net->eval();
  const double acc = models::classifier_accuracy(net, test.images, test.labels);
  if (lead)
    std::cout << fmt::format("classifier test accuracy (t10k): {:.4f}\n", acc) << std::flush;
  return net;
}

models::DiTConfig dit_config(const Options& o) {
  models::DiTConfig c;
  c.input_size = o.image_size;
  c.patch_size = o.patch_size;
  c.hidden_size = o.hidden;
  c.depth = o.depth;
  c.num_heads = o.heads;
  return c;
}

// The supervised stage: flow matching on the training images, sharded; cached.
std::string pretrained_dit(const Options& o, const nlohmann::json& config,
                           const data::ImageDataset& train,
                           const std::shared_ptr<dist::World>& world) {
  const bool lead = world->rank() == 0;
  const std::string dir = o.cache_dir + "/" + dit_key(o);
  if (fs::exists(dir + "/model.safetensors")) {
    if (lead) std::cout << "pretrained DiT: cached " << dir << "\n";
    return dir;
  }
  const auto start = Clock::now();
  const auto dit = dit_config(o);
  // The same engine as the RL stage, without adapters and with the supervised stage's schedule.
  nlohmann::json stage = config;
  auto& model_json = stage["actor_rollout_ref"]["model"];
  model_json["config"] = dit.to_json();
  model_json["lora_rank"] = 0;
  auto& optim_json = stage["actor_rollout_ref"]["actor"]["optim"];
  optim_json["lr"] = o.pretrain_lr;
  optim_json["weight_decay"] = 0.0;
  optim_json["clip_grad"] = 1.0;
  optim_json["warmup_style"] = "cosine";
  optim_json["lr_warmup_steps"] = std::min<int64_t>(50, o.pretrain_steps / 10);
  optim_json["min_lr_ratio"] = 0.1;
  optim_json["loraplus_lr_ratio"] = nullptr;  // no adapters here
  stage["actor_rollout_ref"]["actor"]["ppo_micro_batch_size_per_gpu"] = 0;
  stage["trainer"]["total_training_steps"] = o.pretrain_steps;
  torch::manual_seed(o.seed);
  auto engine =
      engine::EngineRegistry::create(engine_config(stage, "diffusion_model", "actor"), world);
  auto& model = engine->model<models::DiT>();
  data::DistributedSampler sampler(train.size(), o.pretrain_batch, engine->data_parallel_rank(),
                                   engine->data_parallel_size(), o.seed);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 7919 + 17 + world->rank());
  const algos::dit::FlowMatchingLossConfig fm;
  const engine::LossFn flow_matching = [&](engine::Engine&, const engine::MicroBatch& mb) {
    auto loss =
        algos::dit::flow_matching_loss(model, mb.data.at("images"), mb.data.at("labels"), fm, gen);
    return engine::LossOutput{loss / mb.count, {}, {}};
  };
  if (lead) {
    std::cout << fmt::format(
                     "pretraining DiT ({} params, {} tokens/image) for {} steps, batch {}\n",
                     count_params(engine->module()), dit.grid_size() * dit.grid_size(),
                     o.pretrain_steps, o.pretrain_batch)
              << std::flush;
  }
  double window = 0;
  for (int64_t step = 0; step < o.pretrain_steps; ++step) {
    auto idx = sampler.indices(step);
    auto metrics = engine->train_batch({{"images", train.images.index_select(0, idx)},
                                        {"labels", train.labels.index_select(0, idx)}},
                                       flow_matching);
    window += metrics["loss"];
    if ((step + 1) % 100 == 0 || step + 1 == o.pretrain_steps) {
      if (lead) {
        std::cout << fmt::format(
                         "pretrain step {:5d}/{}  loss {:.4f}  grad_norm {:.3f}  {:.1f} s\n",
                         step + 1, o.pretrain_steps, window / ((step % 100) + 1),
                         metrics["grad_norm"], since(start))
                  << std::flush;
      }
      window = 0;
    }
  }
  auto params = engine->fsdp().full_parameters();
  if (lead) {
    models::save_dit(params, dit, dir + ".tmp");
    fs::remove_all(dir);
    fs::rename(dir + ".tmp", dir);
    std::cout << fmt::format("pretraining took {:.1f} s -> {}\n", since(start), dir) << std::flush;
  }
  world->group().barrier();
  return dir;
}

// The fixed evaluation set: eval_per_class samples of every class, split over the ranks and
// gathered, with the same seed before and after RL.
struct Evaluation {
  torch::Tensor images;  // [10 * per_class, 1, H, W], class-major
  double reward = 0, accuracy = 0;
};

Evaluation evaluate(models::DiT& model, models::ImageClassifier& classifier, const Options& o,
                    const algos::dit::RolloutConfig& rollout, dist::World& world) {
  const int64_t total = 10 * o.eval_per_class;
  const int64_t local = (total + world.size() - 1) / world.size();
  auto all_labels = torch::arange(10, torch::kLong).repeat_interleave(o.eval_per_class);
  all_labels = torch::cat({all_labels, torch::zeros({local * world.size() - total}, torch::kLong)});
  auto mine = all_labels.narrow(0, world.rank() * local, local);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed + 4242 + world.rank());
  auto images = algos::dit::sample_with_logprob(model, mine, rollout, gen).images().contiguous();
  auto gathered =
      torch::empty({world.size() * local, images.size(1), images.size(2), images.size(3)});
  world.group().all_gather(images, gathered);
  Evaluation e;
  e.images = gathered.narrow(0, 0, total);
  auto labels = all_labels.narrow(0, 0, total);
  e.reward = models::classifier_reward(classifier, e.images, labels, "prob").mean().item<double>();
  torch::NoGradGuard no_grad;
  e.accuracy = (classifier(e.images).argmax(1) == labels).to(torch::kFloat).mean().item<double>();
  return e;
}

int run(const Options& o, const nlohmann::json& config, std::shared_ptr<dist::World> world) {
  auto mesh = dist::DeviceMesh::create(*world);
  const bool lead = world->rank() == 0;
  if (lead) fs::create_directories(o.run_dir);
  const auto t0 = Clock::now();

  data::ImageDatasetOptions ds;
  ds.image_size = o.image_size;
  auto train = data::load_image_dataset(o.data_dir + "/train-images-idx3-ubyte.gz",
                                        o.data_dir + "/train-labels-idx1-ubyte.gz", ds);
  auto test = data::load_image_dataset(o.data_dir + "/t10k-images-idx3-ubyte.gz",
                                       o.data_dir + "/t10k-labels-idx1-ubyte.gz", ds);
  if (lead) {
    std::cout << fmt::format("Fashion-MNIST: {} train / {} test images at {}x{}, {} ranks\n",
                             train.size(), test.size(), o.image_size, o.image_size, world->size())
              << std::flush;
  }

  auto t_stage = Clock::now();
  auto classifier = reward_model(o, train, test, mesh, *world);
  const double classifier_seconds = since(t_stage);
  t_stage = Clock::now();
  const auto dit_dir = pretrained_dit(o, config, train, world);
  const double pretrain_seconds = since(t_stage);

  // The RL policy: the pretrained base, frozen, with LoRA adapters (NFT adds its "old" one).
  nlohmann::json engine_json = config;
  auto& model_json = engine_json["actor_rollout_ref"]["model"];
  model_json["path"] = dit_dir;
  model_json["config"] = dit_config(o).to_json();
  const std::string model_type = o.algorithm == "flow_grpo" ? "diffusion_model"
                                 : o.algorithm == "nft"     ? "diffusion_nft_model"
                                                            : "diffusion_dpo_model";
  torch::manual_seed(o.seed + 1);
  auto engine =
      engine::EngineRegistry::create(engine_config(engine_json, model_type, "actor"), world);
  auto& model = engine->model<models::DiT>();

  algos::dit::DiffusionRLConfig rl;
  rl.algorithm = o.algorithm;
  rl.rollout.num_steps = o.sample_steps;
  rl.rollout.noise_level = o.noise_level;
  rl.rollout.guidance_scale = o.guidance;
  rl.rollout.shift = o.shift;
  rl.group_size = o.group_size;
  rl.micro_batch_size = o.micro_batch;
  rl.mini_batches = o.mini_batches;
  rl.timestep_fraction = o.timestep_fraction;
  rl.max_grad_norm = engine->config().optim.clip_grad;
  rl.flow_grpo.beta = o.beta;
  rl.flow_grpo.clip_range = o.clip_range;
  rl.nft.beta = o.nft_beta;
  rl.dpo.beta = o.dpo_beta;
  rl.validate();

  auto reward = [&](const torch::Tensor& images, const torch::Tensor& labels) {
    return models::classifier_reward(classifier, images, labels, o.reward_mode);
  };

  // The rollout engine: an unsharded replica on each rank, so sampling runs without collectives
  // while the trainer's state waits offloaded (param_offload / optimizer_offload). Before every
  // rollout the weight sync streams the trainer's params into it with the behaviour policy's
  // adapter merged, as verl syncs a LoRA actor into a rollout engine without LoRA support.
  models::DiT rollout_model(dit_config(o));
  for (auto& p : rollout_model->parameters()) p.set_requires_grad(false);
  auto rollout_params = rollout_model->named_parameters();
  engine::Engine::WeightSyncOptions sync;
  sync.dtype = torch::kFloat;  // the rollout computes in fp32 on CPU
  sync.merge_adapter = o.algorithm == "nft" ? "old" : "default";
  auto sync_weights = [&] {
    torch::NoGradGuard no_grad;
    size_t received = 0;
    engine->get_per_tensor_param(
        [&](const std::string& name, const torch::Tensor& full) {
          auto* param = rollout_params.find(name);
          if (!param) throw std::runtime_error("weight sync: the rollout model has no " + name);
          param->copy_(full);
          ++received;
        },
        sync);
    if (received != rollout_params.size()) {
      throw std::runtime_error(fmt::format("weight sync: {} of the rollout model's {} params came",
                                           received, rollout_params.size()));
    }
  };

  Run run(config, *world);
  const int64_t first_step = run.resume(*engine) + 1;
  std::optional<Evaluation> before;
  if (first_step == 1) {
    sync_weights();
    before = evaluate(rollout_model, classifier, o, rl.rollout, *world);
    if (lead) {
      data::write_png(o.run_dir + "/samples_before.png",
                      data::image_grid(before->images, o.eval_per_class, 2, 3));
      std::cout << fmt::format(
                       "before RL: eval reward (p(class)) {:.4f}, classifier agrees {:.3f}  -> "
                       "{}\n",
                       before->reward, before->accuracy, o.run_dir + "/samples_before.png")
                << std::flush;
    }
  }

  const int64_t groups = o.groups_per_rank * world->size();
  auto rl_start = Clock::now();
  for (int64_t step = first_step; step <= o.rl_steps; ++step) {
    const auto step_start = Clock::now();
    // Classes cycle through all ten; each rank takes its groups.
    auto classes = (torch::arange(groups, torch::kLong) + (step - 1) * groups) % 10;
    auto labels = classes.narrow(0, world->rank() * o.groups_per_rank, o.groups_per_rank)
                      .repeat_interleave(o.group_size);
    // Seeded by step, so a resumed run draws the same noise as an uninterrupted one.
    auto gen =
        at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003 + step * 131 + world->rank());
    const double offload_before = engine->offload_seconds();
    const auto sync_start = Clock::now();
    sync_weights();
    const double sync_seconds = since(sync_start);
    const double sync_offload = engine->offload_seconds() - offload_before;
    auto result =
        algos::dit::diffusion_rl_rollout(rollout_model, reward, labels, rl, gen, &world->group());
    {
      auto training = engine->train_mode();
      algos::dit::diffusion_rl_update(model, *engine->optimizer(), result, step - 1, rl, gen);
    }
    result.seconds["weight_sync"] = sync_seconds - sync_offload;
    result.seconds["offload"] = engine->offload_seconds() - offload_before;
    engine::Metrics metrics{{"reward_mean", result.reward_mean},
                            {"reward_std", result.reward_std},
                            {"grad_norm", result.grad_norm},
                            {"lr", engine->current_lr()}};
    for (const auto& [name, value] : result.metrics) metrics[name] = value.item<double>();
    metrics = engine->average_over_ranks(metrics);
    engine->lr_scheduler_step();
    for (const auto& [phase, seconds] : result.seconds) metrics["time_" + phase] = seconds;
    metrics["step_time"] = since(step_start);
    run.after_step(*engine, step, metrics);
  }
  const double rl_seconds = since(rl_start);
  const int64_t rl_steps_run = std::max<int64_t>(o.rl_steps - first_step + 1, 1);

  sync_weights();
  auto after = evaluate(rollout_model, classifier, o, rl.rollout, *world);
  if (lead) {
    data::write_png(o.run_dir + "/samples_after.png",
                    data::image_grid(after.images, o.eval_per_class, 2, 3));
    const auto curve =
        summarize_run(o.run_dir, fmt::format("{} reward (p(class)) per step", o.algorithm));
    std::string phase_line;
    for (const auto& [phase, mean] : curve.phase_seconds_per_step.items()) {
      phase_line +=
          fmt::format("{}{} {:.3f}", phase_line.empty() ? "" : ", ", phase, mean.get<double>());
    }
    nlohmann::json summary{{"classifier_seconds", classifier_seconds},
                           {"pretrain_seconds", pretrain_seconds},
                           {"rl_seconds", rl_seconds},
                           {"rl_seconds_per_step", rl_seconds / rl_steps_run},
                           {"rl_phase_seconds_per_step", curve.phase_seconds_per_step},
                           {"eval_reward_after", after.reward},
                           {"eval_accuracy_after", after.accuracy},
                           {"total_seconds", since(t0)}};
    if (before) {
      summary["eval_reward_before"] = before->reward;
      summary["eval_accuracy_before"] = before->accuracy;
    }
    write_json(o.run_dir + "/summary.json", summary);
    std::cout << fmt::format(
                     "after RL: eval reward (p(class)) {:.4f}{}, classifier agrees {:.3f}\n"
                     "timings: classifier {:.1f} s, pretrain {:.1f} s, RL {:.1f} s ({:.2f} "
                     "s/step), total {:.1f} s\n"
                     "RL phases, s/step: {}\n"
                     "wrote {}/samples_before.png, samples_after.png, reward_curve.png, "
                     "metrics.jsonl\n",
                     after.reward,
                     before ? fmt::format(" (before {:.4f})", before->reward) : std::string(),
                     after.accuracy, classifier_seconds, pretrain_seconds, rl_seconds,
                     rl_seconds / rl_steps_run, since(t0), phase_line, o.run_dir)
              << std::flush;
  }
  world->group().barrier();
  return 0;
}

}  // namespace

nlohmann::json diffusion_rl_defaults() {
  nlohmann::json d = {
      {"trainer",
       {{"task", "diffusion_rl"},
        {"experiment_name", "fmnist_flow_grpo"},
        {"default_local_dir", "runs/demo"},
        {"total_training_steps", 30},
        {"save_freq", 10},
        {"max_actor_ckpt_to_keep", 1}}},
      {"data", {{"data_dir", "/usr/share/datasets/fashion-mnist"}, {"image_size", 28}}},
      {"reward_model", {{"steps", 400}, {"batch_size", 128}, {"reward_mode", "prob"}}},
      {"pretrain", {{"steps", 1500}, {"batch_size", 128}, {"lr", 2e-3}, {"cache_dir", ""}}},
      {"algorithm",
       {{"name", "flow_grpo"},
        {"kl_beta", 0.0},
        {"clip_range", 1e-4},
        {"timestep_fraction", 1.0},
        {"nft_beta", 1.0},
        {"dpo_beta", 100.0}}},
      {"evaluation", {{"per_class", 8}}},
      {"actor_rollout_ref", engine_defaults()}};
  auto& arr = d["actor_rollout_ref"];
  arr["model"]["family"] = "dit";
  arr["model"]["config"] = {{"patch_size", 4}, {"hidden_size", 64}, {"depth", 2}, {"num_heads", 4}};
  arr["model"]["lora_rank"] = 16;
  arr["model"]["lora_alpha"] = 32.0;
  arr["model"]["target_modules"] = {"qkv", "proj", "fc1", "fc2"};
  arr["actor"]["optim"]["lr"] = 1e-3;
  arr["actor"]["optim"]["weight_decay"] = 1e-4;
  arr["actor"]["ppo_micro_batch_size_per_gpu"] = 16;
  arr["actor"]["ppo_mini_batches"] = 1;
  arr["rollout"] = {{"n", 8},
                    {"groups_per_gpu", 2},
                    {"num_steps", 10},
                    {"noise_level", 0.7},
                    {"guidance_scale", 1.5},
                    {"shift", 1.0}};
  return d;
}

int run_diffusion_rl(const nlohmann::json& config, std::shared_ptr<dist::World> world) {
  const Options options(config);
  if (options.algorithm != "flow_grpo" && options.algorithm != "nft" &&
      options.algorithm != "dpo") {
    throw std::invalid_argument("config key 'algorithm.name' must be flow_grpo, nft or dpo, got '" +
                                options.algorithm + "'");
  }
  return run(options, config, std::move(world));
}

}  // namespace shardrl::trainer
