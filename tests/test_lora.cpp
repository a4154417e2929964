// LoRA: adapters on a frozen base, unsharded and on 2 real ranks.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <set>

#include "model_test_util.h"
#include "shardrl/optim.h"
#include "workers/lora_scenario.h"

namespace shardrl::testing {
namespace {

namespace lora = models::lora;

torch::Tensor some_input(int64_t rows, int64_t cols) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  return torch::randn({rows, cols}, gen);
}

// B at zero would hide every bug in the adapter path.
void randomize_adapter(lora::LoraLinearImpl& layer, const std::string& name, double scale = 0.3) {
  torch::NoGradGuard no_grad;
  layer.lora_B(name).normal_(0, scale);
}

TEST(Lora, ZeroInitialisedBKeepsTheBaseOutput) {
  LoraScenario s;
  torch::manual_seed(s.seed);
  fsdp::Unit<LoraNetImpl> net(s);
  auto x = some_input(5, s.d_model);
  auto base = net(x).detach();
  lora::apply_lora(*net, lora_config(), "default");
  EXPECT_TRUE(torch::equal(net(x), base));
}

TEST(Lora, OnlyAdapterParamsTrain) {
  auto net = build_lora_net(LoraScenario{});
  std::set<std::string> trainable;
  for (const auto& item : net->named_parameters()) {
    if (item.value().requires_grad()) trainable.insert(item.key());
  }
  std::set<std::string> expected;
  for (const std::string m :
       {"blocks.0.fc1", "blocks.0.fc2", "blocks.1.fc1", "blocks.1.fc2", "head"})
    for (const std::string ab : {"lora_A", "lora_B"})
      expected.insert(m + "." + ab + ".default.weight");
  EXPECT_EQ(trainable, expected);
  auto x = some_input(3, 12);
  net(x).sum().backward();
  for (const auto& item : net->named_parameters()) {
    EXPECT_EQ(item.value().grad().defined(), expected.count(item.key()) > 0) << item.key();
  }
}

TEST(Lora, TargetsByNameSuffixOrRegexAndNamesMissingTargets) {
  LoraScenario s;
  fsdp::Unit<LoraNetImpl> net(s);
  lora::LoraConfig config;
  config.target_modules = {"fc1"};
  EXPECT_EQ(lora::apply_lora(*net, config, "a"),
            (std::vector<std::string>{"blocks.0.fc1", "blocks.1.fc1"}));
  config.target_modules = {};
  config.target_regex = R"(blocks\.1\..*)";
  EXPECT_EQ(lora::apply_lora(*net, config, "b"),
            (std::vector<std::string>{"blocks.1.fc1", "blocks.1.fc2"}));
  config.target_regex = "";
  config.target_modules = {"fc", "q_proj"};  // suffix match is by whole name components
  try {
    lora::apply_lora(*net, config, "c");
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("q_proj"), std::string::npos) << e.what();
  }
}

TEST(Lora, AdapterPathScalesBA) {
  lora::LoraLinear layer(6, 4);
  lora::LoraConfig config;
  config.r = 3;
  config.alpha = 6;
  layer->add_adapter("default", config);
  randomize_adapter(*layer, "default");
  auto x = some_input(5, 6);
  auto expected = torch::nn::functional::linear(x, layer->weight, layer->bias) +
                  2.0 * x.matmul(layer->lora_A("default").t()).matmul(layer->lora_B("default").t());
  EXPECT_TRUE(torch::allclose(layer(x), expected, 1e-6, 1e-6));
}

