// One rank of the collective tests (tests/test_comm.cpp), on whichever transport the group picked
// for its bulk collectives (shared memory for ranks of one host, Gloo with SHARDRL_SHM_DISABLE=1).
//   check     all-gather, reduce-scatter and all-to-all over sizes around the transport's slot
//             and sub-slot boundaries, several in flight at once, in fp32, bf16, fp64 and int64.
//             With shared memory also the segmented all-gather and reduce-scatter FSDP uses.
//             Every element is a small integer, so every sum is exact and each rank checks its
//             results bit for bit against values it computes itself with plain loops.
//   exit      --exit-rank leaves the job (exit 0) before the second all-gather; the others
//             report the error they get and how long it took.
//   stall     --exit-rank sleeps through the second all-gather for --stall-ms, then leaves.
//   mismatch  rank 0 all-gathers twice the elements the others do.
//   finish    after one all-reduce every rank returns from main (its World torn down, the store
//             with rank 0's), --exit-rank --stall-ms later than the others.
//   vanish    as finish, but --exit-rank dies at once (std::_Exit, no destructors).
//   orphan-image  (shared memory) rank 1 dies; rank 0 then maps a host-shared image, which fails,
//             and lists what of its own is left in /dev/shm.
//   image     (shared memory) FSDP's host-shared image: each rank writes its rows of a gather
//             into memory every rank maps, and every rank reads all rows there. Rank 1 holds the
//             first gather for --stall-ms while rank 0 starts the second: rank 0 must wait, and
//             rank 1 must see the first gather's rows all along. An image larger than /dev/shm
//             can hold is refused on every rank, and the group goes on.
// --no-shm-rank R sets SHARDRL_SHM_DISABLE=1 on rank R alone.
// Each rank writes OUT/rank<R>.json: the group's bulk transport, the cases run, every mismatch
// found, and the error (message and seconds) of the failing modes.
#include <c10/util/BFloat16.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <thread>

#include "comm/shm_transport.h"
#include "shardrl/dist.h"

using namespace shardrl;
using json = nlohmann::json;

namespace {

// Element i of rank q's tensor: an integer in [-30, 30], exact in every dtype used here, and so
// are sums of a few of them.
int64_t value(int q, int64_t i) {
  return (i * 7 + q * 13 + i / 5) % 61 - 30;
}

torch::Tensor make(int q, int64_t n, torch::ScalarType dtype, int64_t offset = 0) {
  auto t = torch::empty({n}, torch::kInt64);
  auto* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) p[i] = value(q, offset + i);
  return t.to(dtype);
}

// Every element of `got`, read as int64, against `want`.
std::string compare(const torch::Tensor& got, const std::vector<int64_t>& want) {
  auto as_int = got.to(torch::kInt64).contiguous();
  const auto* p = as_int.data_ptr<int64_t>();
  if (static_cast<size_t>(as_int.numel()) != want.size())
    return "numel " + std::to_string(as_int.numel()) + " != " + std::to_string(want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    if (p[i] != want[i]) {
      return "element " + std::to_string(i) + ": " + std::to_string(p[i]) +
             " != " + std::to_string(want[i]);
    }
  }
  return "";
}

