// The main demo: RL post-training of a class-conditional diffusion transformer on real images.
//   1. a small CNN classifier trains on Fashion-MNIST: the reward model;
//   2. a DiT pretrains on Fashion-MNIST with flow matching (the supervised stage);
//   3. Flow-GRPO (or DiffusionNFT / Diffusion-DPO) tunes LoRA adapters on the DiT so that the
//      samples become unmistakable instances of the requested class (reward: the classifier's
//      probability of that class).
// All three stages are sharded with FSDP over the ranks. Stages 1 and 2 are cached in
// --cache-dir, so a second run goes straight to RL. Start it on N ranks:
//   shardrl launch -n 2 -- build/bin/fmnist_flow_grpo --run-dir runs/demo
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "shardrl/algos/diffusion_rl.h"
#include "shardrl/data.h"
#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/lr_schedule.h"
#include "shardrl/models/classifier.h"
#include "shardrl/models/dit.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/weights.h"
#include "shardrl/optim.h"

using namespace shardrl;
namespace fs = std::filesystem;

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

struct Options {
  std::string data_dir = "/usr/share/datasets/fashion-mnist";
  std::string run_dir = "runs/demo";
  std::string cache_dir;  // default: <run_dir>/cache
  uint64_t seed = 0;
  // Data and models.
  int64_t image_size = 28, patch_size = 4, hidden = 64, depth = 2, heads = 4;
  int64_t classifier_steps = 400, classifier_batch = 128;
  // Supervised stage.
  int64_t pretrain_steps = 1500, pretrain_batch = 128;
  double pretrain_lr = 2e-3;
  // RL stage.
  std::string algorithm = "flow_grpo";
  int64_t rl_steps = 30, groups_per_rank = 2, group_size = 8, micro_batch = 16, mini_batches = 1;
  int64_t sample_steps = 10, lora_r = 16;
  double lora_alpha = 32, lr = 1e-3, noise_level = 0.7, guidance = 1.5, shift = 1.0, beta = 0.0;
  double clip_range = 1e-4, timestep_fraction = 1.0, nft_beta = 1.0, dpo_beta = 100.0;
  std::string reward_mode = "prob";
  int64_t eval_per_class = 8;
};

std::string classifier_key(const Options& o) {
  return fmt::format("classifier-s{}-n{}-seed{}", o.image_size, o.classifier_steps, o.seed);
}
std::string dit_key(const Options& o) {
  return fmt::format("dit-s{}-p{}-h{}-d{}-n{}-b{}-seed{}", o.image_size, o.patch_size, o.hidden,
                     o.depth, o.pretrain_steps, o.pretrain_batch, o.seed);
}

void write_json(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path);
  if (!out) throw std::runtime_error("cannot write " + path);
  out << j.dump(2) << "\n";
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
std::string pretrained_dit(const Options& o, const data::ImageDataset& train,
                           const dist::DeviceMesh& mesh, dist::World& world) {
  const bool lead = world.rank() == 0;
  const std::string dir = o.cache_dir + "/" + dit_key(o);
  if (fs::exists(dir + "/model.safetensors")) {
    if (lead) std::cout << "pretrained DiT: cached " << dir << "\n";
    return dir;
  }
  const auto start = Clock::now();
  const auto config = dit_config(o);
  torch::manual_seed(o.seed);
  models::DiT model(config);
  const int64_t params_total = count_params(*model);
  models::shard_dit(model, mesh, {});
  auto sharded = model.fsdp();
  optim::AdamWConfig adam;
  adam.lr = o.pretrain_lr;
  adam.weight_decay = 0.0;
  auto optimizer = optim::make_adamw(optim::from_sharded(sharded.sharded_parameters()), adam);
  optim::LRScheduleConfig schedule;
  schedule.warmup_style = "cosine";
  schedule.lr_warmup_steps = std::min<int64_t>(50, o.pretrain_steps / 10);
  schedule.total_training_steps = o.pretrain_steps;
  schedule.min_lr_ratio = 0.1;
  optim::LRScheduler lr(*optimizer, schedule);
  data::DistributedSampler sampler(train.size(), o.pretrain_batch, mesh.data_parallel_rank(),
                                   mesh.data_parallel_size(), o.seed);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 7919 + 17 + world.rank());
  algos::FlowMatchingLossConfig fm;
  if (lead) {
    std::cout << fmt::format(
                     "pretraining DiT ({} params, {} tokens/image) for {} steps, batch {}\n",
                     params_total, config.grid_size() * config.grid_size(), o.pretrain_steps,
                     o.pretrain_batch)
              << std::flush;
  }
  double window = 0;
  for (int64_t step = 0; step < o.pretrain_steps; ++step) {
    auto idx = sampler.indices(step);
    sharded.zero_grad();
    auto loss = algos::flow_matching_loss(model, train.images.index_select(0, idx),
                                          train.labels.index_select(0, idx), fm, gen);
    loss.backward();
    auto result = optim::clip_and_step(sharded, *optimizer, 1.0);
    lr.step();
    window += loss.item<double>();
    if ((step + 1) % 100 == 0 || step + 1 == o.pretrain_steps) {
      auto mean = torch::tensor({window / ((step % 100) + 1)});
      world.group().all_reduce(mean);
      window = 0;
      if (lead) {
        std::cout << fmt::format(
                         "pretrain step {:5d}/{}  loss {:.4f}  grad_norm {:.3f}  {:.1f} s\n",
                         step + 1, o.pretrain_steps, mean.item<double>() / world.size(),
                         result.grad_norm, since(start))
                  << std::flush;
      }
    }
  }
  auto params = sharded.full_parameters();
  if (lead) {
    models::save_dit(params, config, dir + ".tmp");
    fs::remove_all(dir);
    fs::rename(dir + ".tmp", dir);
    std::cout << fmt::format("pretraining took {:.1f} s -> {}\n", since(start), dir) << std::flush;
  }
  world.group().barrier();
  return dir;
}

