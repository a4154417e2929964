#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <stdexcept>

#include "config_table.h"
#include "shardrl/trainer.h"

namespace shardrl::trainer {
namespace {

using nlohmann::json;

// YAML text is Unicode; a string of other bytes would pass here and fail later, wherever the
// config is printed (nlohmann::json refuses to dump it).
void check_utf8(const std::string& text, const YAML::Node& node, const std::string& source) {
  try {
    json(text).dump();
  } catch (const json::type_error&) {
    throw std::invalid_argument(
        fmt::format("{}: not valid YAML: line {}: not UTF-8 text", source, node.Mark().line + 1));
  }
}

json scalar_to_json(const YAML::Node& node, const std::string& source) {
  const std::string& text = node.Scalar();
  check_utf8(text, node, source);
  // Quoted scalars stay strings; plain ones get YAML 1.2 core types.
  if (node.Tag() == "!") return text;
  if (text == "null" || text == "~" || text.empty()) return nullptr;
  if (text == "true" || text == "True") return true;
  if (text == "false" || text == "False") return false;
  try {
    size_t used = 0;
    const long long i = std::stoll(text, &used);
    if (used == text.size()) return i;
  } catch (const std::exception&) {
  }
  try {
    size_t used = 0;
    const double d = std::stod(text, &used);
    // "nan" and "inf" are strings in YAML 1.2's core schema (it spells them .nan and .inf), and
    // JSON has no way to write them: the config could not be printed or written back.
    if (used == text.size() && std::isfinite(d)) return d;
  } catch (const std::exception&) {
  }
  return text;
}

// Aliases make a YAML document a graph: expanded, a few lines can stand for billions of nodes, and
// an anchor used inside its own node for a cycle. The expansion is bounded in depth and in size
// (a config expands to about as many nodes as it has lines).
struct Expansion {
  const std::string& source;
  size_t nodes_left;
  static constexpr int kMaxDepth = 64;
};

json node_to_json(const YAML::Node& node, Expansion& budget, int depth) {
  if (depth > Expansion::kMaxDepth) {
    throw std::invalid_argument(
        fmt::format("{}: not valid YAML: line {}: nested deeper than {} levels (an alias inside "
                    "its own anchor?)",
                    budget.source, node.Mark().line + 1, Expansion::kMaxDepth));
  }
  if (budget.nodes_left == 0) {
    throw std::invalid_argument(
        fmt::format("{}: not valid YAML: its aliases expand to too many nodes", budget.source));
  }
  --budget.nodes_left;
  switch (node.Type()) {
    case YAML::NodeType::Null:
    case YAML::NodeType::Undefined:
      return nullptr;
    case YAML::NodeType::Scalar:
      return scalar_to_json(node, budget.source);
    case YAML::NodeType::Sequence: {
      json out = json::array();
      for (const auto& item : node) out.push_back(node_to_json(item, budget, depth + 1));
      return out;
    }
    case YAML::NodeType::Map: {
      json out = json::object();
      for (const auto& item : node) {
        const auto key = item.first.as<std::string>();
        check_utf8(key, item.first, budget.source);
        out[key] = node_to_json(item.second, budget, depth + 1);
      }
      return out;
    }
  }
  return nullptr;
}

const char* kind(const json& value) {
  if (value.is_null()) return "null";
  if (value.is_boolean()) return "a boolean";
  if (value.is_number()) return "a number";
  if (value.is_string()) return "a string";
  if (value.is_array()) return "a list";
  return "a mapping";
}

bool same_kind(const json& a, const json& b) {
  if (a.is_number() && b.is_number()) {
    // An integer default accepts only integers; a float default accepts both.
    return !(a.is_number_integer() && !b.is_number_integer());
  }
  return a.type() == b.type();
}

// Keys renamed to verl's or verl-omni's names: ShardRL's own older spellings and verl-omni's older
// flow_grpo ones (train.*, sample.*). One table for every task. It is checked against what the
// user wrote, file and overrides each before they meet the defaults, so the error names where the
// old key came from, also when no default section has it (train.*, or a task's defaults that
// still spell it the old way).
struct RenamedKey {
  const char* old_key;
  const char* new_key;
  const char* note;  // what else to know, or ""
};

constexpr const char* kWithKlLoss = "with actor_rollout_ref.actor.use_kl_loss: true";

constexpr RenamedKey kRenamedKeys[] = {
    {"trainer.resume", "trainer.resume_mode",
     "auto, disable or resume_path with trainer.resume_from_path"},
    {"trainer.max_ckpt_to_keep", "trainer.max_actor_ckpt_to_keep", ""},
    {"algorithm.clip_ratio", "actor_rollout_ref.actor.clip_ratio", ""},
    {"algorithm.clip_ratio_low", "actor_rollout_ref.actor.clip_ratio_low", ""},
    {"algorithm.clip_ratio_high", "actor_rollout_ref.actor.clip_ratio_high", ""},
    {"algorithm.clip_ratio_c", "actor_rollout_ref.actor.clip_ratio_c", ""},
    {"algorithm.loss_agg_mode", "actor_rollout_ref.actor.loss_agg_mode", ""},
    {"algorithm.kl_loss_coef", "actor_rollout_ref.actor.kl_loss_coef", kWithKlLoss},
    {"algorithm.kl_loss_type", "actor_rollout_ref.actor.kl_loss_type", ""},
    {"algorithm.kl_beta", "actor_rollout_ref.actor.kl_loss_coef", kWithKlLoss},
    {"algorithm.clip_range", "actor_rollout_ref.actor.diffusion_loss.clip_ratio", ""},
    {"algorithm.nft_beta", "actor_rollout_ref.actor.diffusion_loss.mix_beta", ""},
    {"algorithm.dpo_beta", "actor_rollout_ref.actor.diffusion_loss.dpo_beta", ""},
    {"algorithm.name", "actor_rollout_ref.model.model_type",
     "flow_grpo: diffusion_model, nft: diffusion_nft_model, dpo: diffusion_dpo_model"},
    {"actor_rollout_ref.rollout.num_steps",
     "actor_rollout_ref.rollout.pipeline.num_inference_steps", ""},
    {"actor_rollout_ref.rollout.noise_level", "actor_rollout_ref.rollout.algo.noise_level", ""},
    {"actor_rollout_ref.rollout.guidance_scale",
     "actor_rollout_ref.rollout.pipeline.true_cfg_scale", ""},
    {"actor_rollout_ref.rollout.shift", "actor_rollout_ref.rollout.pipeline.shift", ""},
    {"actor_rollout_ref.rollout.val_kwargs.num_inference_steps",
     "actor_rollout_ref.rollout.val_kwargs.pipeline.num_inference_steps", ""},
    {"actor_rollout_ref.rollout.val_kwargs.noise_level",
     "actor_rollout_ref.rollout.val_kwargs.algo.noise_level", ""},
    {"actor_rollout_ref.rollout.groups_per_gpu", "data.train_batch_size",
     "prompts per step, all ranks together"},
    {"actor_rollout_ref.actor.ppo_mini_batches", "actor_rollout_ref.actor.ppo_mini_batch_size",
     "prompts per optimizer step, not a count of steps"},
    {"actor_rollout_ref.model.enable_activation_checkpointing",
     "actor_rollout_ref.model.enable_gradient_checkpointing", ""},
    {"train.clip_range", "actor_rollout_ref.actor.diffusion_loss.clip_ratio", ""},
    {"train.beta", "actor_rollout_ref.actor.kl_loss_coef", kWithKlLoss},
    {"sample.num_steps", "actor_rollout_ref.rollout.pipeline.num_inference_steps", ""},
    {"sample.guidance_scale", "actor_rollout_ref.rollout.pipeline.true_cfg_scale", ""},
};

void reject_renamed_keys(const json& config, const std::string& prefix, const std::string& source) {
  for (const auto& [key, value] : config.items()) {
    const std::string name = prefix.empty() ? key : prefix + "." + key;
    for (const auto& renamed : kRenamedKeys) {
      if (name != renamed.old_key) continue;
      const std::string note = *renamed.note ? fmt::format(" ({})", renamed.note) : "";
      throw std::invalid_argument(fmt::format("{}: config key '{}' was renamed: use '{}'{}", source,
                                              name, renamed.new_key, note));
    }
    if (value.is_object()) reject_renamed_keys(value, name, source);
  }
}

// Lists that a single string also sets, as a list of that one item: verl's Tracking reads
// `logger: console` as [console], and configs in the wild still say so.
constexpr const char* kListsTakingOneString[] = {"trainer.logger"};

bool takes_one_string(const std::string& key) {
  for (const char* k : kListsTakingOneString) {
    if (key == k) return true;
  }
  return false;
}

// What a merge needs beyond the two documents: the keys below which any key may be added (a
// model's config.json), and where to record the source of each value it sets.
struct MergeContext {
  const std::string& source;
  const std::set<std::string>* free_form = nullptr;
  ConfigOrigins* origins = nullptr;

