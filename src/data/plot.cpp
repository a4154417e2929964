// A line plot and captioned sample grids rasterised by hand: the demos need PNG curves and
// labelled samples, and no plotting dependency.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "shardrl/data.h"

namespace shardrl::data {
namespace {

constexpr int kGlyphW = 5, kGlyphH = 7;

// 5x7 glyphs, one byte per row, bit 4 the leftmost pixel.
const std::array<uint8_t, kGlyphH>* glyph(char ch) {
  static const std::pair<char, std::array<uint8_t, kGlyphH>> kFont[] = {
      {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}},
      {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}},
      {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}},
      {'3', {0x1F, 0x02, 0x04, 0x02, 0x01, 0x11, 0x0E}},
      {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}},
      {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}},
      {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}},
      {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
      {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}},
      {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}},
      {'A', {0x0E, 0x11, 0x11, 0x11, 0x1F, 0x11, 0x11}},
      {'B', {0x1E, 0x11, 0x11, 0x1E, 0x11, 0x11, 0x1E}},
      {'C', {0x0E, 0x11, 0x10, 0x10, 0x10, 0x11, 0x0E}},
      {'D', {0x1C, 0x12, 0x11, 0x11, 0x11, 0x12, 0x1C}},
      {'E', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x1F}},
      {'F', {0x1F, 0x10, 0x10, 0x1E, 0x10, 0x10, 0x10}},
      {'G', {0x0E, 0x11, 0x10, 0x17, 0x11, 0x11, 0x0F}},
      {'H', {0x11, 0x11, 0x11, 0x1F, 0x11, 0x11, 0x11}},
      {'I', {0x0E, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}},
      {'J', {0x07, 0x02, 0x02, 0x02, 0x02, 0x12, 0x0C}},
      {'K', {0x11, 0x12, 0x14, 0x18, 0x14, 0x12, 0x11}},
      {'L', {0x10, 0x10, 0x10, 0x10, 0x10, 0x10, 0x1F}},
      {'M', {0x11, 0x1B, 0x15, 0x15, 0x11, 0x11, 0x11}},
      {'N', {0x11, 0x11, 0x19, 0x15, 0x13, 0x11, 0x11}},
      {'O', {0x0E, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}},
      {'P', {0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10, 0x10}},
      {'Q', {0x0E, 0x11, 0x11, 0x11, 0x15, 0x12, 0x0D}},
      {'R', {0x1E, 0x11, 0x11, 0x1E, 0x14, 0x12, 0x11}},
      {'S', {0x0F, 0x10, 0x10, 0x0E, 0x01, 0x01, 0x1E}},
      {'T', {0x1F, 0x04, 0x04, 0x04, 0x04, 0x04, 0x04}},
      {'U', {0x11, 0x11, 0x11, 0x11, 0x11, 0x11, 0x0E}},
      {'V', {0x11, 0x11, 0x11, 0x11, 0x11, 0x0A, 0x04}},
      {'W', {0x11, 0x11, 0x11, 0x15, 0x15, 0x15, 0x0A}},
      {'X', {0x11, 0x11, 0x0A, 0x04, 0x0A, 0x11, 0x11}},
      {'Y', {0x11, 0x11, 0x11, 0x0A, 0x04, 0x04, 0x04}},
      {'Z', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x10, 0x1F}},
      {'.', {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}},
      {',', {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08}},
      {'-', {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00}},
      {'+', {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00}},
      {'/', {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00}},
      {':', {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}},
      {'=', {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00}},
      {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}},
      {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}},
      // What prompts hold besides letters ("a photo of a man's shirt, 50% off!").
      {'\'', {0x0C, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00}},
      {'"', {0x0A, 0x0A, 0x0A, 0x00, 0x00, 0x00, 0x00}},
      {';', {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x04, 0x08}},
      {'!', {0x04, 0x04, 0x04, 0x04, 0x04, 0x00, 0x04}},
      {'?', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04}},
      {'_', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F}},
      {'&', {0x0C, 0x12, 0x14, 0x08, 0x15, 0x12, 0x0D}},
      {'#', {0x0A, 0x0A, 0x1F, 0x0A, 0x1F, 0x0A, 0x0A}},
      {'%', {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}},
      {'*', {0x00, 0x04, 0x15, 0x0E, 0x15, 0x04, 0x00}},
  };
  // A character the font lacks is a box, so a caption shows that something is missing.
  static const std::array<uint8_t, kGlyphH> kBox = {0x1F, 0x11, 0x11, 0x11, 0x11, 0x11, 0x1F};
  if (ch == ' ') return nullptr;
  const char up = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  for (const auto& [c, rows] : kFont) {
    if (c == up) return &rows;
  }
  return &kBox;
}

