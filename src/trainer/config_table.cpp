// The config table: what values a key takes (Values), a task's rows, and what is made of them.
#include "config_table.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <regex>
#include <stdexcept>

namespace shardrl::trainer {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A bound as the reference writes it: integers without a fraction, other numbers as short as
// they read back.
std::string bound_text(double bound) {
  if (bound == std::floor(bound) && std::abs(bound) < 1e15) {
    return fmt::format("{}", static_cast<int64_t>(bound));
  }
  return json(bound).dump();
}

std::string join(const std::vector<std::string>& items, const std::string& separator) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : separator) + item;
  return out;
}

// The source of the value at `key`: its own, or that of the nearest key above it a source set.
std::string origin_of(const ConfigOrigins& origins, std::string key) {
  while (true) {
    const auto it = origins.find(key);
    if (it != origins.end()) return it->second;
    const size_t dot = key.rfind('.');
    if (dot == std::string::npos) return "";
    key.resize(dot);
  }
}

const json* find_value(const json& config, const std::string& key) {
  const json* node = &config;
  for (const auto& part : split_key(key)) {
    if (!node->is_object() || !node->contains(part)) return nullptr;
    node = &(*node)[part];
  }
  return node;
}

void set_value(json& config, const std::string& key, const json& value) {
  json* node = &config;
  for (const auto& part : split_key(key)) node = &(*node)[part];
  *node = value;
}

}  // namespace

std::vector<std::string> split_key(const std::string& key) {
  std::vector<std::string> parts;
  size_t begin = 0;
  while (true) {
    const size_t dot = key.find('.', begin);
    parts.push_back(key.substr(begin, dot - begin));
    if (dot == std::string::npos) return parts;
    begin = dot + 1;
  }
}

Values& Values::at_least(double bound) {
  min_ = bound;
  min_open_ = false;
  return *this;
}
Values& Values::above(double bound) {
  min_ = bound;
  min_open_ = true;
  return *this;
}
Values& Values::at_most(double bound) {
  max_ = bound;
  max_open_ = false;
  return *this;
}
Values& Values::below(double bound) {
  max_ = bound;
  max_open_ = true;
  return *this;
}
Values& Values::one_of(std::vector<std::string> choices, std::vector<std::string> aliases) {
  choices_ = std::move(choices);
  aliases_ = std::move(aliases);
  return *this;
}
Values& Values::matching(std::string regex, std::string meaning) {
  regex_ = std::move(regex);
  regex_meaning_ = std::move(meaning);
  return *this;
}
Values& Values::of(const Values& item) {
  item_ = std::make_shared<const Values>(item);
  return *this;
}
Values& Values::size(size_t items) {
  size_ = items;
  return *this;
}
Values& Values::existing_path() {
  path_ = Path::kAny;
  return *this;
}
Values& Values::existing_folder(std::string holding) {
  path_ = Path::kFolder;
  holding_ = std::move(holding);
  return *this;
}
Values& Values::required() {
  required_ = true;
  return *this;
}
Values& Values::or_null(std::string meaning) {
  nullable_ = true;
  null_meaning_ = std::move(meaning);
  return *this;
}

Values boolean() {
  return Values(Values::Type::kBoolean);
}
Values integer() {
  return Values(Values::Type::kInteger);
}
Values number() {
  return Values(Values::Type::kNumber);
}
Values text() {
  return Values(Values::Type::kText);
}
Values list() {
  return Values(Values::Type::kList);
}
Values mapping() {
  return Values(Values::Type::kMapping);
}

std::string Values::describe() const {
  std::string out;
  switch (type_) {
    case Type::kBoolean:
      out = "true or false";
      break;
    case Type::kInteger:
    case Type::kNumber: {
      out = type_ == Type::kInteger ? "an integer" : "a number";
      if (min_ && max_) {
        out += fmt::format(" in {}{}, {}{}", min_open_ ? "(" : "[", bound_text(*min_),
                           bound_text(*max_), max_open_ ? ")" : "]");
      } else if (min_) {
        out += fmt::format(" {} {}", min_open_ ? ">" : ">=", bound_text(*min_));
      } else if (max_) {
        out += fmt::format(" {} {}", max_open_ ? "<" : "<=", bound_text(*max_));
      }
      break;
    }
    case Type::kText:
      if (!choices_.empty()) {
        const auto written = [](const std::vector<std::string>& names) {
          std::vector<std::string> out;
          for (const auto& name : names) out.push_back(yaml_value(name));
          return join(out, ", ");
        };
        out = "one of " + written(choices_);
        if (!aliases_.empty()) out += " (also " + written(aliases_) + ")";
      } else if (!regex_.empty()) {
        out = "a string of " + regex_meaning_;
      } else if (path_ == Path::kAny) {
        out = "the path of an existing file or folder";
      } else if (path_ == Path::kFolder) {
        out = "the path of a folder" + (holding_.empty() ? "" : " holding " + holding_);
      } else {
        out = "a string";
      }
      if (path_ != Path::kNone && !required_) out += ", or empty";
      break;
    case Type::kList:
      out = size_ ? fmt::format("a list of {}", *size_) : std::string("a list");
      if (item_) out += ", each " + item_->describe();
      break;
    case Type::kMapping:
      out = "a mapping (free-form)";
      break;
  }
  if (nullable_) out += ", or null" + (null_meaning_.empty() ? "" : " (" + null_meaning_ + ")");
  return out;
}

