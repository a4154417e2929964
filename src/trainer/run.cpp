#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include <filesystem>

#include "tasks.h"

namespace shardrl::trainer {

namespace fs = std::filesystem;

Run::Run(const nlohmann::json& config, dist::World& world)
    : dir_(get<std::string>(config, "trainer.default_local_dir")),
      resume_mode_(get<std::string>(config, "trainer.resume_mode")),
      resume_from_path_(get<std::string>(config, "trainer.resume_from_path")),
      total_steps_(get<int64_t>(config, "trainer.total_training_steps")),
      save_freq_(get<int64_t>(config, "trainer.save_freq")),
      rank0_(world.rank() == 0),
      world_(&world) {}

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
    step = engine.load_checkpoint(dir).step;
    if (rank0_) spdlog::info("resumed from {} at step {}", dir, step);
  }
  metrics_.emplace((fs::path(dir_) / "metrics.jsonl").string(), total_steps_, rank0_, step);
  return step;
}

void Run::after_step(engine::Engine& engine, int64_t step, const engine::Metrics& metrics) {
  TORCH_CHECK(metrics_, "Run::after_step before Run::resume");
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
  log(step, logged);
  if ((save_freq_ > 0 && step % save_freq_ == 0) || step == total_steps_) {
    engine.save_checkpoint((fs::path(dir_) / "checkpoints").string(), step);
  }
}

void Run::log(int64_t step, const engine::Metrics& metrics) {
  TORCH_CHECK(metrics_, "Run::log before Run::resume");
  metrics_->log(step, metrics);
}

}  // namespace shardrl::trainer
