// Foundation benchmark: one training step of models::Transformer under FSDP (one process per rank,
// started by `shardrl launch`), unsharded in one process (the compute-only baseline), and a BLAS
// GFLOP/s probe. scripts/bench.sh runs the whole comparison; this binary measures one setup.
// --mode lora: LoRA training against full fine-tuning of the same LLaMA decoder under FSDP, both
// measured in the same run (bytes sent per step and step time).
//
// Timing is a benchmark, never a test: it depends on the machine being quiet.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/DeviceAccelerator.h>
#include <dlfcn.h>
#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <numeric>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "compat.h"
#include "shardrl/dist.h"
#include "shardrl/fsdp.h"
#include "shardrl/models/llama.h"
#include "shardrl/models/lora.h"
#include "shardrl/models/transformer.h"
#include "shardrl/optim.h"

#include "stats.h"

using namespace shardrl;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

namespace {

using shardrl::bench::median;

struct Args {
  int64_t d_model = 512, layers = 6, heads = 8, vocab = 8192, seq = 128, batch = 8;
  int steps = 5, warmup = 2, threads = 0;
  int64_t matmul_n = 1024;
  std::string mode = "fsdp", json_out;
  // fsdp: a Kineto trace (chrome://tracing JSON, as torch.profiler's export_chrome_trace) of
  // profile_steps more steps after the timed ones, written by rank 0.
  std::string profile_out;
  int profile_steps = 2;
  bool reshard_root = false;
  bool reshard_after_forward = true;
  bool host_shared_params = true;
  int prefetch = 1;
  std::string param_dtype = "fp32";
  // --mode lora (LLaMA decoder): d_model, layers, heads, vocab, seq and batch as above, plus
  int64_t kv_heads = 4, intermediate = 1376, lora_r = 8;
  double lora_alpha = 16;
};

constexpr double kMaxNorm = 1.0;
constexpr uint64_t kModelSeed = 1234, kDataSeed = 4321;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

json timing_json(const std::vector<double>& s, int64_t tokens_per_step) {
  const double med = median(s);
  return {{"step_s", s},
          {"median_step_s", med},
          {"mean_step_s", s.empty() ? 0.0 : std::accumulate(s.begin(), s.end(), 0.0) / s.size()},
          {"min_step_s", s.empty() ? 0.0 : *std::min_element(s.begin(), s.end())},
          {"max_step_s", s.empty() ? 0.0 : *std::max_element(s.begin(), s.end())},
          {"tokens_per_s", med > 0 ? tokens_per_step / med : 0.0}};
}

// Total bytes sent on the loopback interface by every process of the machine: an independent
// check on the transport's own byte count (it also sees barriers, the store and TCP framing).
uint64_t loopback_tx_bytes() {
  std::ifstream in("/proc/net/dev");
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    std::string name = line.substr(0, colon);
    name.erase(0, name.find_first_not_of(' '));
    if (name != "lo") continue;
    std::istringstream fields(line.substr(colon + 1));
    uint64_t value = 0;
    for (int i = 0; i < 9; ++i) fields >> value;  // 8 receive counters, then tx bytes
    return value;
  }
  return 0;
}

// The library that actually serves sgemm_: LD_LIBRARY_PATH can put reference BLAS in front of the
// OpenBLAS alternative, and this is how a run proves which one it measured.
std::string blas_library() {
  void* symbol = dlsym(RTLD_DEFAULT, "sgemm_");
  Dl_info info{};
  if (!symbol || !dladdr(symbol, &info) || !info.dli_fname) return "unknown";
  // Through the alternatives symlinks to the file, which names the implementation.
  std::error_code error;
  auto real = std::filesystem::canonical(info.dli_fname, error);
  return error ? info.dli_fname : real.string();
}

// OpenBLAS reads OPENBLAS_NUM_THREADS once at load and at::set_num_threads does not reach it, so
// --threads is applied to it directly when OpenBLAS is loaded.
void set_compute_threads(int threads) {
  if (threads <= 0) return;
  at::set_num_threads(threads);
  using SetThreads = void (*)(int);
  if (void* fn = dlsym(RTLD_DEFAULT, "openblas_set_num_threads")) {
    reinterpret_cast<SetThreads>(fn)(threads);
  }
}

