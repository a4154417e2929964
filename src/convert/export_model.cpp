#include "shardrl/convert/export_model.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "shardrl/models/lora.h"
#include "shardrl/models/qwen_image.h"
#include "shardrl/models/sd3.h"

namespace shardrl::convert {

std::vector<std::string> export_model(const std::string& ckpt_dir, const std::string& out_dir,
                                      const std::string& merge_adapter,
                                      checkpoint::ExportOptions options) {
  const nlohmann::json index = checkpoint::read_index(ckpt_dir);
  const nlohmann::json extra = index.value("extra", nlohmann::json::object());
  const std::string family =
      extra.is_object() && extra.contains("family") && extra["family"].is_string()
          ? extra["family"].get<std::string>()
          : "";
  if (family == "sd3") {
    // Checked before anything is written: an export without a valid config loads nowhere.
    models::SD3Config config;
    try {
      config = models::SD3Config::from_json(extra.value("config", nlohmann::json()));
    } catch (const std::exception& e) {
      throw std::invalid_argument(fmt::format(
          "export: checkpoint {} (family sd3): extra.config is no SD3Transformer2DModel "
          "config.json: {}",
          ckpt_dir, e.what()));
    }
    models::add_sd3_export(config, options);
  } else if (family == "qwen_image") {
    try {
      models::QwenImageConfig::from_json(extra.value("config", nlohmann::json()));
    } catch (const std::exception& e) {
      throw std::invalid_argument(
          fmt::format("export: checkpoint {} (family qwen_image): extra.config is no "
                      "QwenImageTransformer2DModel config.json: {}",
                      ckpt_dir, e.what()));
    }
    models::add_qwen_image_export(options);
  }
  return models::lora::export_base(ckpt_dir, out_dir, merge_adapter, std::move(options));
}

}  // namespace shardrl::convert
