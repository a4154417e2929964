// One rank of the FSDP error-path and accumulation tests (test_fsdp_errors.cpp), started by
// `shardrl launch`. Each mode writes what its test checks into --out.
//   recover     trains the shared scenario; with --throw-in forward|backward every rank throws
//               there at --throw-step (a bad token in the root's forward, or a grad hook on a
//               param of block 0, after other units reduced) and redoes the step. Writes the
//               gathered params and the losses.
//   lose-peer   --exit-rank leaves the job (exit 0) at --exit-step, before the forward (or before
//               the others' unshard() of the whole model, with --exit-before unshard) or, with
//               --exit-before backward, between forward and backward. The others write each
//               error they then meet: the failed collective, then later uses of the model.
//   accumulate  bf16 params, fp32 reduce: one step's micro-batches with no_sync, then the same
//               micro-batches with every backward synced; writes the kept unsharded grad bytes
//               and how far the two grad shards are apart.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <c10/util/accumulate.h>

#include <chrono>
#include <fstream>

#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/optim.h"
#include "workers/param_files.h"
#include "workers/scenario.h"

using namespace shardrl;
using nlohmann::json;

namespace {

struct Args {
  testing::Scenario s;
  std::string out = ".", throw_in, exit_before = "forward";
  int throw_step = -1, exit_rank = -1, exit_step = -1, timeout_ms = 20000;
  bool keep_unsharded = false;
};

struct Setup {
  std::shared_ptr<dist::World> world;
  dist::DeviceMesh mesh;
  models::Transformer model{nullptr};
  fsdp::FSDPModule fsdp{nullptr};
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  int64_t local = 0;  // rows of the global batch this rank takes
};

Setup build(const Args& a, const fsdp::MixedPrecision& precision) {
  Setup setup;
  dist::InitOptions init;
  init.timeout = std::chrono::milliseconds(a.timeout_ms);
  setup.world = dist::World::init_from_env(init);
  setup.mesh = dist::DeviceMesh::create(*setup.world);
  fsdp::Options options;
  options.mixed_precision = precision;
  options.reshard_after_forward = !a.keep_unsharded;
  setup.model = testing::build_model(a.s);
  models::shard_transformer(setup.model, setup.mesh, options);
  setup.fsdp = setup.model.fsdp();
  optim::AdamWConfig adam;
  adam.lr = a.s.lr;
  setup.optimizer = optim::make_adamw(optim::from_sharded(setup.fsdp.sharded_parameters()), adam);
  setup.local = a.s.batch / setup.mesh.data_parallel_size();
  return setup;
}

torch::Tensor local_batch(const Args& a, const Setup& setup, int64_t step) {
  return testing::global_batch(a.s, step, setup.model->config().vocab_size)
      .narrow(0, setup.mesh.data_parallel_rank() * setup.local, setup.local);
}

torch::Tensor loss_of(Setup& setup, const torch::Tensor& tokens) {
  return models::next_token_loss(setup.model(tokens), tokens);
}

int recover(const Args& a) {
  auto setup = build(a, {});
  bool inject = false;
  // Runs before the param's AccumulateGrad: the backward has gathered, reduced and resharded the
  // later block by then, and queued the root's end-of-backward work.
  setup.model->blocks()[0]->parameters()[0].register_hook([&inject](const torch::Tensor& grad) {
    if (inject) throw std::runtime_error("injected failure in block 0's backward");
    return grad;
  });
  json losses = json::array(), failures = json::array();
  for (int64_t step = 0; step < a.s.steps; ++step) {
    auto tokens = local_batch(a, setup, step);
    for (int attempt = 0;; ++attempt) {
      const bool fails = step == a.throw_step && attempt == 0;
      setup.fsdp.zero_grad();
      try {
        torch::Tensor input = tokens;
        if (fails && a.throw_in == "forward")
          input = tokens.clone().fill_(setup.model->config().vocab_size);  // out of range
        inject = fails && a.throw_in == "backward";
        auto loss = loss_of(setup, input);
        loss.backward();
        inject = false;
        TORCH_CHECK(!fails || a.throw_in.empty(), "the injected failure did not happen");
        optim::clip_and_step(setup.fsdp, *setup.optimizer, a.s.max_norm);
        auto sum = loss.detach().reshape({1});
        setup.world->group().all_reduce(sum);
        losses.push_back(sum.item<double>() / setup.world->size());
        break;
      } catch (const std::exception& e) {
        inject = false;
        if (!fails) throw;
        failures.push_back(std::string(e.what()).substr(0, 200));
      }
    }
  }
  auto full = setup.fsdp.full_parameters();
  if (setup.world->rank() == 0) {
    testing::write_params(full, a.out);
    std::ofstream(a.out + "/losses.json") << json{{"loss", losses}, {"failures", failures}}.dump();
  }
  setup.world->group().barrier();
  return 0;
}

int lose_peer(const Args& a) {
  auto setup = build(a, {});
  const bool leaves = setup.world->rank() == a.exit_rank;
  json errors = json::array();
  // Runs `what` and records how it failed (it must fail) and how long it took.
  auto expect_error = [&](const std::string& what, const std::function<void()>& fn) {
    const auto start = std::chrono::steady_clock::now();
    std::string message;
    try {
      fn();
    } catch (const std::exception& e) {
      message = e.what();
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    errors.push_back({{"call", what}, {"error", message}, {"seconds", seconds}});
  };
  for (int64_t step = 0; step <= a.exit_step; ++step) {
    auto tokens = local_batch(a, setup, step);
    setup.fsdp.zero_grad();
    if (step < a.exit_step) {
      loss_of(setup, tokens).backward();
      optim::clip_and_step(setup.fsdp, *setup.optimizer, a.s.max_norm);
      continue;
    }
    if (leaves && a.exit_before != "backward") return 0;
    if (a.exit_before == "forward") {
      expect_error("forward", [&] { loss_of(setup, tokens); });
    } else if (a.exit_before == "unshard") {
      // Every unit's gather in flight at once; the first wait fails.
      expect_error("unshard", [&] { setup.fsdp.unshard(); });
    } else {
      auto loss = loss_of(setup, tokens);
      if (leaves) return 0;
      expect_error("backward", [&] { loss.backward(); });
      expect_error("clip_grad_norm_", [&] { setup.fsdp.clip_grad_norm_(1.0); });
    }
    expect_error("forward again", [&] { loss_of(setup, tokens); });
    expect_error("unshard", [&] { setup.fsdp.unshard(); });
    expect_error("full_parameters", [&] { setup.fsdp.full_parameters(); });
  }
  const auto memory = setup.fsdp.memory();
  if (setup.world->rank() == 0) {
    std::ofstream(a.out + "/errors.json")
        << json{{"errors", errors}, {"unsharded_param_bytes", memory.unsharded_param_bytes}}.dump(
               1);
  }
  return 0;
}

int accumulate(const Args& a) {
  fsdp::MixedPrecision precision;
  precision.param_dtype = torch::kBFloat16;
  precision.reduce_dtype = torch::kFloat;
  precision.output_dtype = torch::kFloat;
  auto setup = build(a, precision);
  const auto tokens = local_batch(a, setup, 0);
  const int64_t rows = setup.local / a.s.micro;
  int64_t kept_bytes = -1, unsharded_numel = 0;
  for (const auto& p : setup.fsdp.sharded_parameters()) {
    unsharded_numel += c10::multiply_integers(p.global_shape);
  }
  auto grads_of = [&](bool no_sync) {
    setup.fsdp.zero_grad();
    for (int64_t m = 0; m < a.s.micro; ++m) {
      const bool last = m == a.s.micro - 1;
      setup.fsdp.set_requires_gradient_sync(!no_sync || last);
      auto micro = tokens.narrow(0, m * rows, rows);
      (loss_of(setup, micro) / static_cast<double>(a.s.micro)).backward();
      if (no_sync && m == a.s.micro - 2) kept_bytes = setup.fsdp.memory().unsharded_grad_bytes;
    }
    std::vector<torch::Tensor> grads;
    for (const auto& p : setup.fsdp.sharded_parameters()) grads.push_back(p.shard.grad().clone());
    return grads;
  };
  const auto accumulated = grads_of(true);
  const auto synced = grads_of(false);
  // Over every rank's shards: the largest difference and the largest grad.
  double difference = 0, largest = 0;
  for (size_t i = 0; i < synced.size(); ++i) {
    difference = std::max(difference, (accumulated[i] - synced[i]).abs().max().item<double>());
    largest = std::max(largest, synced[i].abs().max().item<double>());
  }
  torch::Tensor worst = torch::tensor({difference, largest}, torch::kDouble);
  setup.mesh.shard_group().all_reduce(worst, dist::ReduceOp::kMax);
  if (setup.world->rank() == 0) {
    std::ofstream(a.out + "/accumulate.json") << json{
        {"kept_grad_bytes", kept_bytes},
        {"unsharded_numel", unsharded_numel},
        {"max_difference", worst[0].item<double>()},
        {"max_grad", worst[1].item<double>()}}.dump(1);
  }
  setup.world->group().barrier();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"FSDP error-path and accumulation test worker"};
  Args a;
  std::string mode;
  app.add_option("mode", mode)
      ->required()
      ->check(CLI::IsMember({"recover", "lose-peer", "accumulate"}));
  app.add_option("--out", a.out);
  app.add_option("--steps", a.s.steps);
  app.add_option("--micro", a.s.micro);
  app.add_option("--throw-in", a.throw_in)->check(CLI::IsMember({"forward", "backward"}));
  app.add_option("--throw-step", a.throw_step);
  app.add_option("--exit-rank", a.exit_rank);
  app.add_option("--exit-step", a.exit_step);
  app.add_option("--exit-before", a.exit_before)
      ->check(CLI::IsMember({"forward", "unshard", "backward"}));
  app.add_option("--timeout-ms", a.timeout_ms);
  app.add_flag("--keep-unsharded", a.keep_unsharded);
  CLI11_PARSE(app, argc, argv);
  try {
    if (mode == "recover") return recover(a);
    if (mode == "lose-peer") return lose_peer(a);
    return accumulate(a);
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
