// A LoRA adapter's config as PEFT writes it (adapter_config.json) and PEFT's rule for the modules
// it targets. Apart from the layers in lora.cpp: reading the file builds no model, so the parsers'
// fuzz build (fuzz/) reads it without LibTorch's modules.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <regex>

#include "shardrl/models/lora.h"

namespace shardrl::models::lora {

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
  return !config.target_regex.empty() && std::regex_match(name, std::regex(config.target_regex));
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
  LoraConfig config;
  try {
    config.r = peft.at("r").get<int64_t>();
    config.alpha = peft.at("lora_alpha").get<double>();
    config.dropout = peft.value("lora_dropout", 0.0);
    const auto& targets = peft.at("target_modules");
    if (targets.is_string()) {
      config.target_regex = targets.get<std::string>();
    } else {
      config.target_modules = targets.get<std::vector<std::string>>();
    }
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(fmt::format("{}: not a PEFT LoRA config: {}", where, e.what()));
  }
  if (config.r <= 0) throw std::invalid_argument(fmt::format("{}: r must be > 0", where));
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
  if (peft.value("peft_type", "LORA") != "LORA") {
    throw std::invalid_argument(fmt::format("{}: peft_type is '{}' (only LORA is supported)", path,
                                            peft["peft_type"].dump()));
  }
  return config_from_peft(peft, path);
}

}  // namespace shardrl::models::lora