// The fixed evaluation set: eval_per_class samples of every class, split over the ranks and
// gathered, with the same seed before and after RL.
struct Evaluation {
  torch::Tensor images;  // [10 * per_class, 1, H, W], class-major
  double reward = 0, accuracy = 0;
};

Evaluation evaluate(models::DiT& model, models::ImageClassifier& classifier, const Options& o,
                    const algos::RolloutConfig& rollout, dist::World& world) {
  const int64_t total = 10 * o.eval_per_class;
  const int64_t local = (total + world.size() - 1) / world.size();
  auto all_labels = torch::arange(10, torch::kLong).repeat_interleave(o.eval_per_class);
  all_labels = torch::cat({all_labels, torch::zeros({local * world.size() - total}, torch::kLong)});
  auto mine = all_labels.narrow(0, world.rank() * local, local);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed + 4242 + world.rank());
  auto images = algos::sample_with_logprob(model, mine, rollout, gen).images().contiguous();
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

int run(const Options& o) {
  auto world = dist::World::init_from_env();
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
  const auto dit_dir = pretrained_dit(o, train, mesh, *world);
  const double pretrain_seconds = since(t_stage);

  // The RL policy: the pretrained base, frozen, with LoRA adapters on attention and MLP.
  models::DiT model(dit_config(o));
  models::load_weights(*model, dit_dir + "/model.safetensors");
  models::lora::LoraConfig lora;
  lora.r = o.lora_r;
  lora.alpha = o.lora_alpha;
  lora.target_modules = {"qkv", "proj", "fc1", "fc2"};
  torch::manual_seed(o.seed + 1);
  models::lora::apply_lora(*model, lora, "default");
  if (o.algorithm == "nft") {
    models::lora::apply_lora(*model, lora, "old", /*trainable=*/false);
    models::lora::set_active_adapter(*model, "default");
  }
  models::shard_dit(model, mesh, {});
  auto sharded = model.fsdp();
  if (o.algorithm == "nft") {
    models::lora::copy_adapter(models::lora::named_tensors(sharded.sharded_parameters()), "old",
                               "default");
  }
  optim::AdamWConfig adam;
  adam.lr = o.lr;
  adam.weight_decay = 1e-4;
  auto optimizer = optim::make_adamw(optim::from_sharded(sharded.sharded_parameters()), adam);

  algos::DiffusionRLConfig rl;
  rl.algorithm = o.algorithm;
  rl.rollout.num_steps = o.sample_steps;
  rl.rollout.noise_level = o.noise_level;
  rl.rollout.guidance_scale = o.guidance;
  rl.rollout.shift = o.shift;
  rl.group_size = o.group_size;
  rl.micro_batch_size = o.micro_batch;
  rl.mini_batches = o.mini_batches;
  rl.timestep_fraction = o.timestep_fraction;
  rl.flow_grpo.beta = o.beta;
  rl.flow_grpo.clip_range = o.clip_range;
  rl.nft.beta = o.nft_beta;
  rl.dpo.beta = o.dpo_beta;
  rl.validate();

  auto reward = [&](const torch::Tensor& images, const torch::Tensor& labels) {
    return models::classifier_reward(classifier, images, labels, o.reward_mode);
  };
  auto before = evaluate(model, classifier, o, rl.rollout, *world);
  if (lead) {
    data::write_png(o.run_dir + "/samples_before.png",
                    data::image_grid(before.images, o.eval_per_class, 2, 3));
    std::cout << fmt::format(
                     "before RL: eval reward (p(class)) {:.4f}, classifier agrees {:.3f}  -> {}\n",
                     before.reward, before.accuracy, o.run_dir + "/samples_before.png")
              << std::flush;
  }

  std::ofstream metrics;
  if (lead) metrics.open(o.run_dir + "/metrics.jsonl");
  std::vector<double> reward_curve, reward_std;
  const int64_t groups = o.groups_per_rank * world->size();
  auto rl_start = Clock::now();
  for (int64_t step = 0; step < o.rl_steps; ++step) {
    const auto step_start = Clock::now();
    // Classes cycle through all ten; each rank takes its groups.
    auto classes = (torch::arange(groups, torch::kLong) + step * groups) % 10;
    auto labels = classes.narrow(0, world->rank() * o.groups_per_rank, o.groups_per_rank)
                      .repeat_interleave(o.group_size);
    auto gen =
        at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003 + step * 131 + world->rank());
    auto result =
        algos::diffusion_rl_step(model, *optimizer, reward, labels, step, rl, gen, &world->group());
    const double seconds = since(step_start);
    auto metric = [&](const char* name) {
      auto it = result.metrics.find(name);
      return it == result.metrics.end() ? 0.0 : it->second.item<double>();
    };
    reward_curve.push_back(result.reward_mean);
    reward_std.push_back(result.reward_std);
    if (lead) {
      std::string extra =
          o.algorithm == "flow_grpo"
              ? fmt::format("clipfrac {:.3f}  kl {:.2e}", metric("clipfrac"), metric("kl"))
          : o.algorithm == "dpo" ? fmt::format("implicit_acc {:.2f}", metric("implicit_acc"))
                                 : fmt::format("kl {:.2e}", metric("kl"));
      std::cout << fmt::format(
                       "rl step {:3d}/{}  reward {:.4f} +- {:.4f}  loss {:+.5f}  {}  grad_norm "
                       "{:.3f}  {:.1f} s (rollout {:.1f}, update {:.1f})\n",
                       step + 1, o.rl_steps, result.reward_mean, result.reward_std, metric("loss"),
                       extra, result.grad_norm, seconds, result.seconds["rollout"],
                       result.seconds["update"])
                << std::flush;
      nlohmann::json line{{"step", step + 1},
                          {"reward_mean", result.reward_mean},
                          {"reward_std", result.reward_std},
                          {"grad_norm", result.grad_norm},
                          {"lr", o.lr},
                          {"step_time", seconds}};
      for (const auto& [name, value] : result.metrics) line[name] = value.item<double>();
      for (const auto& [phase, s] : result.seconds) line["time_" + phase] = s;
      metrics << line.dump() << "\n" << std::flush;
    }
  }
  const double rl_seconds = since(rl_start);

  auto after = evaluate(model, classifier, o, rl.rollout, *world);
  if (lead) {
    data::write_png(o.run_dir + "/samples_after.png",
                    data::image_grid(after.images, o.eval_per_class, 2, 3));
    std::vector<double> smooth;
    for (size_t i = 0; i < reward_curve.size(); ++i) {
      const size_t from = i >= 4 ? i - 4 : 0;
      double s = 0;
      for (size_t k = from; k <= i; ++k) s += reward_curve[k];
      smooth.push_back(s / static_cast<double>(i - from + 1));
    }
    data::LinePlotOptions plot;
    plot.title = fmt::format("{} reward (p(class)) per step", o.algorithm);
    data::write_png(o.run_dir + "/reward_curve.png", data::line_plot({reward_curve, smooth}, plot));
    const nlohmann::json summary{
        {"classifier_seconds", classifier_seconds},
        {"pretrain_seconds", pretrain_seconds},
        {"rl_seconds", rl_seconds},
        {"rl_seconds_per_step", rl_seconds / std::max<int64_t>(o.rl_steps, 1)},
        {"eval_reward_before", before.reward},
        {"eval_reward_after", after.reward},
        {"eval_accuracy_before", before.accuracy},
        {"eval_accuracy_after", after.accuracy},
        {"total_seconds", since(t0)}};
    write_json(o.run_dir + "/summary.json", summary);
    std::cout
        << fmt::format(
               "after RL: eval reward (p(class)) {:.4f} (before {:.4f}), classifier agrees "
               "{:.3f} (before {:.3f})\n"
               "timings: classifier {:.1f} s, pretrain {:.1f} s, RL {:.1f} s ({:.2f} s/step), "
               "total {:.1f} s\n"
               "wrote {}/samples_before.png, samples_after.png, reward_curve.png, "
               "metrics.jsonl\n",
               after.reward, before.reward, after.accuracy, before.accuracy, classifier_seconds,
               pretrain_seconds, rl_seconds, rl_seconds / std::max<int64_t>(o.rl_steps, 1),
               since(t0), o.run_dir)
        << std::flush;
  }
  world->group().barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"Flow-GRPO on Fashion-MNIST: pretrain a DiT, train a reward classifier, RL-tune"};
  Options o;
  app.add_option("--data-dir", o.data_dir, "Directory with the Fashion-MNIST IDX files");
  app.add_option("--run-dir", o.run_dir, "Where PNGs, metrics.jsonl and summary.json go");
  app.add_option("--cache-dir", o.cache_dir, "Cached classifier and DiT (default RUN_DIR/cache)");
  app.add_option("--seed", o.seed);
  app.add_option("--image-size", o.image_size, "Downsample to this size (28: keep)");
  app.add_option("--patch-size", o.patch_size);
  app.add_option("--hidden", o.hidden);
  app.add_option("--depth", o.depth);
  app.add_option("--heads", o.heads);
  app.add_option("--classifier-steps", o.classifier_steps);
  app.add_option("--pretrain-steps", o.pretrain_steps);
  app.add_option("--pretrain-batch", o.pretrain_batch);
  app.add_option("--pretrain-lr", o.pretrain_lr);
  app.add_option("--algorithm", o.algorithm, "flow_grpo, nft or dpo")
      ->check(CLI::IsMember({"flow_grpo", "nft", "dpo"}));
  app.add_option("--rl-steps", o.rl_steps);
  app.add_option("--groups-per-rank", o.groups_per_rank, "Class prompts per rank per step");
  app.add_option("--group-size", o.group_size, "Samples per class prompt");
  app.add_option("--micro-batch", o.micro_batch);
  app.add_option("--mini-batches", o.mini_batches, "Optimizer steps per rollout batch");
  app.add_option("--sample-steps", o.sample_steps, "Denoising steps");
  app.add_option("--noise-level", o.noise_level);
  app.add_option("--guidance", o.guidance, "Classifier-free guidance scale (1: off)");
  app.add_option("--shift", o.shift, "Schedule shift");
  app.add_option("--lr", o.lr, "RL learning rate");
  app.add_option("--lora-r", o.lora_r);
  app.add_option("--lora-alpha", o.lora_alpha);
  app.add_option("--beta", o.beta, "Flow-GRPO KL-to-reference weight");
  app.add_option("--clip-range", o.clip_range);
  app.add_option("--timestep-fraction", o.timestep_fraction);
  app.add_option("--nft-beta", o.nft_beta);
  app.add_option("--dpo-beta", o.dpo_beta);
  app.add_option("--reward-mode", o.reward_mode, "prob or log_prob")
      ->check(CLI::IsMember({"prob", "log_prob"}));
  app.add_option("--eval-per-class", o.eval_per_class);
  CLI11_PARSE(app, argc, argv);
  if (o.cache_dir.empty()) o.cache_dir = o.run_dir + "/cache";
  try {
    return run(o);
  } catch (const std::exception& e) {
    std::cerr << "fmnist_flow_grpo: " << e.what() << std::endl;
    return 1;
  }
}