std::string env_or(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

// Kernels run asynchronously on a GPU: a step ends when the device has done its work.
void synchronize(const torch::Device& device) {
  if (!device.is_cpu()) at::accelerator::synchronizeDevice(device.index());
}

// Peak bytes the caching allocator handed out on `device` since the last reset (PyTorch's
// torch.cuda.max_memory_allocated), and the peak it held from the driver (max_memory_reserved).
json device_memory(const torch::Device& device) {
  if (device.is_cpu()) return nullptr;
  const auto stats = compat::device_memory_stats(device.index());
  const auto aggregate = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
  return {{"peak_allocated_bytes", stats.allocated_bytes[aggregate].peak},
          {"peak_reserved_bytes", stats.reserved_bytes[aggregate].peak}};
}

json run_environment() {
  return {{"threads", at::get_num_threads()},
          {"OMP_NUM_THREADS", env_or("OMP_NUM_THREADS", "")},
          {"OPENBLAS_NUM_THREADS", env_or("OPENBLAS_NUM_THREADS", "")},
          {"LD_LIBRARY_PATH", env_or("LD_LIBRARY_PATH", "")},
          {"blas_library", blas_library()}};
}

models::TransformerConfig model_config(const Args& a) {
  models::TransformerConfig c;
  c.d_model = a.d_model;
  c.n_layers = a.layers;
  c.n_heads = a.heads;
  c.vocab_size = a.vocab;
  c.max_seq_len = a.seq;
  return c;
}

// Parameters of the units outside the blocks (models::shard_transformer): the token embedding,
// the head, and the root (position embedding, final norm).
int64_t embedding_param_count(const models::TransformerConfig& c) {
  return c.vocab_size * c.d_model;
}
int64_t head_param_count(const models::TransformerConfig& c) {
  return c.vocab_size * c.d_model;
}
int64_t root_param_count(const models::TransformerConfig& c) {
  return c.max_seq_len * c.d_model + 2 * c.d_model;
}
// The root's and the head's params, which stay gathered from forward to backward; the token
// embedding and the blocks are resharded after forward.
int64_t kept_param_count(const models::TransformerConfig& c) {
  return root_param_count(c) + head_param_count(c);
}
bool kept_through_backward(const std::string& name) {
  return name.rfind("blocks.", 0) != 0 && name.rfind("tok_emb.", 0) != 0;
}
// The token embedding is gathered for forward only: its backward reads no params.
bool gathered_for_forward_only(const std::string& name) {
  return name.rfind("tok_emb.", 0) == 0;
}

json model_json(const models::TransformerConfig& c) {
  const int64_t outside_blocks =
      embedding_param_count(c) + head_param_count(c) + root_param_count(c);
  return {{"d_model", c.d_model},
          {"n_layers", c.n_layers},
          {"n_heads", c.n_heads},
          {"vocab_size", c.vocab_size},
          {"seq_len", c.max_seq_len},
          {"mlp_ratio", c.mlp_ratio},
          {"param_count", c.parameter_count()},
          {"embedding_param_count", embedding_param_count(c)},
          {"head_param_count", head_param_count(c)},
          {"root_param_count", root_param_count(c)},
          {"block_param_count", c.parameter_count() - outside_blocks}};
}

// Same model weights on every rank (sharding slices the local copy) and the same global batch.
models::Transformer build_model(const models::TransformerConfig& c) {
  torch::manual_seed(kModelSeed);
  return models::Transformer(c);
}

torch::Tensor global_batch(const Args& a) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(kDataSeed);
  return torch::randint(a.vocab, {a.batch, a.seq}, gen, torch::kLong);
}

void write_json(const Args& a, const json& j) {
  if (a.json_out.empty()) return;
  std::ofstream out(a.json_out);
  if (!out) throw std::runtime_error("cannot write " + a.json_out);
  out << j.dump(2) << "\n";
}