// The characters of UTF-8 text, one string each: a character outside ASCII is drawn (as a box)
// once, not once per byte.
std::vector<std::string> characters(const std::string& text) {
  std::vector<std::string> out;
  for (char ch : text) {
    const bool continuation = (static_cast<unsigned char>(ch) & 0xC0) == 0x80;
    if (continuation && !out.empty()) {
      out.back() += ch;
    } else {
      out.emplace_back(1, ch);
    }
  }
  return out;
}

// Calls set(x, y) for each lit pixel of `text` drawn from (x, y), each font pixel `scale` pixels
// square; a character advances kGlyphW + 1 font pixels.
template <class Set>
void draw_text(int64_t x, int64_t y, const std::string& text, int64_t scale, Set&& set) {
  for (const auto& ch : characters(text)) {
    if (const auto* rows = glyph(ch[0])) {
      for (int r = 0; r < kGlyphH; ++r) {
        for (int col = 0; col < kGlyphW; ++col) {
          if (!((*rows)[r] & (0x10 >> col))) continue;
          for (int64_t dy = 0; dy < scale; ++dy) {
            for (int64_t dx = 0; dx < scale; ++dx) set(x + col * scale + dx, y + r * scale + dy);
          }
        }
      }
    }
    x += (kGlyphW + 1) * scale;
  }
}

using Rgb = std::array<uint8_t, 3>;

class Canvas {
 public:
  Canvas(int64_t w, int64_t h)
      : w_(w), h_(h), pixels_(torch::full({h, w, 3}, 255, torch::kUInt8)) {}

  void set(int64_t x, int64_t y, const Rgb& c) {
    if (x < 0 || y < 0 || x >= w_ || y >= h_) return;
    auto* p = pixels_.data_ptr<uint8_t>() + (y * w_ + x) * 3;
    p[0] = c[0], p[1] = c[1], p[2] = c[2];
  }
  // Bresenham, `thickness` pixels tall so a curve reads at a glance.
  void line(int64_t x0, int64_t y0, int64_t x1, int64_t y1, const Rgb& c, int thickness = 1) {
    const int64_t dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
    const int64_t sx = x0 < x1 ? 1 : -1, sy = y0 < y1 ? 1 : -1;
    int64_t err = dx + dy;
    while (true) {
      for (int t = 0; t < thickness; ++t) set(x0, y0 + t, c);
      if (x0 == x1 && y0 == y1) break;
      const int64_t e2 = 2 * err;
      if (e2 >= dy) err += dy, x0 += sx;
      if (e2 <= dx) err += dx, y0 += sy;
    }
  }
  void text(int64_t x, int64_t y, const std::string& s, const Rgb& c) {
    draw_text(x, y, s, 1, [&](int64_t px, int64_t py) { set(px, py, c); });
  }
  torch::Tensor pixels() const { return pixels_; }

 private:
  int64_t w_, h_;
  torch::Tensor pixels_;
};

int64_t text_width(const std::string& s) {
  return static_cast<int64_t>(characters(s).size()) * (kGlyphW + 1);
}

// `text` in lines of at most max_chars characters, broken at spaces; a word longer than a line is
// split.
std::vector<std::string> wrap(const std::string& text, size_t max_chars) {
  std::vector<std::string> lines;
  std::vector<std::string> line;  // its characters
  auto flush = [&] {
    if (line.empty()) return;
    std::string joined;
    for (const auto& ch : line) joined += ch;
    lines.push_back(joined);
    line.clear();
  };
  std::vector<std::string> word;
  auto add_word = [&] {
    if (word.empty()) return;
    if (!line.empty() && line.size() + 1 + word.size() > max_chars) flush();
    if (!line.empty()) line.emplace_back(" ");
    for (const auto& ch : word) {
      if (line.size() == max_chars) flush();
      line.push_back(ch);
    }
    word.clear();
  };
  for (const auto& ch : characters(text)) {
    if (ch == " ") {
      add_word();
    } else {
      word.push_back(ch);
    }
  }
  add_word();
  flush();
  return lines;
}

}  // namespace