TEST(Lora, GuardsSelectAndDisableAdaptersAndRestore) {
  LoraScenario s;
  torch::manual_seed(s.seed);
  fsdp::Unit<LoraNetImpl> net(s);
  auto x = some_input(4, s.d_model);
  auto base = net(x).detach();
  lora::apply_lora(*net, lora_config(), "default");
  lora::apply_lora(*net, lora_config(), "old", false);
  for (auto& [name, layer] : lora::lora_linears(*net)) {
    randomize_adapter(*layer, "default");
    randomize_adapter(*layer, "old");
  }
  auto with_default = net(x).detach();
  EXPECT_FALSE(torch::allclose(with_default, base));
  {
    lora::DisableAdapters reference(*net);
    EXPECT_TRUE(torch::equal(net(x), base));
    {
      lora::UseAdapter old(*net, "old");  // re-enables inside the disabled scope
      auto with_old = net(x).detach();
      EXPECT_FALSE(torch::allclose(with_old, base));
      EXPECT_FALSE(torch::allclose(with_old, with_default));
    }
    EXPECT_TRUE(torch::equal(net(x), base));
  }
  EXPECT_TRUE(torch::equal(net(x), with_default));
  EXPECT_THROW(lora::UseAdapter(*net, "missing"), std::exception);
  EXPECT_TRUE(torch::equal(net(x), with_default));
}

TEST(Lora, CopyAndEmaFollowTheirFormulas) {
  auto net = build_lora_net(LoraScenario{});
  for (auto& [name, layer] : lora::lora_linears(*net)) {
    randomize_adapter(*layer, "default");
    randomize_adapter(*layer, "old");
  }
  auto before = lora::named_tensors(*net);
  std::map<std::string, torch::Tensor> old;
  for (auto& [name, t] : before) old[name] = t.detach().clone();
  const double d = 0.75;
  lora::ema_update(lora::named_tensors(*net), "old", "default", d);
  int checked = 0;
  for (auto& [name, t] : lora::named_tensors(*net)) {
    const size_t at = name.find(".old.");
    if (at == std::string::npos) {
      EXPECT_TRUE(torch::equal(t, old[name])) << name;  // only the destination changes
      continue;
    }
    std::string src = name;
    src.replace(at, 5, ".default.");
    EXPECT_TRUE(torch::allclose(t, d * old[name] + (1 - d) * old[src], 0, 1e-7)) << name;
    ++checked;
  }
  EXPECT_EQ(checked, 10);
  lora::copy_adapter(lora::named_tensors(*net), "old", "default");
  auto x = some_input(3, 12);
  auto with_default = net(x).detach();
  lora::UseAdapter use_old(*net, "old");
  EXPECT_TRUE(torch::equal(net(x), with_default));
}

TEST(Lora, MergeEqualsBasePlusScaledBAAndUnmergeRestores) {
  auto net = build_lora_net(LoraScenario{});
  for (auto& [name, layer] : lora::lora_linears(*net)) randomize_adapter(*layer, "default");
  auto x = some_input(4, 12);
  auto adapted = net(x).detach();
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : net->named_parameters())
    params[item.key()] = item.value().detach().clone();

  auto merged = lora::merged_state_dict(params, "default", lora_config());
  EXPECT_EQ(merged.count("head.lora_A.default.weight"), 0u);
  const double scaling = lora_config().scaling();
  for (const std::string m : {"blocks.0.fc1", "blocks.1.fc2", "head"}) {
    auto expected = params[m + ".weight"] + scaling * params[m + ".lora_B.default.weight"].matmul(
                                                          params[m + ".lora_A.default.weight"]);
    EXPECT_TRUE(torch::allclose(merged[m + ".weight"], expected, 0, 1e-6)) << m;
  }

  for (auto& [name, layer] : lora::lora_linears(*net)) layer->merge("default");
  EXPECT_TRUE(torch::allclose(net->head->weight, merged["head.weight"], 0, 1e-6));
  EXPECT_TRUE(torch::allclose(net(x), adapted, 1e-5, 1e-5));

  for (auto& [name, layer] : lora::lora_linears(*net)) layer->unmerge();
  int restored = 0;
  for (const auto& item : net->named_parameters()) {
    const auto& original = params.at(item.key());
    const auto now = item.value().detach();
    if (item.key().find(".lora_") != std::string::npos || !merged.count(item.key()) ||
        torch::equal(merged.at(item.key()), original)) {
      EXPECT_TRUE(torch::equal(now, original)) << item.key();  // merge never touched these
      continue;
    }
    // unmerge subtracts the delta merge added: (w + d) - d in fp32 is w up to the rounding of
    // the two operations, at most one unit in the last place of |w + d| and of |w| each.
    const auto bound = std::ldexp(1.0, -23) * (merged.at(item.key()).abs() + original.abs());
    EXPECT_TRUE((now - original).abs().le(bound).all().item<bool>())
        << item.key() << ": off by " << (now - original).abs().max().item<double>();
    ++restored;
  }
  EXPECT_EQ(restored, 5);  // fc1 and fc2 of both blocks, and the head
  EXPECT_TRUE(torch::allclose(net(x), adapted, 1e-5, 1e-5));  // the adapters act unmerged again
}

