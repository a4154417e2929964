// Reading model configs (config.json) with errors that name the field.
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <stdexcept>

namespace shardrl::models::detail {

// Leaves `value` as is when the field is absent and not required.
template <class T>
void read_field(const nlohmann::json& j, const char* field, T& value, bool required) {
  if (!j.contains(field) || j[field].is_null()) {
    if (required) throw std::invalid_argument(fmt::format("config.json: missing field {}", field));
    return;
  }
  try {
    value = j[field].get<T>();
  } catch (const nlohmann::json::exception&) {
    throw std::invalid_argument(
        fmt::format("config.json: field {} has the wrong type ({})", field, j[field].dump()));
  }
}

inline void require_positive(int64_t value, const char* field) {
  if (value <= 0) {
    throw std::invalid_argument(fmt::format("config: {} must be positive, got {}", field, value));
  }
}

}  // namespace shardrl::models::detail
