// What is written from a config table: the YAML of `shardrl config TASK` and of a run's
// config.yaml, the markdown of docs/config.md, the keys a config changes.
#include <fmt/format.h>

#include <iostream>

#include "config_table.h"
#include "tasks.h"

namespace shardrl::trainer {
namespace {

using nlohmann::json;

// A markdown table cell: one line, its pipes escaped, and (outside a code span) its `<dir>` no
// HTML tag.
std::string cell(const std::string& text, bool code = false) {
  std::string out;
  for (char c : text) {
    if (c == '<' && !code) {
      out += "&lt;";
      continue;
    }
    if (c == '|') out += '\\';
    out += c == '\n' ? ' ' : c;
  }
  return out;
}

std::string markdown_task(const std::string& name, const Task& task) {
  const ConfigTable table(name, task);
  std::string out = fmt::format("## {}\n\n{}\n\n", name, task.description);
  out += "| key | default | values | description |\n|---|---|---|---|\n";
  for (const auto& row : table.rows()) {
    out += fmt::format("| `{}` | `{}` | {} | {} |\n", row.key,
                       cell(yaml_value(row.default_value), /*code=*/true),
                       cell(row.values.describe()), cell(row.description));
  }
  return out;
}

}  // namespace

std::string config_yaml(const ConfigTable& table, const json& config, bool comments) {
  std::string out;
  std::vector<std::string> open;  // the sections the previous row sits in
  for (const auto& row : table.rows()) {
    auto parts = split_key(row.key);
    const std::string leaf = parts.back();
    parts.pop_back();
    size_t same = 0;
    while (same < open.size() && same < parts.size() && open[same] == parts[same]) ++same;
    if (same == 0 && !out.empty()) out += "\n";  // a blank line between top-level sections
    for (size_t i = same; i < parts.size(); ++i) {
      out += std::string(2 * i, ' ') + parts[i] + ":\n";
    }
    open = parts;
    const std::string indent(2 * parts.size(), ' ');
    if (comments)
      out += fmt::format("{}# {} [{}]\n", indent, row.description, row.values.describe());
    out += indent + leaf + ": " + yaml_value(at(config, row.key)) + "\n";
  }
  return out;
}

std::vector<std::string> changed_keys(const ConfigTable& table, const json& config) {
  std::vector<std::string> changed;
  for (const auto& row : table.rows()) {
    const json& value = at(config, row.key);
    if (value != row.default_value) changed.push_back(row.key + "=" + yaml_value(value));
  }
  return changed;
}

int config_main(const std::string& task, bool list, bool markdown) {
  if (list) {
    for (const auto& name : task_names()) {
      std::cout << fmt::format("{}: {}\n", name, find_task(name, "shardrl config").description);
    }
    return 0;
  }
  if (markdown) {
    std::cout << "# Config reference\n\n"
                 "Every key of every task, with its default, the values it takes and what it "
                 "does. Generated from the tables the parser merges over and checks against "
                 "(`make docs`; do not edit by hand): `shardrl config TASK` prints one task's as "
                 "YAML, a config to start from. Names are verl's and verl-omni's where they have "
                 "the key; where a default differs from theirs, the description says why.\n\n"
                 "A `mapping (free-form)` takes any keys: a model's `config` is its config.json. "
                 "`shardrl train` checks every key before any rank starts; the error names the "
                 "key, what it takes and the file or override the value came from.\n";
    for (const auto& name : task_names()) {
      std::cout << "\n" << markdown_task(name, find_task(name, "shardrl config"));
    }
    return 0;
  }
  const ConfigTable table = task_table(task);
  std::cout << fmt::format(
      "# {}: {}\n# Every key with its default (`shardrl config {}`); a config sets the ones it "
      "changes.\n\n",
      task, find_task(task, "shardrl config").description, task);
  std::cout << config_yaml(table, table.defaults(), /*comments=*/true);
  return 0;
}

}  // namespace shardrl::trainer