json check(dist::ProcessGroup& group) {
  const int w = group.size(), r = group.rank();
  // Elements a shard (or a chunk): empty, tiny, odd, either side of 1 MiB slots and 1 MiB / W
  // sub-slots in fp32 and bf16, and a dozen slots.
  const std::vector<int64_t> sizes = {0,      1,      7,      65537,  131072, 131073,
                                      262143, 262144, 262145, 524288, 3000001};
  const std::vector<torch::ScalarType> dtypes = {torch::kFloat, torch::kBFloat16, torch::kDouble,
                                                 torch::kInt64};
  json failures = json::array();
  int cases = 0;
  for (auto dtype : dtypes) {
    for (int64_t n : sizes) {
      // Issue all three before waiting on any: several collectives in flight, completed in order.
      auto shard = make(r, n, dtype);
      auto gathered = torch::full({w * n}, -99, torch::TensorOptions(dtype));
      auto gather = group.all_gather_async(shard, gathered);

      std::vector<torch::Tensor> pieces;
      for (int j = 0; j < w; ++j) pieces.push_back(make(r, n, dtype, j * n));
      auto scatter_in = torch::cat(pieces);
      auto reduced = torch::full({n}, -99, torch::TensorOptions(dtype));
      dist::Pending scatter;
      const bool sums = dtype != torch::kInt64;  // FSDP reduces floating-point gradients
      if (sums) scatter = group.reduce_scatter_async(scatter_in, reduced);

      auto exchanged = torch::full({w * n}, -99, torch::TensorOptions(dtype));
      auto exchange = group.all_to_all_async(scatter_in, exchanged);

      gather.wait();
      if (sums) scatter.wait();
      exchange.wait();

      std::vector<int64_t> want_gather, want_reduce(n, 0), want_exchange;
      for (int q = 0; q < w; ++q)
        for (int64_t i = 0; i < n; ++i) want_gather.push_back(value(q, i));
      for (int q = 0; q < w; ++q)
        for (int64_t i = 0; i < n; ++i) want_reduce[i] += value(q, r * n + i);
      for (int q = 0; q < w; ++q)
        for (int64_t i = 0; i < n; ++i) want_exchange.push_back(value(q, r * n + i));
      auto record = [&](const char* op, const std::string& why) {
        ++cases;
        if (!why.empty())
          failures.push_back({{"op", op}, {"dtype", c10::toString(dtype)}, {"n", n}, {"why", why}});
      };
      record("all_gather", compare(gathered, want_gather));
      if (sums) record("reduce_scatter", compare(reduced, want_reduce));
      record("all_to_all", compare(exchanged, want_exchange));
    }
  }
  // FSDP's gather reads its shard from its own place in the output.
  auto out = torch::full({w * 1000}, -99, torch::kFloat);
  out.narrow(0, r * 1000, 1000).copy_(make(r, 1000, torch::kFloat));
  group.all_gather(out.narrow(0, r * 1000, 1000), out);
  std::vector<int64_t> want;
  for (int q = 0; q < w; ++q)
    for (int64_t i = 0; i < 1000; ++i) want.push_back(value(q, i));
  ++cases;
  if (auto why = compare(out, want); !why.empty())
    failures.push_back({{"op", "all_gather in place"}, {"why", why}});
  // The caller may overwrite its shard as soon as the all-gather is issued (Gloo's path never reads
  // it later either): offload and casts hand over temporaries.
  {
    const int64_t m = 300000;  // more than one slot
    auto reused = make(r, m, torch::kFloat);
    auto into = torch::full({w * m}, -99, torch::kFloat);
    auto pending = group.all_gather_async(reused, into);
    reused.fill_(-7);
    pending.wait();
    std::vector<int64_t> expected;
    for (int q = 0; q < w; ++q)
      for (int64_t i = 0; i < m; ++i) expected.push_back(value(q, i));
    ++cases;
    if (auto why = compare(into, expected); !why.empty())
      failures.push_back({{"op", "all_gather of a shard overwritten after issue"}, {"why", why}});
  }
  // The segmented all-gather FSDP uses on shared memory: each segment into its own part, cut at
  // the part's end (the last ranks' padding rows), across slot boundaries; the shard overwritten
  // once issued.
  if (group.has_segment_collectives()) {
    for (auto dtype : {torch::kFloat, torch::kBFloat16}) {
      const std::vector<int64_t> lengths = {5, 0, 300000, 1, 262144, 131073};
      const std::vector<int64_t> cut = {0, 0, 7, 0, 0, 131070};  // elements missing at the end
      int64_t total = 0;
      for (int64_t l : lengths) total += l;
      auto shard = make(r, total, dtype);
      std::vector<torch::Tensor> parts;
      for (size_t i = 0; i < lengths.size(); ++i)
        parts.push_back(torch::full({w * lengths[i] - cut[i]}, -99, torch::TensorOptions(dtype)));
      auto pending = group.all_gather_segments_async(shard, parts, lengths);
      shard.fill_(-7);
      pending.wait();
      int64_t offset = 0;
      for (size_t i = 0; i < lengths.size(); ++i) {
        std::vector<int64_t> expected;
        for (int q = 0; q < w; ++q)
          for (int64_t j = 0; j < lengths[i]; ++j) expected.push_back(value(q, offset + j));
        expected.resize(expected.size() - cut[i]);
        offset += lengths[i];
        ++cases;
        if (auto why = compare(parts[i], expected); !why.empty()) {
          failures.push_back({{"op", "all_gather_segments"},
                              {"dtype", c10::toString(dtype)},
                              {"segment", i},
                              {"why", why}});
        }
      }
    }
  }
  // The segmented reduce-scatter FSDP uses on shared memory: each rank's rows read where they are,
  // zeros past a part's end (padding rows) or where a rank has no part (a param without a grad:
  // segment 3 on every rank, segment 6 on rank 0), each sum times the scale into its own output.
  if (group.has_segment_collectives()) {
    const std::vector<std::pair<torch::ScalarType, torch::ScalarType>> in_out = {
        {torch::kFloat, torch::kFloat},
        {torch::kBFloat16, torch::kFloat},
        {torch::kBFloat16, torch::kBFloat16}};
    for (auto [dtype, out_dtype] : in_out) {
      const std::vector<int64_t> lengths = {5, 0, 300000, 4, 262144, 131073, 3};
      const std::vector<int64_t> cut = {0, 0, 7, 0, 0, 131070, 1};
      auto held = [&](int q, size_t i) { return i != 3 && !(i == 6 && q == 0); };
      std::vector<torch::Tensor> inputs, outputs;
      int64_t base = 0;
      std::vector<int64_t> bases;
      for (size_t i = 0; i < lengths.size(); ++i) {
        bases.push_back(base);
        inputs.push_back(held(r, i) ? make(r, w * lengths[i] - cut[i], dtype, base)
                                    : torch::Tensor());
        outputs.push_back(torch::full({lengths[i]}, -99, torch::TensorOptions(out_dtype)));
        base += w * lengths[i];
      }
      group.reduce_scatter_segments_async(inputs, lengths, dtype, outputs, 0.5).wait();
      for (size_t i = 0; i < lengths.size(); ++i) {
        std::vector<int64_t> twice(lengths[i], 0);  // the sums, before the scale of 1/2
        for (int q = 0; q < w; ++q) {
          for (int64_t e = 0; e < lengths[i]; ++e) {
            const int64_t j = r * lengths[i] + e;
            if (held(q, i) && j < w * lengths[i] - cut[i]) twice[e] += value(q, bases[i] + j);
          }
        }
        ++cases;
        if (auto why = compare(outputs[i].to(torch::kDouble) * 2, twice); !why.empty()) {
          failures.push_back({{"op", "reduce_scatter_segments"},
                              {"dtype", c10::toString(dtype)},
                              {"out_dtype", c10::toString(out_dtype)},
                              {"segment", i},
                              {"why", why}});
        }
      }
    }
  }
  // bf16 gradients reduced into an fp32 output, summed in fp32.
  auto in = make(r, w * 5000, torch::kBFloat16);
  auto reduced = torch::empty({5000}, torch::kFloat);
  group.reduce_scatter(in, reduced);
  std::vector<int64_t> want_sum(5000, 0);
  for (int q = 0; q < w; ++q)
    for (int64_t i = 0; i < 5000; ++i) want_sum[i] += value(q, r * 5000 + i);
  ++cases;
  if (auto why = compare(reduced, want_sum); !why.empty())
    failures.push_back({{"op", "reduce_scatter bf16 -> fp32"}, {"why", why}});
  return {{"cases", cases}, {"failures", failures}};
}