torch::Tensor line_plot(const std::vector<std::vector<double>>& series,
                        const LinePlotOptions& options) {
  if (options.width < 120 || options.height < 80) {
    throw std::invalid_argument(fmt::format("line_plot: width x height {}x{} is below 120x80",
                                            options.width, options.height));
  }
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  size_t longest = 0;
  for (const auto& s : series) {
    longest = std::max(longest, s.size());
    for (double v : s) {
      if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
    }
  }
  if (!(lo <= hi)) lo = 0, hi = 1;  // nothing finite to draw: empty axes
  if (hi - lo < 1e-12) lo -= 0.5, hi += 0.5;
  const double pad = 0.05 * (hi - lo);
  lo -= pad, hi += pad;

  const Rgb black{0, 0, 0}, grid{225, 225, 225};
  const std::array<Rgb, 4> colours{{{31, 119, 180}, {255, 127, 14}, {44, 160, 44}, {214, 39, 40}}};
  Canvas canvas(options.width, options.height);
  const int64_t left = 60, right = options.width - 12, top = 20, bottom = options.height - 22;
  auto to_x = [&](double i) {
    const double span = longest > 1 ? static_cast<double>(longest - 1) : 1.0;
    return left + static_cast<int64_t>(std::lround(i / span * static_cast<double>(right - left)));
  };
  auto to_y = [&](double v) {
    return bottom - static_cast<int64_t>(std::lround((v - lo) / (hi - lo) * (bottom - top)));
  };

  constexpr int kTicks = 4;
  for (int k = 0; k <= kTicks; ++k) {
    const double v = lo + (hi - lo) * k / kTicks;
    const int64_t y = to_y(v);
    if (k > 0) canvas.line(left + 1, y, right, y, grid);
    const std::string label = fmt::format("{:.3g}", v);
    canvas.text(left - 4 - text_width(label), y - kGlyphH / 2, label, black);
  }
  canvas.line(left, top, left, bottom, black);
  canvas.line(left, bottom, right, bottom, black);
  canvas.text(left - 2, bottom + 6, "0", black);
  const std::string last = fmt::format("{}", longest > 0 ? longest - 1 : 0);
  canvas.text(right - text_width(last) + 2, bottom + 6, last, black);
  canvas.text(left + (right - left - text_width(options.title)) / 2, 6, options.title, black);

  for (size_t s = 0; s < series.size(); ++s) {
    const Rgb& c = colours[s % colours.size()];
    const auto& ys = series[s];
    for (size_t i = 0; i < ys.size(); ++i) {
      if (!std::isfinite(ys[i])) continue;
      if (i + 1 < ys.size() && std::isfinite(ys[i + 1])) {
        canvas.line(to_x(static_cast<double>(i)), to_y(ys[i]), to_x(static_cast<double>(i + 1)),
                    to_y(ys[i + 1]), c, 2);
      } else if (ys.size() == 1 || i == 0 || !std::isfinite(ys[i - 1])) {
        canvas.line(to_x(static_cast<double>(i)) - 1, to_y(ys[i]), to_x(static_cast<double>(i)) + 1,
                    to_y(ys[i]), c, 2);
      }
    }
  }
  return canvas.pixels();
}

torch::Tensor captioned_grid(const torch::Tensor& images, int64_t nrow,
                             const std::vector<std::string>& row_captions, int64_t padding,
                             int64_t scale) {
  const auto grid = image_grid(images, nrow, padding, scale);
  const int64_t channels = grid.size(2), width = grid.size(1);
  if (channels != 1 && channels != 3) {
    throw std::invalid_argument(fmt::format(
        "captioned_grid: images must have 1 (grey) or 3 (RGB) channels, got {}", channels));
  }
  // image_grid's rows are (image height + padding) apart, below one padding.
  const int64_t row_height = images.size(2) * scale + padding;
  const int64_t rows = (grid.size(0) - padding) / row_height;
  if (static_cast<int64_t>(row_captions.size()) != rows) {
    throw std::invalid_argument(
        fmt::format("captioned_grid: {} row captions for {} rows ({} images, nrow {})",
                    row_captions.size(), rows, images.size(0), nrow));
  }
  const int64_t advance = (kGlyphW + 1) * scale, line_height = (kGlyphH + 1) * scale;
  const auto max_chars = static_cast<size_t>(std::max<int64_t>(1, (width - padding) / advance));
  std::vector<std::vector<std::string>> lines;
  size_t most_lines = 0;
  for (const auto& caption : row_captions) {
    lines.push_back(wrap(caption, max_chars));
    most_lines = std::max(most_lines, lines.back().size());
  }
  // Every row gets the same band, so the rows stay evenly spaced.
  const int64_t band = padding + static_cast<int64_t>(most_lines) * line_height;
  auto out = torch::zeros({rows * (band + row_height) + padding, width, channels}, torch::kUInt8);
  auto* pixels = out.data_ptr<uint8_t>();
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t top = r * (band + row_height);
    for (size_t i = 0; i < lines[r].size(); ++i) {
      const int64_t y = top + padding + static_cast<int64_t>(i) * line_height;
      draw_text(padding, y, lines[r][i], scale, [&](int64_t x, int64_t py) {
        if (x >= width) return;  // cannot happen after wrapping, unless one glyph is too wide
        std::fill_n(pixels + (py * width + x) * channels, channels, uint8_t{255});
      });
    }
    out.narrow(0, top + band, row_height).copy_(grid.narrow(0, r * row_height, row_height));
  }
  return out;
}

}  // namespace shardrl::data
