// Hugging Face-style weights: one safetensors file, or a directory of them with or without the
// sharded index, named as transformers or diffusers name them.
#include <fmt/format.h>

#include <filesystem>
#include <fstream>

#include "shardrl/checkpoint.h"

namespace shardrl::checkpoint {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// transformers' file stem, then diffusers' (save_pretrained of a diffusers model).
constexpr const char* kStems[] = {"model", "diffusion_pytorch_model"};

// The first of the stems for which `dir`/<stem><suffix> exists, or "" when none does.
fs::path find_stem(const std::string& dir, const std::string& suffix) {
  for (const char* stem : kStems) {
    const fs::path candidate = fs::path(dir) / (std::string(stem) + suffix);
    if (fs::exists(candidate)) return candidate;
  }
  return {};
}

}  // namespace

HfWeights::HfWeights(const std::string& path) : path_(path) {
  const fs::path index_path =
      fs::is_directory(path) ? find_stem(path, ".safetensors.index.json") : fs::path();
  if (!index_path.empty()) {
    dir_ = path;
    try {
      const json index = json::parse(std::ifstream(index_path));
      for (const auto& [name, file] : index.at("weight_map").items()) {
        const auto file_name = file.get<std::string>();
        // A plain name: no directory part, not "." or ".." (the folder itself or its parent),
        // no NUL (the file opened would be another, the name cut at it).
        if (file_name.empty() || fs::path(file_name).has_parent_path() || file_name == "." ||
            file_name == ".." || file_name.find('\0') != std::string::npos) {
          throw std::runtime_error(fmt::format(
              "weight_map.{}: '{}' is not a file name in the directory", name, file_name));
        }
        file_of_[name] = file_name;
      }
    } catch (const std::exception& e) {
      throw std::runtime_error(fmt::format("{} is damaged: {}", index_path.string(), e.what()));
    }
    return;
  }
  // One file: the directory's model.safetensors (or diffusers'), or the file `path` names.
  const fs::path file = fs::is_directory(path) ? find_stem(path, ".safetensors") : fs::path(path);
  if (file.empty() || !fs::is_regular_file(file)) {
    throw std::runtime_error(fmt::format(
        "{}: no model.safetensors(.index.json) or diffusion_pytorch_model.safetensors(.index.json) "
        "there",
        path));
  }
  dir_ = file.parent_path().string();
  const std::string single = file.filename().string();
  auto reader = std::make_unique<SafetensorsReader>(file.string());
  for (const auto& name : reader->names()) file_of_[name] = single;
  open_.emplace(single, std::move(reader));
}

HfWeights::~HfWeights() = default;

std::vector<std::string> HfWeights::names() const {
  std::vector<std::string> out;
  for (const auto& [name, unused] : file_of_) out.push_back(name);
  return out;
}

const SafetensorsReader& HfWeights::reader(const std::string& name) {
  auto it = file_of_.find(name);
  if (it == file_of_.end()) {
    throw std::runtime_error(fmt::format("{}: no tensor '{}'", path_, name));
  }
  auto& reader = open_[it->second];
  if (!reader) reader = std::make_unique<SafetensorsReader>((fs::path(dir_) / it->second).string());
  if (!reader->contains(name)) {
    throw std::runtime_error(
        fmt::format("{}: its index maps '{}' to this file, which lacks it", reader->path(), name));
  }
  return *reader;
}

}  // namespace shardrl::checkpoint