// This rank's rows of the global batch.
torch::Tensor local_tokens(const Args& a, const dist::World& world) {
  if (a.batch % world.size() != 0) {
    throw std::invalid_argument("--batch must be divisible by WORLD_SIZE");
  }
  const int64_t local = a.batch / world.size();
  return global_batch(a).narrow(0, world.rank() * local, local).contiguous();
}

// Kineto, as torch.profiler(activities=[CPU, CUDA]) starts it: host ops and device kernels.
void start_profiler(const torch::Device& device) {
  using torch::profiler::impl::ActivityType;
  // With the allocator's events (profile_memory): where each side reaches its peak.
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO,
                                                     /*report_input_shapes=*/false,
                                                     /*profile_memory=*/true);
  std::set<ActivityType> activities{ActivityType::CPU};
  if (device.is_cuda()) activities.insert(ActivityType::CUDA);
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
}

// The FSDP options of the sharded modes, from the command line.
fsdp::Options fsdp_options(const Args& a) {
  fsdp::Options options;
  options.reshard_after_forward = a.reshard_after_forward;
  options.prefetch = a.prefetch;
  options.host_shared_params = a.host_shared_params;
  options.mixed_precision.param_dtype = fsdp::parse_dtype(a.param_dtype, "--param-dtype");
  options.mixed_precision.output_dtype = torch::kFloat;
  return options;
}

