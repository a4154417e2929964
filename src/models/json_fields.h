// Reading model configs (config.json) with errors that name the file and the field.
#pragma once

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <type_traits>

#include "text/utf8.h"

namespace shardrl::models::detail {

// Whether JSON value v converts to a T without loss. nlohmann's get<int64_t>() converts any
// number: 2.5 becomes 2 and 1e30 is undefined behaviour, so an integer field takes an integer
// (or an integral float such as 16.0) within T's range.
template <class T>
bool fits(const nlohmann::json& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v.is_boolean();
  } else if constexpr (std::is_integral_v<T>) {
    if (v.is_number_unsigned()) {
      return v.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<T>::max());
    }
    if (v.is_number_integer()) {
      const int64_t x = v.get<int64_t>();
      return x >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
             static_cast<uint64_t>(x) <= static_cast<uint64_t>(std::numeric_limits<T>::max());
    }
    if (!v.is_number_float()) return false;
    // T's range as doubles, both exact: min is 0 or minus a power of two, max + 1 a power of two.
    const double x = v.get<double>();
    const double lo = static_cast<double>(std::numeric_limits<T>::min());
    const double end = 2.0 * static_cast<double>(std::numeric_limits<T>::max() / 2 + 1);
    return std::trunc(x) == x && x >= lo && x < end;
  } else if constexpr (std::is_floating_point_v<T>) {
    return v.is_number();
  } else if constexpr (std::is_same_v<T, std::string>) {
    return v.is_string();
  } else {
    if (!v.is_array()) return false;
    return std::all_of(v.begin(), v.end(),
                       [](const nlohmann::json& e) { return fits<typename T::value_type>(e); });
  }
}

// Leaves `value` as is when the field is absent and not required.
template <class T>
void read_field(const nlohmann::json& j, const char* field, T& value, bool required) {
  if (!j.contains(field) || j[field].is_null()) {
    if (required) throw std::invalid_argument(fmt::format("config.json: missing field {}", field));
    return;
  }
  if (!fits<T>(j[field])) {
    throw std::invalid_argument(
        fmt::format("config.json: field {} has the wrong type ({})", field, j[field].dump()));
  }
  value = j[field].get<T>();
}

// A JSON file; a missing file or bad JSON is an error naming it.
inline nlohmann::json read_json_file(const std::string& path) {
  if (!std::filesystem::is_regular_file(path)) {
    throw std::invalid_argument(fmt::format("{} is missing (or not a file)", path));
  }
  try {
    return nlohmann::json::parse(text::detail::read_file("model folder", path));
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(fmt::format("{}: not valid JSON ({})", path, e.what()));
  }
}

// Runs `read` on a config file's JSON; its errors get the file's path in front (in place of the
// field readers' "config.json: " / "config: ").
template <class F>
auto with_path(const std::string& path, F&& read) {
  const auto json = read_json_file(path);
  try {
    return read(json);
  } catch (const std::invalid_argument& e) {
    std::string what = e.what();
    if (what.rfind(path, 0) == 0) throw;
    for (const std::string generic : {"config.json: ", "config: "}) {
      if (what.rfind(generic, 0) == 0) what = what.substr(generic.size());
    }
    throw std::invalid_argument(fmt::format("{}: {}", path, what));
  } catch (const nlohmann::json::exception& e) {
    throw std::invalid_argument(fmt::format("{}: {}", path, e.what()));
  }
}

inline void require_positive(int64_t value, const char* field) {
  if (value <= 0) {
    throw std::invalid_argument(fmt::format("config: {} must be positive, got {}", field, value));
  }
}

}  // namespace shardrl::models::detail
