#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include "shardrl/data.h"
#include "tasks.h"

namespace shardrl::trainer {

namespace fs = std::filesystem;

namespace {

// A trainer key that only some tasks have: null when the task's defaults lack it.
const nlohmann::json* trainer_key(const nlohmann::json& config, const std::string& key) {
  const auto& trainer = at(config, "trainer");
  return trainer.contains(key) ? &trainer[key] : nullptr;
}

}  // namespace

Run::Run(const nlohmann::json& config, dist::World& world, Throughput throughput)
    : dir_(get<std::string>(config, "trainer.default_local_dir")),
      resume_mode_(get<std::string>(config, "trainer.resume_mode")),
      resume_from_path_(get<std::string>(config, "trainer.resume_from_path")),
      total_steps_(get<int64_t>(config, "trainer.total_training_steps")),
      save_freq_(get<int64_t>(config, "trainer.save_freq")),
      rank0_(world.rank() == 0),
      world_(&world),
      loggers_(configured_loggers(config)),
      tensorboard_dir_(tensorboard_dir(config)),
      throughput_(std::move(throughput)) {
  // The config table checked these keys' values before any rank started.
  if (const auto* value = trainer_key(config, "rollout_data_dir"); value && !value->is_null()) {
    rollout_data_dir_ = value->get<std::string>();
  }
  if (const auto* value = trainer_key(config, "log_val_generations")) {
    if (std::find(loggers_.begin(), loggers_.end(), "tensorboard") != loggers_.end())
      val_generations_ = value->get<int64_t>();
  }
  max_critic_ckpt_to_keep_ = get<int>(config, "trainer.max_actor_ckpt_to_keep");
  if (const auto* value = trainer_key(config, "max_critic_ckpt_to_keep");
      value && !value->is_null()) {
    max_critic_ckpt_to_keep_ = value->get<int>();
  }
}

void Run::save_critic_with(engine::Engine& critic) {
  TORCH_CHECK(!tracking_, "Run::save_critic_with after Run::resume");
  critic_ = &critic;
}

int64_t Run::resume(engine::Engine& engine) {
  std::string dir;
  if (resume_mode_ == "auto") {
    const std::string root = (fs::path(dir_) / "checkpoints").string();
    std::vector<std::string> damaged;
    const auto whole = checkpoint::find_latest_whole(
        root, world_->group(), world_->device(),
        [&](const std::string& ckpt, const std::string& problem) {
          damaged.push_back(fmt::format("{}: {}", ckpt, problem));
          if (rank0_) {
            spdlog::warn("trainer.resume_mode=auto: passing over damaged checkpoint {}: {}", ckpt,
                         problem);
          }
        });
    // Checkpoints that are all damaged stop the run rather than start it afresh, as verl's auto
    // does only when there are none: starting over would silently throw away the training they
    // hold, and its saves would replace them step for step, leaving nothing to repair or copy back.
    // resume_mode=disable starts afresh on purpose.
    if (!whole && !damaged.empty()) {
      throw std::runtime_error(fmt::format(
          "trainer.resume_mode=auto: every checkpoint under {} is damaged ({}); restore one, or "
          "set trainer.resume_mode=disable to start afresh (its saves will replace them)",
          root, fmt::join(damaged, "; ")));
    }
    dir = whole.value_or("");
  } else if (resume_mode_ == "resume_path") {
    // The config's checks found the folder; checked whole before any of it is loaded, as auto
    // checks; the path was asked for by name, so damage is an error rather than a reason to look
    // elsewhere.
    const std::string problem =
        checkpoint::find_damage(resume_from_path_, world_->group(), world_->device());
    if (!problem.empty()) {
      throw std::runtime_error(
          fmt::format("config key 'trainer.resume_from_path': checkpoint {} is damaged: {}",
                      resume_from_path_, problem));
    }
    dir = resume_from_path_;
  }
  int64_t step = 0;
  if (!dir.empty()) {
    const auto start = std::chrono::steady_clock::now();
    // Both modes checked every file of `dir` above.
    step = engine.load_checkpoint(dir, /*files_checked=*/true).step;
    if (critic_) {
      // The critic of the same step, beside the actor's (resume_path's folder's too).
      const std::string critic_dir =
          (fs::path(dir).parent_path() / "critic" / fs::path(dir).filename()).string();
      // Collective, and the same answer on every rank (a missing index included).
      const std::string problem =
          checkpoint::find_damage(critic_dir, world_->group(), world_->device());
      if (!problem.empty()) {
        throw std::runtime_error(fmt::format(
            "resuming from {}: the critic's checkpoint of step {}, {}, is not whole ({}); a run "
            "with a critic (critic.enable) resumes both, so restore it, or resume from an earlier "
            "step that has both (trainer.resume_mode=resume_path)",
            dir, step, critic_dir, problem));
      }
      const auto critic_step = critic_->load_checkpoint(critic_dir, /*files_checked=*/true).step;
      TORCH_CHECK(critic_step == step, "the critic checkpoint ", critic_dir, " holds step ",
                  critic_step, ", not ", step);
    }
    if (rank0_) {
      spdlog::info("resumed from {} at step {}{}: {} bytes loaded in {:.2f} s", dir, step,
                   critic_ ? " (actor and critic)" : "", checkpoint::directory_bytes(dir),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  Tracking::Options tracking;
  tracking.loggers = loggers_;
  tracking.metrics_path = (fs::path(dir_) / "metrics.jsonl").string();
  tracking.tensorboard_dir = tensorboard_dir_;
  tracking.total_steps = total_steps_;
  tracking.resumed_step = step;
  tracking.throughput = throughput_;
  tracking.enabled = rank0_;
  tracking_ = std::make_unique<Tracking>(tracking);
  return step;
}

Run::~Run() = default;

bool Run::uses(const std::string& logger) const {
  return std::find(loggers_.begin(), loggers_.end(), logger) != loggers_.end();
}

void Run::after_step(engine::Engine& engine, int64_t step, const engine::Metrics& metrics) {
  TORCH_CHECK(tracking_, "Run::after_step before Run::resume");
  // Memory per rank (rank 0's), as verl logs it: sharded state by category and the process.
  const auto memory = engine.memory();
  engine::Metrics logged = metrics;
  logged["memory_params_gb"] = static_cast<double>(memory.params.resident) / 1e9;
  logged["memory_grads_gb"] = static_cast<double>(memory.grads.resident) / 1e9;
  logged["memory_optimizer_gb"] = static_cast<double>(memory.optimizer.resident) / 1e9;
  logged["memory_offloaded_gb"] =
      static_cast<double>(memory.params.offloaded + memory.grads.offloaded +
                          memory.optimizer.offloaded) /
      1e9;
  logged["memory_rss_gb"] = static_cast<double>(memory.process_rss) / 1e9;
  // The largest resident set any rank has had so far: what the memory plan's peak per rank
  // (logged before the first step) is held to.
  auto peak =
      torch::tensor({static_cast<double>(offload::process_peak_rss_bytes())}, torch::kDouble);
  world_->group().all_reduce(peak, dist::ReduceOp::kMax);
  logged["memory_peak_rss_gb"] = peak.item<double>() / 1e9;
  tracking_->log(step, logged, /*training_step=*/true);
  if ((save_freq_ > 0 && step % save_freq_ == 0) || step == total_steps_) {
    const auto start = std::chrono::steady_clock::now();
    const auto root = fs::path(dir_) / "checkpoints";
    // The critic first: the actor's step, written last, is what a resume finds, and the critic's
    // of that step is then already whole. Its older steps go only once the actor's is saved.
    const std::string critic_saved =
        critic_ ? critic_->save_checkpoint((root / "critic").string(), step) : "";
    const auto saved = engine.save_checkpoint(root.string(), step);
    if (critic_) {
      if (rank0_) {
        checkpoint::SaveOptions keep;
        keep.max_ckpt_to_keep = max_critic_ckpt_to_keep_;
        checkpoint::rotate((root / "critic").string(), keep, critic_saved);
      }
      world_->group().barrier();
    }
    if (rank0_) {
      spdlog::info("saved {}{}: {} bytes in {:.2f} s", saved,
                   critic_ ? fmt::format(" and {}", critic_saved) : "",
                   checkpoint::directory_bytes(saved) +
                       (critic_ ? checkpoint::directory_bytes(critic_saved) : 0),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
}

void Run::log(int64_t step, const engine::Metrics& metrics) {
  TORCH_CHECK(tracking_, "Run::log before Run::resume");
  tracking_->log(step, metrics, /*training_step=*/false);
}

void Run::log_image(int64_t step, const std::string& tag, const torch::Tensor& image) {
  TORCH_CHECK(tracking_, "Run::log_image before Run::resume");
  tracking_->log_image(step, tag, image);
}

void Run::log_text(int64_t step, const std::string& tag, const std::string& markdown) {
  TORCH_CHECK(tracking_, "Run::log_text before Run::resume");
  tracking_->log_text(step, tag, markdown);
}

namespace {

// Every rank's samples (JSON objects), in rank order, on rank 0 (on the others: empty).
std::vector<nlohmann::json> gather_samples(const std::vector<nlohmann::json>& mine,
                                           dist::ProcessGroup& group, torch::Device device,
                                           bool keep) {
  std::vector<nlohmann::json> all;
  for (const auto& text : dist::all_gather_strings(group, nlohmann::json(mine).dump(), device)) {
    if (!keep) continue;
    for (auto& sample : nlohmann::json::parse(text)) all.push_back(std::move(sample));
  }
  return all;
}

}  // namespace

void Run::dump_rollouts(int64_t step, std::vector<nlohmann::json> samples,
                        dist::ProcessGroup& group, const torch::Tensor& images) {
  if (!dumps_rollouts()) return;
  const auto device = world_->device();
  torch::Tensor all_images;
  if (images.defined()) {
    TORCH_CHECK(images.size(0) == static_cast<int64_t>(samples.size()),
                "dump_rollouts: ", samples.size(), " samples but ", images.size(0), " images");
    const auto mine = images.detach().to(device, torch::kFloat).contiguous();
    auto sizes = mine.sizes().vec();
    sizes[0] *= group.size();
    all_images = torch::empty(sizes, mine.options());
    group.all_gather(mine, all_images);
  }
  auto all = gather_samples(samples, group, device, /*keep=*/rank0_);
  if (!rank0_) return;
  const fs::path dir(rollout_data_dir_);
  fs::create_directories(dir);
  if (all_images.defined()) {
    const fs::path folder = dir / std::to_string(step);
    fs::create_directories(folder);
    for (size_t i = 0; i < all.size(); ++i) {
      const std::string path = (folder / fmt::format("{}.png", i)).string();
      data::write_png(path, data::image_grid(all_images.narrow(0, static_cast<int64_t>(i), 1), 1,
                                             /*padding=*/0));
      all[i]["output"] = path;
    }
  }
  const std::string path = (dir / fmt::format("{}.jsonl", step)).string();
  std::ofstream out(path, std::ios::trunc);
  for (auto& sample : all) {
    sample["step"] = step;
    out << sample.dump() << "\n";
  }
  out.flush();
  if (!out)
    throw std::runtime_error(fmt::format("trainer.rollout_data_dir: cannot write {}", path));
}

void Run::log_val_generations(int64_t step, const std::vector<nlohmann::json>& samples,
                              dist::ProcessGroup& group) {
  if (val_generations_ == 0) return;
  // Each rank sends no more than could be shown.
  const std::vector<nlohmann::json> mine(
      samples.begin(),
      samples.begin() + std::min<int64_t>(val_generations_, static_cast<int64_t>(samples.size())));
  auto all = gather_samples(mine, group, world_->device(), /*keep=*/rank0_);
  if (!rank0_) return;
  std::string text = fmt::format("**Generation Results - Step {}**\n\n", step);
  for (size_t i = 0; i < all.size() && static_cast<int64_t>(i) < val_generations_; ++i) {
    const auto field = [&](const char* key) {
      const auto& v = all[i].at(key);
      return v.is_string() ? v.get<std::string>() : v.dump();
    };
    text +=
        fmt::format("### Sample {}\n**Input:** {}\n\n**Output:** {}\n\n**Score:** {}\n\n---\n\n",
                    i + 1, field("input"), field("output"), field("score"));
  }
  log_text(step, "val/generations", text);
}

}  // namespace shardrl::trainer