TEST(Lora, MergedForwardRefusesDisabledAdapters) {
  lora::LoraLinear layer(4, 3);
  layer->add_adapter("default", lora::LoraConfig{});
  randomize_adapter(*layer, "default");
  auto x = some_input(2, 4);
  auto base = torch::nn::functional::linear(x, layer->weight, layer->bias).detach();
  layer->merge("default");
  layer->set_adapters_disabled(true);
  EXPECT_THROW(layer(x), std::exception);
  layer->set_adapters_disabled(false);
  layer->unmerge();
  lora::DisableAdapters off(*layer);
  EXPECT_TRUE(torch::allclose(layer(x), base, 0, 1e-6));
}

TEST(Lora, Bf16BaseWithFp32Adapters) {
  lora::LoraLinear layer(8, 5);
  layer->to(torch::kBFloat16);
  layer->add_adapter("default", lora::LoraConfig{});
  randomize_adapter(*layer, "default");
  EXPECT_EQ(layer->lora_A("default").scalar_type(), torch::kFloat);
  auto x = some_input(3, 8);
  auto out = layer(x.to(torch::kBFloat16));
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  auto reference =
      torch::nn::functional::linear(x, layer->weight.to(torch::kFloat),
                                    layer->bias.to(torch::kFloat)) +
      2.0 * x.matmul(layer->lora_A("default").t()).matmul(layer->lora_B("default").t());
  EXPECT_TRUE(torch::allclose(out.to(torch::kFloat), reference, 2e-2, 2e-2));
  out.sum().backward();
  EXPECT_EQ(layer->lora_B("default").grad().scalar_type(), torch::kFloat);
  EXPECT_FALSE(layer->weight.grad().defined());
}

TEST(Lora, PeftExportNamesAndConfig) {
  auto net = build_lora_net(LoraScenario{});
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : net->named_parameters()) params[item.key()] = item.value();
  auto peft = lora::peft_state_dict(params, "default");
  EXPECT_EQ(peft.size(), 10u);
  EXPECT_TRUE(peft.count("base_model.model.blocks.0.fc1.lora_A.weight"));
  EXPECT_TRUE(peft.count("base_model.model.head.lora_B.weight"));
  auto config = nlohmann::json::parse(lora::peft_adapter_config(lora_config()));
  EXPECT_EQ(config["r"], 4);
  EXPECT_EQ(config["lora_alpha"], 8.0);
  EXPECT_EQ(config["peft_type"], "LORA");
}

// Plain LibTorch, one process: what the sharded LoRA run must reproduce.
std::map<std::string, torch::Tensor> train_lora_reference(const LoraScenario& s) {
  auto net = build_lora_net(s);
  optim::AdamWConfig adam;
  adam.lr = s.lr;
  auto optimizer = optim::make_adamw(optim::from_module(*net), adam);
  for (int64_t step = 0; step < s.steps; ++step) {
    auto [x, y] = lora_batch(s, step);
    optimizer->zero_grad();
    torch::mse_loss(net(x), y).backward();
    optimizer->step();
    lora::ema_update(lora::named_tensors(*net), "old", "default", s.ema_decay);
  }
  std::map<std::string, torch::Tensor> params;
  for (const auto& item : net->named_parameters()) params[item.key()] = item.value().detach();
  return params;
}

