#include "preference_pairs.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>

namespace shardrl::trainer {
namespace {

using nlohmann::json;

// Where a bad value was found, for every error of one line.
struct Where {
  const std::string& key;
  const std::string& file;
  int64_t line;
  [[noreturn]] void fail(const std::string& field, const std::string& what) const {
    throw std::invalid_argument(
        fmt::format("config key '{}': {} line {}: '{}' {}", key, file, line, field, what));
  }
};

// Nested lists of numbers -> a tensor of that shape (rectangular, at most 3 levels).
torch::Tensor nested_tensor(const json& value, const std::string& field, const Where& where) {
  std::vector<int64_t> shape;
  const json* level = &value;
  while (level->is_array()) {
    if (level->empty()) where.fail(field, "holds an empty list");
    shape.push_back(static_cast<int64_t>(level->size()));
    level = &level->front();
  }
  if (shape.empty() || shape.size() > 3) where.fail(field, "must be a [C, H, W] or [H, W] list");
  std::vector<float> flat;
  std::function<void(const json&, size_t)> walk = [&](const json& node, size_t depth) {
    if (depth == shape.size()) {
      if (!node.is_number()) where.fail(field, "holds something other than numbers");
      flat.push_back(node.get<float>());
      return;
    }
    if (!node.is_array() || static_cast<int64_t>(node.size()) != shape[depth]) {
      where.fail(field, "is not rectangular");
    }
    for (const auto& item : node) walk(item, depth + 1);
  };
  walk(value, 0);
  auto t = torch::tensor(flat, torch::kFloat).reshape(shape);
  return shape.size() == 2 ? t.unsqueeze(0) : t;
}

std::string prompt_of(const json& row, const Where& where) {
  if (row.contains("extra_info") && row["extra_info"].is_object() &&
      row["extra_info"].contains("raw_prompt") && row["extra_info"]["raw_prompt"].is_string()) {
    return row["extra_info"]["raw_prompt"].get<std::string>();
  }
  if (!row.contains("prompt")) where.fail("prompt", "is missing");
  const auto& prompt = row["prompt"];
  if (prompt.is_string()) return prompt.get<std::string>();
  if (prompt.is_array()) {
    // Chat messages: the user turns, as verl-omni's _user_text_from_chat joins them.
    std::string text;
    for (const auto& m : prompt) {
      if (m.is_object() && m.value("role", "") == "user" && m.contains("content") &&
          m["content"].is_string()) {
        text += (text.empty() ? "" : "\n") + m["content"].get<std::string>();
      }
    }
    return text;
  }
  where.fail("prompt", "must be a string or chat messages");
}

double score_of(const json& row, const char* field, double fallback, const Where& where) {
  if (!row.contains(field) || row[field].is_null()) return fallback;
  if (!row[field].is_number()) where.fail(field, "must be a number");
  return row[field].get<double>();
}

json nested_list(const torch::Tensor& t) {
  auto c = t.to(torch::kDouble).contiguous();
  if (c.dim() == 1) {
    return json(std::vector<double>(c.data_ptr<double>(), c.data_ptr<double>() + c.numel()));
  }
  json out = json::array();
  for (int64_t i = 0; i < c.size(0); ++i) out.push_back(nested_list(c[i]));
  return out;
}

}  // namespace

PreferencePairs read_preference_pairs(const std::vector<std::string>& files,
                                      const std::vector<int64_t>& sample_shape,
                                      const std::string& key) {
  if (files.empty()) {
    throw std::invalid_argument(fmt::format(
        "config key '{}' lists no file: offline DPO reads its pairs from .jsonl files", key));
  }
  PreferencePairs pairs;
  std::vector<torch::Tensor> chosen, rejected;
  std::vector<float> chosen_scores, rejected_scores;
  for (const auto& file : files) {
    std::ifstream in(file);
    if (!in) throw std::invalid_argument(fmt::format("config key '{}': cannot read {}", key, file));
    std::string text;
    int64_t line = 0;
    while (std::getline(in, text)) {
      ++line;
      if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
      const Where where{key, file, line};
      json row;
      try {
        row = json::parse(text);
      } catch (const json::parse_error& e) {
        where.fail("(the line)", fmt::format("is not JSON: {}", e.what()));
      }
      if (!row.is_object()) where.fail("(the line)", "is not a JSON object");
      for (const char* field : {"img_win_latents", "img_lose_latents"}) {
        if (!row.contains(field)) where.fail(field, "is missing");
        auto t = nested_tensor(row[field], field, where);
        if (t.sizes().vec() != sample_shape) {
          where.fail(field, fmt::format("has shape {}, the model samples {}",
                                        json(t.sizes().vec()).dump(), json(sample_shape).dump()));
        }
        (std::string(field) == "img_win_latents" ? chosen : rejected).push_back(t);
      }
      const double win = score_of(row, "win_score", 1.0, where);
      const double lose = score_of(row, "lose_score", 0.0, where);
      if (win < lose) where.fail("win_score", fmt::format("{} is below lose_score {}", win, lose));
      chosen_scores.push_back(static_cast<float>(win));
      rejected_scores.push_back(static_cast<float>(lose));
      pairs.prompts.push_back(prompt_of(row, where));
      pairs.uids.push_back(row.contains("uid") && row["uid"].is_string()
                               ? row["uid"].get<std::string>()
                               : fmt::format("{}:{}", file, line));
    }
  }
  if (pairs.prompts.empty()) {
    throw std::invalid_argument(fmt::format("config key '{}': the files hold no pair", key));
  }
  pairs.chosen = torch::stack(chosen);
  pairs.rejected = torch::stack(rejected);
  pairs.chosen_scores = torch::tensor(chosen_scores, torch::kFloat);
  pairs.rejected_scores = torch::tensor(rejected_scores, torch::kFloat);
  return pairs;
}

void write_preference_pairs(const std::string& path, const PreferencePairs& pairs, int64_t step) {
  namespace fs = std::filesystem;
  const auto parent = fs::path(path).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    for (int64_t i = 0; i < pairs.size(); ++i) {
      const double win = pairs.chosen_scores[i].item<double>();
      json row = {{"prompt", pairs.prompts[i]},
                  {"uid", pairs.uids[i]},
                  {"img_win_latents", nested_list(pairs.chosen[i])},
                  {"img_lose_latents", nested_list(pairs.rejected[i])},
                  {"win_score", win},
                  {"lose_score", pairs.rejected_scores[i].item<double>()},
                  {"input", pairs.prompts[i]},
                  {"score", win},
                  {"step", step}};
      out << row.dump() << '\n';
    }
    if (!out) throw std::runtime_error("trainer.rollout_data_dir: cannot write " + tmp);
  }
  fs::rename(tmp, path);
}

}  // namespace shardrl::trainer