int run_fsdp(const Args& a) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  set_compute_threads(a.threads);
  const int N = world->size(), rank = world->rank();
  // The batch lives where the model computes, as a data loader's pinned copy would put it.
  auto tokens = local_tokens(a, *world).to(mesh.device());
  const int64_t local = tokens.size(0);

  const auto config = model_config(a);
  auto model = build_model(config);
  models::shard_transformer(model, mesh, fsdp_options(a));
  auto fsdp_model = model.fsdp();
  const auto shards = fsdp_model.sharded_parameters();
  // The theoretical figures use the config's formulas; they must describe the model that runs.
  int64_t sharded_total = 0, sharded_kept = 0;
  for (const auto& p : shards) {
    const int64_t n = c10::multiply_integers(p.global_shape);
    sharded_total += n;
    if (kept_through_backward(p.name)) sharded_kept += n;
  }
  TORCH_CHECK(sharded_total == config.parameter_count() && sharded_kept == kept_param_count(config),
              "parameter count formulas disagree with the model: ", sharded_total,
              " (root and head ", sharded_kept, ") vs ", config.parameter_count(),
              " (root and head ", kept_param_count(config), ")");
  auto optimizer = optim::make_adamw(optim::from_sharded(shards), optim::AdamWConfig{});
  auto& group = world->group();

  std::vector<double> times, waits;  // waits: time blocked on FSDP collectives in forward+backward
  std::vector<double> losses;
  uint64_t fb_bytes_total = 0, clip_bytes_total = 0;
  uint64_t fb_bytes_min = UINT64_MAX, fb_bytes_max = 0;
  uint64_t lo_start = 0;
  const torch::Device device = mesh.device();
  json memory;
  const bool profiling = !a.profile_out.empty() && rank == 0;
  const int profiled_steps = a.profile_out.empty() ? 0 : a.profile_steps;
  for (int step = 0; step < a.warmup + a.steps + profiled_steps; ++step) {
    if (profiling && step == a.warmup + a.steps) start_profiler(device);
    const bool timed = step >= a.warmup && step < a.warmup + a.steps;
    // Read before the barrier so every timed step contributes its two barriers to the count.
    if (timed && step == a.warmup && rank == 0) lo_start = loopback_tx_bytes();
    // The peak is over the timed steps, after warm-up has filled the allocator's cache, as the
    // PyTorch baseline measures it.
    if (step == a.warmup && !device.is_cpu()) compat::reset_peak_device_memory(device.index());
    synchronize(device);
    group.barrier();
    const auto t0 = Clock::now();
    fsdp_model.reset_bytes_sent();
    fsdp_model.zero_grad();
    auto logits = model(tokens);
    // The root keeps its parameters through backward; resharding it here makes backward gather
    // it again, which is the textbook 3 x P schedule the theoretical figure assumes.
    if (a.reshard_root) fsdp_model.reshard();
    auto loss = models::next_token_loss(logits, tokens);
    loss.backward();
    const uint64_t fb_bytes = fsdp_model.bytes_sent();
    const double waited = mesh.shard_group().wait_seconds();
    optim::clip_and_step(fsdp_model, *optimizer, kMaxNorm);
    const uint64_t clip_bytes = fsdp_model.bytes_sent() - fb_bytes;
    synchronize(device);
    group.barrier();
    const double elapsed = seconds_since(t0);
    // The peak over the timed steps alone, before any profiled step.
    if (step == a.warmup + a.steps - 1) memory = device_memory(device);
    if (!timed) continue;
    times.push_back(elapsed);
    waits.push_back(waited);
    losses.push_back(loss.item<double>());
    fb_bytes_total += fb_bytes;
    clip_bytes_total += clip_bytes;
    fb_bytes_min = std::min(fb_bytes_min, fb_bytes);
    fb_bytes_max = std::max(fb_bytes_max, fb_bytes);
  }
  if (profiling) {
    synchronize(device);
    torch::autograd::profiler::disableProfiler()->save(a.profile_out);
  }
  const uint64_t lo_bytes = rank == 0 ? loopback_tx_bytes() - lo_start : 0;

  // Byte counts of every rank, exchanged after the timed steps so they cost no step time.
  torch::Tensor sums = torch::tensor(
      {static_cast<double>(fb_bytes_total), static_cast<double>(clip_bytes_total)}, torch::kDouble);
  torch::Tensor extremes = torch::tensor(
      {static_cast<double>(fb_bytes_max), -static_cast<double>(fb_bytes_min)}, torch::kDouble);
  group.all_reduce(sums);
  group.all_reduce(extremes, dist::ReduceOp::kMax);
  if (rank != 0) {
    group.barrier();
    return 0;
  }

  const double per = static_cast<double>(N) * std::max(a.steps, 1);
  const double fb_per_rank_step = sums[0].item<double>() / per;
  const double clip_per_rank_step = sums[1].item<double>() / per;
  const double lo_per_rank_step = static_cast<double>(lo_bytes) / per;
  const double scale = 4.0 * (N - 1) / N;  // fp32 bytes, (N-1)/N of them leave each rank
  const int64_t P = config.parameter_count(), P_kept = kept_param_count(config);
  const double theory_3p = 3.0 * P * scale;
  // The root and the head keep their params from forward to backward; --reshard-root's reshard
  // between the two lets go of them.
  const int kept_gathers = a.reshard_root ? 2 : 1;
  // Backward gathers a block again after forward resharded it, unless the host's ranks share an
  // image of the unsharded params and read the forward's rows there (--reshard-root's reshard
  // between forward and backward lets go of them). The token embedding's backward reads no
  // params: it is gathered once, in forward (FSDP2 gathers it again).
  const bool backward_reads_image =
      a.host_shared_params && mesh.shard_group().has_segment_collectives() && !a.reshard_root;
  const int block_gathers = a.reshard_after_forward && !backward_reads_image ? 2 : 1;
  const auto E = static_cast<double>(embedding_param_count(config));
  const double theory_schedule =
      (kept_gathers * P_kept + E + block_gathers * (static_cast<double>(P - P_kept) - E) + P) *
      scale;
  // What the transport must count for this exact layout: shards are padded to ceil(rows / N) rows
  // and each reduce-scatter carries one "had a grad" flag per parameter. The gathers carry the
  // compute dtype, and so does the reduce-scatter where the transport sums bf16 in fp32 (shared
  // memory, Gloo); NCCL's carries fp32 (reduce_dtype).
  const auto gather_bytes =
      static_cast<double>(c10::elementSize(fsdp::parse_dtype(a.param_dtype, "--param-dtype")));
  const double reduce_bytes = mesh.shard_group().sums_low_precision_in_fp32() ? gather_bytes : 4.0;
  double exact = 0;
  for (const auto& p : shards) {
    const double shard = static_cast<double>(p.shard.numel());
    const int gathers = gathered_for_forward_only(p.name) ? 1
                        : kept_through_backward(p.name)   ? kept_gathers
                                                          : block_gathers;
    exact += gathers * shard * gather_bytes + (shard + 1) * reduce_bytes;
  }
  exact *= N - 1;
  auto ratio = [](double x, double y) { return y > 0 ? json(x / y) : json(nullptr); };

  json comm = {{"reshard_root", a.reshard_root},
               {"bytes_sent_per_step", fb_per_rank_step},
               {"bytes_sent_constant", extremes[0].item<double>() == -extremes[1].item<double>()},
               {"clip_allreduce_bytes_per_step", clip_per_rank_step},
               {"theoretical_3p_bytes", theory_3p},
               {"theoretical_schedule_bytes", theory_schedule},
               {"expected_padded_bytes", exact},
               {"ratio_measured_to_3p", ratio(fb_per_rank_step, theory_3p)},
               {"ratio_measured_to_schedule", ratio(fb_per_rank_step, theory_schedule)},
               {"loopback_tx_bytes_per_rank_per_step", lo_per_rank_step},
               {"ratio_loopback_to_measured",
                ratio(lo_per_rank_step, fb_per_rank_step + clip_per_rank_step)}};
  json j = {{"benchmark", "bench_fsdp"},
            {"mode", "fsdp"},
            {"world_size", N},
            {"environment", run_environment()},
            {"device", device.str()},
            {"device_memory", memory},
            {"param_dtype", a.param_dtype},
            {"reshard_after_forward", a.reshard_after_forward},
            {"host_shared_params", a.host_shared_params},
            {"model", model_json(config)},
            {"batch_global", a.batch},
            {"batch_per_rank", local},
            {"warmup_steps", a.warmup},
            {"timed_steps", a.steps},
            {"loss_first", losses.empty() ? 0.0 : losses.front()},
            {"loss_last", losses.empty() ? 0.0 : losses.back()},
            {"comm", comm},
            {"exposed_comm_s", waits},
            {"median_exposed_comm_s", median(waits)}};
  j.update(timing_json(times, a.batch * a.seq));
  write_json(a, j);
  const std::string peak =
      memory.is_null() ? ""
                       : fmt::format("  peak {:.1f} MiB",
                                     memory["peak_allocated_bytes"].get<double>() / (1 << 20));
  std::printf(
      "fsdp  %s N=%d threads=%d B=%lld  median step %.4f s (blocked on comm %.4f s)  %.0f tok/s  "
      "sent/rank/step %.3f MB "
      "(x%.4f of 3P, x%.4f of schedule)  clip %.0f B  lo %.3f MB%s\n",
      device.str().c_str(), N, at::get_num_threads(), static_cast<long long>(a.batch),
      j["median_step_s"].get<double>(), median(waits), j["tokens_per_s"].get<double>(),
      fb_per_rank_step / 1e6, theory_3p > 0 ? fb_per_rank_step / theory_3p : 0.0,
      theory_schedule > 0 ? fb_per_rank_step / theory_schedule : 0.0, clip_per_rank_step,
      lo_per_rank_step / 1e6, peak.c_str());
  // Rank 0 hosts the store: the others must not find it gone while they finish.
  group.barrier();
  return 0;
}