TEST(Lora, ShardedTrainingSendsOnlyAdapterGradientsAndMatchesUnsharded) {
  const LoraScenario s;
  const std::string dir = make_temp_dir("lora");
  auto result =
      launch_workers(2, {"--out", dir, "--steps", std::to_string(s.steps)}, 300, "lora_worker");
  ASSERT_EQ(result.exit_code, 0) << result.output;

  auto reference = train_lora_reference(s);
  auto sharded = read_params(dir);
  ASSERT_EQ(sharded.size(), reference.size());
  for (const auto& [name, expected] : reference) {
    ASSERT_TRUE(sharded.count(name)) << name;
    EXPECT_LE(relative_error(sharded.at(name), expected), 1e-5) << name;
  }

  // Per trainable param: its shard (ceil(rows / 2) rows) goes to the one peer, plus a 4-byte
  // "had a grad" flag. Nothing else may travel in backward: base and "old" params are frozen.
  std::set<std::string> trainable;
  double expected_bytes = 0;
  auto net = build_lora_net(s);
  for (const auto& item : net->named_parameters()) {
    const auto& p = item.value();
    if (!p.requires_grad()) continue;
    trainable.insert(item.key());
    const int64_t rows = p.size(0), row_numel = p.numel() / rows;
    expected_bytes += ((rows + 1) / 2 * row_numel + 1) * 4.0;
  }
  ASSERT_EQ(trainable.size(), 10u);
  for (int rank = 0; rank < 2; ++rank) {
    auto run = nlohmann::json::parse(std::ifstream(dir + "/run_" + std::to_string(rank) + ".json"));
    ASSERT_EQ(run["bytes_sent"].size(), static_cast<size_t>(s.steps));
    for (int64_t step = 0; step < s.steps; ++step) {
      EXPECT_DOUBLE_EQ(run["bytes_sent"][step].get<double>(), expected_bytes) << "step " << step;
      auto names = run["with_grad"][step].get<std::vector<std::string>>();
      EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), trainable) << "step " << step;
    }
  }
}

// A reference forward and a policy forward + backward on the same micro-batch inside one
// UnshardScope: the base is gathered once for all of it, and nothing changes in the results.
TEST(Lora, UnshardScopeSharesOneGatherBetweenReferenceAndPolicy) {
  const LoraScenario s;
  const std::string dir = make_temp_dir("lora-gather");
  auto result = launch_workers(2, {"--out", dir, "--shared-gather"}, 300, "lora_worker");
  ASSERT_EQ(result.exit_code, 0) << result.output;
  // From the unsharded net's shapes: a param's rows split into ceil(rows / 2) per rank, sent to
  // the one peer. `full` gathers every param (fp32), and `reduce` is the adapter grads'
  // reduce-scatter, each with a 4-byte "had a grad" flag.
  double full = 0, reduce = 0;
  for (const auto& item : build_lora_net(s)->named_parameters()) {
    const auto& p = item.value();
    const int64_t rows = p.size(0), row_numel = p.numel() / rows;
    const double shard = static_cast<double>((rows + 1) / 2 * row_numel);
    full += shard * 4;
    if (p.requires_grad()) reduce += (shard + 1) * 4;
  }
  for (int rank = 0; rank < 2; ++rank) {
    const std::string r = std::to_string(rank);
    auto bytes = nlohmann::json::parse(std::ifstream(dir + "/gather_" + r + ".json"));
    EXPECT_DOUBLE_EQ(bytes["full_gather"].get<double>(), full);
    // The backward reads the blocks' rows their forward left in the ranks' host-shared image.
    EXPECT_DOUBLE_EQ(bytes["separate_backward"].get<double>(), reduce);
    // Apart, each forward gathers every unit.
    EXPECT_DOUBLE_EQ(bytes["separate_ref"].get<double>(), full);
    EXPECT_DOUBLE_EQ(bytes["separate_policy"].get<double>(), full);
    // Inside the scope: one gather up front, none by the two forwards...
    EXPECT_DOUBLE_EQ(bytes["scope_unshard"].get<double>(), full);
    EXPECT_DOUBLE_EQ(bytes["scope_forwards"].get<double>(), full);
    // ...nor by the backward: the scope sends what one forward + backward sends when the params
    // stay gathered after forward (one gather plus the adapter reduce-scatter).
    EXPECT_DOUBLE_EQ(bytes["scope_total"].get<double>(),
                     bytes["kept_policy_and_backward"].get<double>());
    EXPECT_DOUBLE_EQ(bytes["scope_total"].get<double>(), full + reduce);
    EXPECT_GT(bytes["scope_unsharded_param_bytes"].get<double>(), 0);
    EXPECT_EQ(bytes["after_scope_unsharded_param_bytes"].get<double>(), 0);

    for (const std::string what : {"out", "grads"}) {
      auto apart = read_params(dir + "/separate_" + r + "/" + what);
      auto shared = read_params(dir + "/scope_" + r + "/" + what);
      ASSERT_EQ(apart.size(), shared.size()) << what;
      ASSERT_FALSE(apart.empty()) << what;
      for (const auto& [name, expected] : apart) {
        ASSERT_TRUE(shared.count(name)) << what << " " << name;
        EXPECT_TRUE(torch::equal(shared.at(name), expected)) << what << " " << name;
      }
    }
    auto out = read_params(dir + "/scope_" + r + "/out");
    EXPECT_FALSE(torch::allclose(out.at("ref"), out.at("policy")));  // the adapters did act
  }
}