void Values::check(const json& value, const std::string& key, bool check_files) const {
  bool ok = value.is_null() ? nullable_ : false;
  if (!value.is_null()) {
    switch (type_) {
      case Type::kBoolean:
        ok = value.is_boolean();
        break;
      case Type::kInteger:
      case Type::kNumber: {
        ok = type_ == Type::kInteger ? value.is_number_integer() : value.is_number();
        const double x = ok ? value.get<double>() : 0.0;
        ok = ok && std::isfinite(x) && (!min_ || (min_open_ ? x > *min_ : x >= *min_)) &&
             (!max_ || (max_open_ ? x < *max_ : x <= *max_));
        break;
      }
      case Type::kText: {
        ok = value.is_string();
        if (!ok) break;
        const auto& s = value.get_ref<const std::string&>();
        if (!choices_.empty()) {
          ok = std::count(choices_.begin(), choices_.end(), s) > 0 ||
               std::count(aliases_.begin(), aliases_.end(), s) > 0;
        }
        if (!regex_.empty()) ok = ok && std::regex_match(s, std::regex(regex_));
        break;
      }
      case Type::kList:
        ok = value.is_array() && (!size_ || value.size() == *size_);
        for (size_t i = 0; ok && item_ && i < value.size(); ++i) {
          try {
            item_->check(value[i], key, /*check_files=*/false);
          } catch (const std::invalid_argument&) {
            ok = false;  // the error names the whole list
          }
        }
        break;
      case Type::kMapping:
        ok = value.is_object();
        break;
    }
  }
  if (!ok) {
    throw std::invalid_argument(
        fmt::format("config key '{}' must be {}, got {}", key, describe(), value.dump()));
  }
  if (!check_files || path_ == Path::kNone || !value.is_string()) return;
  const auto& path = value.get_ref<const std::string&>();
  if (path.empty()) {
    if (!required_) return;
    throw std::invalid_argument(fmt::format(
        "config key '{}' is empty: it must name {}", key,
        path_ == Path::kFolder ? "a folder" + (holding_.empty() ? "" : " holding " + holding_)
                               : std::string("an existing file or folder")));
  }
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    throw std::invalid_argument(fmt::format("config key '{}': '{}' does not exist", key, path));
  }
  if (path_ == Path::kFolder && !fs::is_directory(path, ec)) {
    throw std::invalid_argument(fmt::format("config key '{}': '{}' is not a folder", key, path));
  }
  if (!holding_.empty() && !fs::exists(fs::path(path) / holding_, ec)) {
    throw std::invalid_argument(
        fmt::format("config key '{}': '{}' holds no {}", key, path, holding_));
  }
}

std::string yaml_value(const json& value) {
  if (value.is_array()) {
    std::vector<std::string> items;
    for (const auto& item : value) items.push_back(yaml_value(item));
    return "[" + join(items, ", ") + "]";
  }
  if (value.is_object()) {
    std::vector<std::string> items;
    for (const auto& [key, item] : value.items()) {
      items.push_back(yaml_value(json(key)) + ": " + yaml_value(item));
    }
    return "{" + join(items, ", ") + "}";
  }
  if (value.is_string()) {
    // Plain when it reads back as this very string (not a number, a boolean or null, and nothing
    // YAML gives a meaning to); otherwise double-quoted, which JSON's escapes are valid in.
    static const std::regex plain("[A-Za-z_/][A-Za-z0-9_./-]*");
    const auto& s = value.get_ref<const std::string&>();
    if (std::regex_match(s, plain) && yaml_to_json(s, "a string") == value) return s;
  }
  return value.dump();
}