// One FSDP training setup of the LLaMA decoder, timed like run_fsdp; bytes are what this rank sent
// in forward + backward (FSDPModule::bytes_sent).
struct StepFigures {
  std::vector<double> times;
  double bytes_per_step = 0;
  int64_t trainable = 0, total = 0;
  double loss_first = 0, loss_last = 0;
};

StepFigures train_llama(const Args& a, const dist::DeviceMesh& mesh, dist::ProcessGroup& group,
                        const torch::Tensor& tokens, bool lora) {
  models::LlamaConfig c;
  c.vocab_size = a.vocab;
  c.hidden_size = a.d_model;
  c.intermediate_size = a.intermediate;
  c.num_hidden_layers = a.layers;
  c.num_attention_heads = a.heads;
  c.num_key_value_heads = a.kv_heads;
  c.max_position_embeddings = a.seq;
  torch::manual_seed(kModelSeed);
  models::LlamaForCausalLM model(c);
  if (lora) {
    models::lora::LoraConfig config;
    config.r = a.lora_r;
    config.alpha = a.lora_alpha;
    config.target_modules = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                             "gate_proj", "up_proj", "down_proj"};
    models::lora::apply_lora(*model, config, "default");
  }
  StepFigures f;
  for (const auto& p : model->parameters()) {
    f.total += p.numel();
    if (p.requires_grad()) f.trainable += p.numel();
  }
  models::shard_llama(model, mesh, fsdp_options(a));
  auto fsdp_model = model.fsdp();
  auto optimizer =
      optim::make_adamw(optim::from_sharded(fsdp_model.sharded_parameters()), optim::AdamWConfig{});
  uint64_t bytes = 0;
  std::vector<double> losses;
  for (int step = 0; step < a.warmup + a.steps; ++step) {
    group.barrier();
    const auto t0 = Clock::now();
    fsdp_model.reset_bytes_sent();
    fsdp_model.zero_grad();
    auto loss = models::next_token_loss(model(tokens), tokens);
    loss.backward();
    const uint64_t sent = fsdp_model.bytes_sent();
    optim::clip_and_step(fsdp_model, *optimizer, kMaxNorm);
    group.barrier();
    const double elapsed = seconds_since(t0);
    if (step < a.warmup) continue;
    f.times.push_back(elapsed);
    losses.push_back(loss.item<double>());
    bytes += sent;
  }
  f.bytes_per_step = static_cast<double>(bytes) / std::max(a.steps, 1);
  f.loss_first = losses.empty() ? 0.0 : losses.front();
  f.loss_last = losses.empty() ? 0.0 : losses.back();
  return f;
}