// The adapter alone, as PEFT writes it, from a sharded checkpoint (the CLI) and from the live
// sharded model: read back with an independent reader, PEFT names, the gathered values.
TEST(Lora, AdapterExportHasPeftNamesAndTheGatheredAdapter) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"json", "struct"}));
  const LoraScenario s;
  const std::string dir = make_temp_dir("lora-export"), root = dir + "/ckpt", live = dir + "/live";
  auto trained = launch_workers(2, {"--out", dir, "--save", root, "--export-adapter", live}, 300,
                                "lora_worker");
  ASSERT_EQ(trained.exit_code, 0) << trained.output;
  const auto gathered = read_params(dir);

  const std::string from_ckpt = dir + "/from-ckpt";
  auto exported =
      run_process({bin("shardrl"), "export", root + "/global_step_" + std::to_string(s.steps),
                   from_ckpt, "--adapter", "default"});
  ASSERT_EQ(exported.exit_code, 0) << exported.output;
  for (const std::string& out : {from_ckpt, live}) {
    auto read = run_process({SHARDRL_PYTHON,
                             std::string(SHARDRL_SOURCE_DIR "/tests/python/read_safetensors.py"),
                             out + "/adapter_model.safetensors"});
    ASSERT_EQ(read.exit_code, 0) << read.output;
    const auto got = nlohmann::json::parse(read.output)["tensors"];
    size_t expected = 0;
    for (const auto& [name, tensor] : gathered) {
      const auto marker = name.find(".lora_");
      if (marker == std::string::npos || name.find(".default.") == std::string::npos) continue;
      ++expected;
      // blocks.0.fc1.lora_A.default.weight -> base_model.model.blocks.0.fc1.lora_A.weight
      const std::string peft =
          "base_model.model." + name.substr(0, marker) + name.substr(marker, 7) + ".weight";
      ASSERT_TRUE(got.contains(peft)) << out << ": " << peft;
      EXPECT_EQ(got[peft]["dtype"], "F32") << peft;
      EXPECT_EQ(got[peft]["shape"].get<std::vector<int64_t>>(), tensor.sizes().vec()) << peft;
      const auto values = got[peft]["values"].get<std::vector<double>>();
      EXPECT_TRUE(torch::equal(torch::tensor(values, torch::kDouble),
                               tensor.to(torch::kDouble).reshape(-1)))
          << out << ": " << peft;
    }
    EXPECT_EQ(expected, 10u);
    EXPECT_EQ(got.size(), expected) << "only the 'default' adapter, no base or 'old' tensors";
    const auto config = nlohmann::json::parse(std::ifstream(out + "/adapter_config.json"));
    EXPECT_EQ(config["peft_type"], "LORA");
    EXPECT_EQ(config["r"], 4);
    EXPECT_EQ(config["lora_alpha"], 8.0);
    EXPECT_EQ(config["target_modules"], nlohmann::json({"fc1", "fc2", "head"}));
  }
  auto missing =
      run_process({bin("shardrl"), "export", root + "/global_step_" + std::to_string(s.steps),
                   dir + "/x", "--adapter", "old"});
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("no lora.old"), std::string::npos) << missing.output;
}

}  // namespace
}  // namespace shardrl::testing
