// A LoRA adapter's config as PEFT writes it (adapter_config.json) and PEFT's rule for the modules
// it targets. Apart from the layers in lora.cpp: reading the file builds no model, so the parsers'
// fuzz build (fuzz/) reads it without LibTorch's modules.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <regex>

#include "models/json_fields.h"
#include "shardrl/models/lora.h"

namespace shardrl::models::lora {
namespace {

// target_modules' regex comes from a file: libstdc++'s breadth-first (Thompson) executor matches
// in time polynomial in the name's length, where its default backtracking one takes exponential
// time on a pattern such as (.*)*(.*)*x. It refuses back-references, which no module name needs.
#if defined(__GLIBCXX__)
constexpr auto kRegexFlags = std::regex::ECMAScript | std::regex_constants::__polynomial;
#else
constexpr auto kRegexFlags = std::regex::ECMAScript;
#endif

// PEFT LoraConfig fields that change what the adapter computes, with the value under which it is
// plain LoRA, all ShardRL implements. Another value is refused rather than silently ignored.
const std::vector<std::pair<const char*, nlohmann::json>>& plain_lora_fields() {
  static const std::vector<std::pair<const char*, nlohmann::json>> fields = {
      {"use_dora", false},
      {"use_rslora", false},  // alpha / sqrt(r) scaling
      {"use_qalora", false},
      {"fan_in_fan_out", false},
      {"bias", "none"},
      {"lora_bias", false},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"exclude_modules", nullptr},
      {"target_parameters", nullptr},
      {"layer_replication", nullptr},
      {"trainable_token_indices", nullptr},
      {"alora_invocation_tokens", nullptr},
  };
  return fields;
}

}  // namespace

std::string LoraConfig::describe_targets() const {
  std::string out;
  for (const auto& t : target_modules) out += (out.empty() ? "" : ", ") + t;
  if (!target_regex.empty()) out += (out.empty() ? "regex " : ", regex ") + target_regex;
  return out;
}

bool is_target(const LoraConfig& config, const std::string& module_name) {
  const std::string& name = module_name;
  for (const auto& t : config.target_modules) {
    if (name == t ||
        (name.size() > t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0 &&
         name[name.size() - t.size() - 1] == '.')) {
      return true;
    }
  }
  return !config.target_regex.empty() &&
         std::regex_match(name, std::regex(config.target_regex, kRegexFlags));
}

std::string peft_adapter_config(const LoraConfig& config, const std::string& base_model) {
  nlohmann::json j = {{"peft_type", "LORA"},
                      {"r", config.r},
                      {"lora_alpha", config.alpha},
                      {"lora_dropout", config.dropout},
                      {"target_modules", config.target_modules},
                      {"bias", "none"},
                      {"fan_in_fan_out", false},
                      {"inference_mode", true},
                      {"base_model_name_or_path", base_model}};
  if (!config.target_regex.empty()) j["target_modules"] = config.target_regex;
  return j.dump(2);
}

LoraConfig config_from_peft(const nlohmann::json& peft, const std::string& where) {
  if (!peft.is_object()) {
    throw std::invalid_argument(fmt::format("{}: not a PEFT LoRA config (a JSON object)", where));
  }
  const auto bad = [&](const char* field, const std::string& expected) {
    return std::invalid_argument(fmt::format("{}: field {} is {}; expected {}", where, field,
                                             peft.contains(field) ? peft[field].dump() : "missing",
                                             expected));
  };
  LoraConfig config;
  if (!peft.contains("r") || !detail::fits<int64_t>(peft["r"]) || peft["r"].get<int64_t>() <= 0) {
    throw bad("r", "a positive integer");
  }
  config.r = peft["r"].get<int64_t>();
  if (!peft.contains("lora_alpha") || !peft["lora_alpha"].is_number()) {
    throw bad("lora_alpha", "a number");
  }
  config.alpha = peft["lora_alpha"].get<double>();
  if (peft.contains("lora_dropout") && !peft["lora_dropout"].is_null()) {
    const auto& dropout = peft["lora_dropout"];
    if (!dropout.is_number() || !(dropout.get<double>() >= 0 && dropout.get<double>() < 1)) {
      throw bad("lora_dropout", "a number in [0, 1)");
    }
    config.dropout = dropout.get<double>();
  }
  const auto& targets = peft.contains("target_modules") ? peft["target_modules"] : nlohmann::json();
  if (targets.is_string()) {
    config.target_regex = targets.get<std::string>();
    try {
      std::regex check(config.target_regex, kRegexFlags);
    } catch (const std::regex_error& e) {
      throw bad("target_modules", fmt::format("a regular expression ({})", e.what()));
    }
  } else if (detail::fits<std::vector<std::string>>(targets) && !targets.empty()) {
    config.target_modules = targets.get<std::vector<std::string>>();
  } else {
    throw bad("target_modules", "module names or a regular expression");
  }
  for (const auto& [field, plain] : plain_lora_fields()) {
    if (!peft.contains(field) || peft[field] == plain) continue;
    // PEFT writes an empty list or {} for some of the null ones.
    if (plain.is_null() && (peft[field].is_array() || peft[field].is_object()) &&
        peft[field].empty()) {
      continue;
    }
    throw bad(field, fmt::format("{} (ShardRL's LoRA implements only that)", plain.dump()));
  }
  return config;
}

LoraConfig read_peft_config(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw std::invalid_argument(fmt::format("{}: cannot open", path));
  nlohmann::json peft;
  try {
    peft = nlohmann::json::parse(file);
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(fmt::format("{}: {}", path, e.what()));
  }
  if (peft.is_object() && peft.contains("peft_type") && peft["peft_type"] != "LORA") {
    throw std::invalid_argument(fmt::format("{}: field peft_type is {} (only LORA is supported)",
                                            path, peft["peft_type"].dump()));
  }
  return config_from_peft(peft, path);
}

}  // namespace shardrl::models::lora