int run_lora(const Args& a) {
  auto world = dist::World::init_from_env();
  auto mesh = dist::DeviceMesh::create(*world);
  set_compute_threads(a.threads);
  const int N = world->size(), rank = world->rank();
  auto tokens = local_tokens(a, *world);
  auto& group = world->group();
  // Full fine-tuning first, then LoRA, on the same weights and tokens.
  const StepFigures full = train_llama(a, mesh, group, tokens, /*lora=*/false);
  const StepFigures lora = train_llama(a, mesh, group, tokens, /*lora=*/true);
  torch::Tensor bytes =
      torch::tensor({full.bytes_per_step, lora.bytes_per_step}, torch::kDouble) / N;
  group.all_reduce(bytes);  // the mean over ranks
  if (rank != 0) {
    group.barrier();
    return 0;
  }
  auto figures = [&](const StepFigures& f, double sent) {
    json j = {{"trainable_params", f.trainable},
              {"total_params", f.total},
              {"bytes_sent_per_rank_step", sent},
              {"loss_first", f.loss_first},
              {"loss_last", f.loss_last}};
    j.update(timing_json(f.times, a.batch * a.seq));
    return j;
  };
  const double full_bytes = bytes[0].item<double>(), lora_bytes = bytes[1].item<double>();
  const double full_s = median(full.times), lora_s = median(lora.times);
  json j = {
      {"benchmark", "bench_fsdp"},
      {"mode", "lora"},
      {"world_size", N},
      {"environment", run_environment()},
      {"model",
       {{"family", "llama"},
        {"hidden_size", a.d_model},
        {"intermediate_size", a.intermediate},
        {"num_hidden_layers", a.layers},
        {"num_attention_heads", a.heads},
        {"num_key_value_heads", a.kv_heads},
        {"vocab_size", a.vocab},
        {"seq_len", a.seq}}},
      {"lora", {{"r", a.lora_r}, {"alpha", a.lora_alpha}, {"targets", "q,k,v,o,gate,up,down"}}},
      {"reshard_after_forward", a.reshard_after_forward},
      {"param_dtype", a.param_dtype},
      {"batch_global", a.batch},
      {"warmup_steps", a.warmup},
      {"timed_steps", a.steps},
      {"full", figures(full, full_bytes)},
      {"lora_run", figures(lora, lora_bytes)},
      {"ratio_lora_to_full_bytes", lora_bytes / full_bytes},
      {"ratio_lora_to_full_step_time", lora_s / full_s}};
  write_json(a, j);
  std::printf(
      "lora N=%d threads=%d B=%lld  full: %lld trainable, median step %.4f s, sent/rank/step "
      "%.3f MB  lora r=%lld: %lld trainable, median step %.4f s, sent/rank/step %.3f MB  "
      "ratio bytes %.4f time %.4f\n",
      N, at::get_num_threads(), static_cast<long long>(a.batch),
      static_cast<long long>(full.trainable), full_s, full_bytes / 1e6,
      static_cast<long long>(a.lora_r), static_cast<long long>(lora.trainable), lora_s,
      lora_bytes / 1e6, lora_bytes / full_bytes, lora_s / full_s);
  group.barrier();
  return 0;
}