  bool is_free_form(const std::string& key) const { return free_form && free_form->count(key); }
  void record(const std::string& key) const {
    if (origins) (*origins)[key] = source;
  }
};

// A free-form mapping: keys merge, new ones included, and values replace whatever was there.
void merge_free_form(json& base, const json& over) {
  for (const auto& [key, value] : over.items()) {
    if (base.contains(key) && base[key].is_object() && value.is_object()) {
      merge_free_form(base[key], value);
    } else {
      base[key] = value;
    }
  }
}

void merge_into(json& base, const json& over, const std::string& prefix, const MergeContext& ctx) {
  for (const auto& [key, value] : over.items()) {
    const std::string name = prefix.empty() ? key : prefix + "." + key;
    if (!base.contains(key)) {
      throw std::invalid_argument(fmt::format("{}: unknown config key '{}'", ctx.source, name));
    }
    json& target = base[key];
    if (target.is_object() && value.is_null()) {
      // A section left empty (`trainer:` with its keys commented out) keeps its defaults rather
      // than erasing them, after which every key of it would read as missing.
      continue;
    }
    if (ctx.is_free_form(name)) {
      // Any keys, any values: the table's check of the key sees the result.
      if (target.is_object() && value.is_object()) {
        merge_free_form(target, value);
      } else {
        target = value;
      }
      ctx.record(name);
    } else if (target.is_null()) {
      target = value;
      ctx.record(name);
    } else if (value.is_null()) {
      // `lr:` left empty: every read of the key would fail later, in an error naming no file.
      throw std::invalid_argument(
          fmt::format("{}: config key '{}' must be {}, got null", ctx.source, name, kind(target)));
    } else if (target.is_object() && value.is_object()) {
      merge_into(target, value, name, ctx);
    } else if (target.is_array() && value.is_string() && takes_one_string(name)) {
      target = json::array({value});
      ctx.record(name);
    } else if (!same_kind(target, value)) {
      throw std::invalid_argument(fmt::format("{}: config key '{}' must be {}, got {}", ctx.source,
                                              name, kind(target), value.dump()));
    } else {
      target = value;
      ctx.record(name);
    }
  }
}

json merge_document(const json& defaults, const json& config, const MergeContext& ctx) {
  json merged = defaults;
  if (config.is_null()) return merged;
  if (!config.is_object()) {
    throw std::invalid_argument(fmt::format("{}: the config must be a mapping", ctx.source));
  }
  reject_renamed_keys(config, "", ctx.source);
  merge_into(merged, config, "", ctx);
  return merged;
}

json load_document(const std::string& path, const std::vector<std::string>& overrides,
                   const json& defaults, const std::set<std::string>* free_form,
                   ConfigOrigins* origins) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(fmt::format("config file '{}' cannot be read", path));
  std::stringstream text;
  text << in.rdbuf();
  json config =
      merge_document(defaults, yaml_to_json(text.str(), path), {path, free_form, origins});
  for (const auto& item : overrides) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0) {
      throw std::invalid_argument(fmt::format("override '{}': expected dotted.key=value", item));
    }
    const std::string key = item.substr(0, eq);
    json nested = yaml_to_json(item.substr(eq + 1), "override " + key);
    // a.b.c=v becomes {a: {b: {c: v}}} and is merged like a file.
    std::vector<std::string> parts;
    std::stringstream split(key);
    for (std::string part; std::getline(split, part, '.');) parts.push_back(part);
    for (auto it = parts.rbegin(); it != parts.rend(); ++it) {
      if (it->empty()) throw std::invalid_argument(fmt::format("override '{}': empty key", item));
      nested = json{{*it, nested}};
    }
    config = merge_document(config, nested, {"override '" + item + "'", free_form, origins});
  }
  return config;
}

}  // namespace

