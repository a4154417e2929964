// Unicode character classes of GPT-2's pre-tokenisation regex (\p{L}, \p{N}, \s), as sorted code
// point ranges generated from the reference implementation's regex engine.
#pragma once

#include <algorithm>
#include <iterator>

namespace shardrl::text::unicode {

struct CodePointRange {
  char32_t first, last;  // inclusive
};

template <size_t N>
bool in_ranges(const CodePointRange (&ranges)[N], char32_t c) {
  auto it = std::upper_bound(std::begin(ranges), std::end(ranges), c,
                             [](char32_t v, const CodePointRange& r) { return v < r.first; });
  return it != std::begin(ranges) && c <= std::prev(it)->last;
}

bool is_letter(char32_t c);  // \p{L}
bool is_number(char32_t c);  // \p{N}
bool is_space(char32_t c);   // JavaScript's \s (White_Space plus U+FEFF)

}  // namespace shardrl::text::unicode