// local: one process trains an unsharded model on --batch rows. lockstep (under shardrl launch):
// each rank trains a copy of its own on its rows of the global --batch, exchanging nothing, but
// every step starts and ends at the same barriers as fsdp mode's, so a step lasts as long as the
// slowest rank's, as in data parallel. It is data parallel with free communication on the same
// cores: fsdp over lockstep is what communication costs, without the cores' uneven speeds.
int run_local(const Args& a) {
  std::shared_ptr<dist::World> world;
  if (a.mode == "lockstep") world = dist::World::init_from_env();
  set_compute_threads(a.threads);
  const auto config = model_config(a);
  auto model = build_model(config);
  auto optimizer = optim::make_adamw(optim::from_module(*model), optim::AdamWConfig{});
  auto tokens = world ? local_tokens(a, *world) : global_batch(a);
  auto params = model->parameters();

  std::vector<double> times, losses;
  for (int step = 0; step < a.warmup + a.steps; ++step) {
    if (world) world->group().barrier();
    const auto t0 = Clock::now();
    // Dropping grads (set_to_none) as FSDP's zero_grad does, so neither side pays for zeroing.
    for (auto& p : params) p.mutable_grad() = torch::Tensor();
    auto loss = models::next_token_loss(model(tokens), tokens);
    loss.backward();
    torch::nn::utils::clip_grad_norm_(params, kMaxNorm);
    optimizer->step();
    if (world) world->group().barrier();
    const double elapsed = seconds_since(t0);
    if (step < a.warmup) continue;
    times.push_back(elapsed);
    losses.push_back(loss.item<double>());
  }
  if (world && world->rank() != 0) return 0;
  json j = {{"benchmark", "bench_fsdp"},
            {"mode", a.mode},
            {"world_size", world ? world->size() : 1},
            {"environment", run_environment()},
            {"model", model_json(config)},
            {"batch_global", a.batch},
            {"batch_per_rank", tokens.size(0)},
            {"warmup_steps", a.warmup},
            {"timed_steps", a.steps},
            {"loss_first", losses.empty() ? 0.0 : losses.front()},
            {"loss_last", losses.empty() ? 0.0 : losses.back()}};
  j.update(timing_json(times, a.batch * a.seq));
  write_json(a, j);
  std::printf("%s threads=%d B=%lld  median step %.4f s  %.0f tok/s  blas %s\n", a.mode.c_str(),
              at::get_num_threads(), static_cast<long long>(a.batch),
              j["median_step_s"].get<double>(), j["tokens_per_s"].get<double>(),
              blas_library().c_str());
  return 0;
}