ConfigTable::ConfigTable(std::vector<ConfigKey> rows) : rows_(std::move(rows)) {
  order();
}

ConfigTable::ConfigTable(const std::string& task_name, const Task& task) : rows_(shared_keys()) {
  const auto mistake = [&](const std::string& key, const std::string& what) {
    return std::logic_error(fmt::format("task {}: config key '{}' {}", task_name, key, what));
  };
  for (const auto& row : task.keys) {
    auto it = std::find_if(rows_.begin(), rows_.end(),
                           [&](const ConfigKey& shared) { return shared.key == row.key; });
    if (it != rows_.end()) {
      *it = row;
    } else {
      rows_.push_back(row);
    }
  }
  for (const auto& entry : task.defaults) {
    auto it = std::find_if(rows_.begin(), rows_.end(),
                           [&](const ConfigKey& row) { return row.key == entry.first; });
    if (it == rows_.end()) throw mistake(entry.first, "has a default but no row");
    it->default_value = entry.second;
  }
  // A task's config names it.
  for (auto& row : rows_) {
    if (row.key == "trainer.task") row.default_value = task_name;
  }
  for (const auto& row : rows_) {
    try {
      row.values.check(row.default_value, row.key, /*check_files=*/false);
    } catch (const std::invalid_argument& e) {
      throw mistake(row.key, fmt::format("refuses its own default: {}", e.what()));
    }
    for (const auto& other : rows_) {
      if (other.key.rfind(row.key + ".", 0) == 0) {
        throw mistake(other.key, "lies below the key '" + row.key + "', which has a value");
      }
    }
  }
  order();
}

void ConfigTable::order() {
  // trainer.* first: it names the task. actor_rollout_ref, the longest, last.
  const auto section_rank = [](const ConfigKey& row) {
    const auto top = split_key(row.key).front();
    return top == "trainer" ? 0 : top == "actor_rollout_ref" ? 2 : 1;
  };
  std::stable_sort(rows_.begin(), rows_.end(), [&](const ConfigKey& a, const ConfigKey& b) {
    return section_rank(a) < section_rank(b);
  });
  // Then each section where it first appears, its keys together: the rows sort by the
  // first-appearance numbers of their key's prefixes.
  std::map<std::string, size_t> first_seen;
  std::vector<std::pair<std::vector<size_t>, size_t>> sort_keys;
  for (size_t i = 0; i < rows_.size(); ++i) {
    std::vector<size_t> path;
    std::string prefix;
    for (const auto& part : split_key(rows_[i].key)) {
      prefix += (prefix.empty() ? "" : ".") + part;
      path.push_back(first_seen.emplace(prefix, first_seen.size()).first->second);
    }
    sort_keys.emplace_back(std::move(path), i);
  }
  std::sort(sort_keys.begin(), sort_keys.end());
  std::vector<ConfigKey> ordered;
  for (const auto& [path, index] : sort_keys) ordered.push_back(std::move(rows_[index]));
  rows_ = std::move(ordered);
}

const ConfigKey* ConfigTable::find(const std::string& key) const {
  for (const auto& row : rows_) {
    if (row.key == key) return &row;
  }
  return nullptr;
}

json ConfigTable::defaults() const {
  json out = json::object();
  for (const auto& row : rows_) set_value(out, row.key, row.default_value);
  return out;
}

std::set<std::string> ConfigTable::free_form() const {
  std::set<std::string> keys;
  for (const auto& row : rows_) {
    if (row.values.type() == Values::Type::kMapping) keys.insert(row.key);
  }
  return keys;
}

void ConfigTable::check(const json& config, const ConfigOrigins& origins, bool check_files) const {
  std::vector<std::string> errors;
  for (const auto& row : rows_) {
    const json* value = find_value(config, row.key);
    try {
      if (!value) throw std::invalid_argument(fmt::format("config key '{}' is missing", row.key));
      row.values.check(*value, row.key, check_files);
    } catch (const std::invalid_argument& e) {
      const std::string source = origin_of(origins, row.key);
      std::string error = (source.empty() ? "" : source + ": ") + e.what();
      // A path's error says what the key is for: which folder to give.
      if (row.values.names_path()) error += " (" + row.description + ")";
      errors.push_back(error);
    }
  }
  if (errors.size() == 1) throw std::invalid_argument(errors.front());
  if (errors.size() > 1) {
    throw std::invalid_argument(
        fmt::format("{} config keys are wrong:\n  {}", errors.size(), join(errors, "\n  ")));
  }
}

}  // namespace shardrl::trainer