json yaml_to_json(const std::string& yaml_text, const std::string& source) {
  try {
    Expansion budget{source, 16 * yaml_text.size() + 4096};
    return node_to_json(YAML::Load(yaml_text), budget, 0);
  } catch (const YAML::Exception& e) {
    throw std::invalid_argument(fmt::format("{}: not valid YAML: {}", source, e.what()));
  }
}

json merge_config(const json& defaults, const json& config, const std::string& source) {
  return merge_document(defaults, config, {source});
}

json load_config(const std::string& path, const std::vector<std::string>& overrides,
                 const json& defaults) {
  return load_document(path, overrides, defaults, nullptr, nullptr);
}

json load_config(const std::string& path, const std::vector<std::string>& overrides,
                 const ConfigTable& table, ConfigOrigins* origins) {
  const auto free_form = table.free_form();
  return load_document(path, overrides, table.defaults(), &free_form, origins);
}

const json& at(const json& config, const std::string& dotted_key) {
  const json* node = &config;
  size_t begin = 0;
  while (true) {
    const size_t dot = dotted_key.find('.', begin);
    const std::string part = dotted_key.substr(begin, dot - begin);
    if (!node->is_object() || !node->contains(part)) {
      throw std::invalid_argument(fmt::format("config key '{}' is missing", dotted_key));
    }
    node = &(*node)[part];
    if (dot == std::string::npos) return *node;
    begin = dot + 1;
  }
}

}  // namespace shardrl::trainer