json image_check(dist::ProcessGroup& group, int hold_ms) {
  json failures = json::array();
  int cases = 0;
  const int r = group.rank(), w = group.size();
  // Segments as FSDP's params are: rows past the param's end (the last ranks' padding) are cut.
  const std::vector<int64_t> lengths = {5, 300000, 131073};
  const std::vector<int64_t> cut = {0, 7, 131070};
  std::vector<int64_t> offsets;
  int64_t total = 0, bytes = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    offsets.push_back(bytes);
    bytes += (w * lengths[i] - cut[i]) * 4;
    total += lengths[i];
  }
  std::string why;
  auto image = group.map_host_image(static_cast<size_t>(bytes), &why);
  if (!image) return {{"failures", {{{"op", "map_host_image"}, {"why", why}}}}};
  std::vector<torch::Tensor> parts;
  for (size_t i = 0; i < lengths.size(); ++i)
    parts.push_back(torch::from_blob(image->data() + offsets[i], {w * lengths[i] - cut[i]}));
  auto expected = [&](size_t i, int64_t base) {
    std::vector<int64_t> e;
    int64_t at = base;
    for (size_t k = 0; k < i; ++k) at += lengths[k];
    for (int q = 0; q < w; ++q)
      for (int64_t j = 0; j < lengths[i]; ++j) e.push_back(value(q, at + j));
    e.resize(e.size() - cut[i]);
    return e;
  };
  auto check_all = [&](const std::string& what, int64_t base) {
    for (size_t i = 0; i < lengths.size(); ++i) {
      ++cases;
      if (auto mismatch = compare(parts[i], expected(i, base)); !mismatch.empty())
        failures.push_back({{"op", what}, {"segment", i}, {"why", mismatch}});
    }
  };
  json result;
  for (uint64_t generation = 1; generation <= 2; ++generation) {
    const int64_t base = generation == 1 ? 0 : 1000;  // the second gather's values differ
    if (generation == 2 && r == 1) {
      // Still computing with the first gather: its rows must not change under this rank.
      const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(hold_ms);
      do {
        check_all("first gather, read while a peer starts the second", 0);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      } while (std::chrono::steady_clock::now() < until);
    }
    auto shard = make(r, total, torch::kFloat, base);
    const auto start = std::chrono::steady_clock::now();
    auto pending = group.all_gather_in_image_async(*image, generation, shard, parts, lengths);
    result["issue_seconds_" + std::to_string(generation)] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    shard.fill_(-7);  // written once the call returns: the rows are in the image already
    pending.wait();
    check_all("all_gather_in_image #" + std::to_string(generation), base);
    // Not released here: the next gather releases this rank's hold (rank 1 holds until then).
  }
  // More than /dev/shm holds: refused on every rank alike, and the group goes on.
  std::string too_big;
  result["too_big_mapped"] = group.map_host_image(size_t{1} << 50, &too_big) != nullptr;
  result["too_big_why"] = too_big;
  auto one = torch::full({3}, static_cast<float>(r));
  auto all = torch::empty({3 * w});
  group.all_gather(one, all);
  ++cases;
  if (all[3 * (w - 1)].item<float>() != static_cast<float>(w - 1))
    failures.push_back({{"op", "all_gather after a refused image"}});
  result["cases"] = cases;
  result["failures"] = failures;
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"collective test worker"};
  std::string mode = "check", out = ".";
  int exit_rank = 1, timeout_ms = 60000, stall_ms = 0, no_shm_rank = -1;
  app.add_option("mode", mode)->required();
  app.add_option("--out", out)->required();
  app.add_option("--exit-rank", exit_rank);
  app.add_option("--timeout-ms", timeout_ms);
  app.add_option("--stall-ms", stall_ms);
  app.add_option("--no-shm-rank", no_shm_rank, "this rank alone sets SHARDRL_SHM_DISABLE=1");
  CLI11_PARSE(app, argc, argv);
  if (const char* rank = std::getenv("RANK"); rank && std::atoi(rank) == no_shm_rank)
    setenv("SHARDRL_SHM_DISABLE", "1", 1);

  dist::InitOptions options;
  options.backend = "gloo";
  options.timeout = std::chrono::milliseconds(timeout_ms);
  auto world = dist::World::init_from_env(options);
  auto& group = world->group();
  json result = {{"transport", group.bulk_transport()}};
  if (mode == "orphan-image") {
    // Rank 1 dies after the group is up; rank 0 then maps an image, which it makes before it waits
    // for rank 1, and reports what of its own is left in /dev/shm.
    group.barrier();
    if (world->rank() == 1) std::_Exit(0);
    std::string why;
    try {
      result["mapped"] = group.map_host_image(size_t{64} << 20, &why) != nullptr;
    } catch (const dist::CollectiveError& e) {
      result["error"] = e.what();
    }
    const std::string mine = "shardrl-" + std::to_string(getpid()) + "-";
    result["left_in_dev_shm"] = json::array();
    for (const auto& entry : std::filesystem::directory_iterator("/dev/shm")) {
      const std::string name = entry.path().filename().string();
      if (name.rfind(mine, 0) == 0) result["left_in_dev_shm"].push_back(name);
    }
    std::ofstream(out + "/rank0.json") << result.dump(1);
    std::_Exit(0);
  }
  if (mode == "finish" || mode == "vanish") {
    // The end of a job whose ranks finish apart: rank --exit-rank is still at work (finish) or
    // dies without its destructors (vanish) when the others end. Every other rank returns from
    // main, so its World and the store it may host are torn down.
    auto t = torch::ones({4});
    group.all_reduce(t);
    result["sum"] = t[0].item<double>();
    const bool late = world->rank() == exit_rank;
    if (late && mode == "vanish") std::_Exit(0);
    if (late) std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms));
    // When main returned: the test measures how long the teardown after it took.
    result["returned_at"] =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    std::ofstream(out + "/rank" + std::to_string(world->rank()) + ".json") << result.dump(1);
    return 0;
  }
  if (mode == "check") {
    result.update(check(group));
  } else if (mode == "image") {
    result.update(image_check(group, stall_ms));
  } else {
    const int r = group.rank(), w = group.size();
    const int64_t n = 300000;  // several sub-slots: the failure comes mid-collective for some
    auto shard = torch::ones({n});
    auto gathered = torch::empty({w * n});
    group.all_gather(shard, gathered);
    if (r == exit_rank && (mode == "exit" || mode == "stall")) {
      result["left"] = true;
      std::ofstream(out + "/rank" + std::to_string(world->rank()) + ".json") << result.dump(1);
      if (mode == "stall") std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms));
      std::_Exit(0);
    }
    const auto start = std::chrono::steady_clock::now();
    try {
      auto bigger = mode == "mismatch" && r == 0 ? torch::ones({2 * n}) : shard;
      auto into = torch::empty({w * bigger.numel()});
      group.all_gather(bigger, into);
      result["error"] = nullptr;
    } catch (const dist::CollectiveError& e) {
      result["error"] = e.what();
    }
    result["seconds"] =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  std::ofstream(out + "/rank" + std::to_string(world->rank()) + ".json") << result.dump(1);
  // A failed group is abandoned, not torn down; the job ends here either way.
  std::_Exit(0);
}
