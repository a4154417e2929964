// SD3 transformer forward + backward time beside diffusers' on the same folder and inputs
// (tests/python/sd3_reference.py makes both and times diffusers):
//
//   python tests/python/sd3_reference.py pretrained /tmp/sd3-bench bench
//   OMP_NUM_THREADS=1 build/bin/bench_sd3 --model /tmp/sd3-bench --repeats 20
//   OMP_NUM_THREADS=1 python tests/python/sd3_reference.py bench /tmp/sd3-bench
//       /tmp/sd3-bench/io.safetensors 20
//
// Timing is a benchmark, never a test: it depends on the machine being quiet.
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <vector>

#include "shardrl/checkpoint.h"
#include "shardrl/models/sd3.h"

using namespace shardrl;

int main(int argc, char** argv) {
  CLI::App app{"SD3 transformer forward + backward time"};
  std::string model_dir;
  int repeats = 20;
  app.add_option("--model", model_dir, "diffusers folder with io.safetensors")->required();
  app.add_option("--repeats", repeats);
  CLI11_PARSE(app, argc, argv);
  try {
    auto model = models::load_sd3(model_dir);
    checkpoint::HfWeights io(model_dir + "/io.safetensors");
    auto read = [&](const std::string& name) { return io.reader(name).read(name); };
    const auto x = read("x"), prompt = read("prompt_embeds"), pooled = read("pooled"),
               t = read("t");
    auto step = [&] {
      for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
      model(x, prompt, pooled, t).sum().backward();
    };
    step();  // warm-up
    // The median step: other processes sharing the cores lengthen some steps, not the median.
    std::vector<double> times;
    for (int i = 0; i < repeats; ++i) {
      const auto start = std::chrono::steady_clock::now();
      step();
      times.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    std::sort(times.begin(), times.end());
    std::cout << nlohmann::json{{"shardrl_median_seconds", times[times.size() / 2]},
                                {"threads", at::get_num_threads()}}
                     .dump()
              << std::endl;
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
}