int run_matmul(const Args& a) {
  set_compute_threads(a.threads);
  torch::NoGradGuard no_grad;
  const int64_t n = a.matmul_n;
  auto x = torch::randn({n, n}), y = torch::randn({n, n}), out = torch::empty({n, n});
  std::vector<double> times;
  for (int rep = 0; rep < a.warmup + std::max(a.steps, 1); ++rep) {
    const auto t0 = Clock::now();
    torch::mm_out(out, x, y);
    const double elapsed = seconds_since(t0);
    if (rep >= a.warmup) times.push_back(elapsed);
  }
  const double med = median(times);
  const double gflops = med > 0 ? 2.0 * n * n * n / med / 1e9 : 0.0;
  json j = {{"benchmark", "bench_fsdp"},
            {"mode", "matmul"},
            {"environment", run_environment()},
            {"n", n},
            {"warmup_reps", a.warmup},
            {"timed_reps", times.size()},
            {"rep_s", times},
            {"median_s", med},
            {"gflops", gflops}};
  write_json(a, j);
  std::printf("matmul %lldx%lld fp32 threads=%d  median %.4f s  %.2f GFLOP/s  blas %s\n",
              static_cast<long long>(n), static_cast<long long>(n), at::get_num_threads(), med,
              gflops, blas_library().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"ShardRL foundation benchmark: FSDP vs unsharded training step, BLAS probe"};
  Args a;
  app.add_option("--mode", a.mode,
                 "fsdp, lora or lockstep (under shardrl launch), local (one process) or matmul")
      ->check(CLI::IsMember({"fsdp", "lora", "lockstep", "local", "matmul"}));
  app.add_option("--d-model", a.d_model)->check(CLI::PositiveNumber);
  app.add_option("--layers", a.layers)->check(CLI::PositiveNumber);
  app.add_option("--heads", a.heads)->check(CLI::PositiveNumber);
  app.add_option("--vocab", a.vocab)->check(CLI::PositiveNumber);
  app.add_option("--seq", a.seq, "Tokens per row")->check(CLI::Range(int64_t{2}, int64_t{1} << 20));
  app.add_option("--batch", a.batch,
                 "Rows per step: global under shardrl launch, this process's in local")
      ->check(CLI::PositiveNumber);
  app.add_option("--steps", a.steps, "Timed steps (matmul: repetitions)")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", a.warmup, "Untimed steps first")->check(CLI::NonNegativeNumber);
  app.add_option("--threads", a.threads, "Compute threads (0: keep OMP_NUM_THREADS)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--matmul-n", a.matmul_n, "Matrix size for --mode matmul")
      ->check(CLI::PositiveNumber);
  app.add_option("--json-out", a.json_out, "Write the result here (fsdp: rank 0 writes)");
  app.add_option("--prefetch", a.prefetch, "fsdp: units all-gathered ahead");
  app.add_option("--profile-out", a.profile_out,
                 "fsdp: rank 0 writes a Kineto trace (chrome JSON) of --profile-steps more steps");
  app.add_option("--profile-steps", a.profile_steps)->check(CLI::PositiveNumber);
  app.add_option("--param-dtype", a.param_dtype, "fsdp: mixed_precision.param_dtype");
  app.add_flag("--reshard-after-forward,!--no-reshard-after-forward", a.reshard_after_forward,
               "fsdp: free block params after forward (default) or keep them until backward");
  app.add_flag("--host-shared-params,!--no-host-shared-params", a.host_shared_params,
               "fsdp: ranks of a host share one image of the unsharded params (default)");
  app.add_flag("--reshard-root,!--no-reshard-root", a.reshard_root,
               "fsdp: free the root's parameters after forward so backward gathers them again");
  app.add_option("--kv-heads", a.kv_heads, "lora: key/value heads")->check(CLI::PositiveNumber);
  app.add_option("--intermediate", a.intermediate, "lora: MLP width")->check(CLI::PositiveNumber);
  app.add_option("--lora-r", a.lora_r, "lora: adapter rank")->check(CLI::PositiveNumber);
  app.add_option("--lora-alpha", a.lora_alpha, "lora: adapter alpha");
  CLI11_PARSE(app, argc, argv);
  try {
    if (a.mode == "fsdp") return run_fsdp(a);
    if (a.mode == "lora") return run_lora(a);
    if (a.mode == "local" || a.mode == "lockstep") return run_local(a);
    return run_matmul(a);
  } catch (const std::exception& e) {
    std::cerr << "bench_fsdp: " << e.what() << std::endl;
    return 1;
  }
}
