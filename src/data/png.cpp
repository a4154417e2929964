// PNG files through libpng and the image grid that the demos write.
#include <fmt/format.h>
#include <png.h>

#include <cerrno>
#include <csetjmp>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

#include "shardrl/data.h"

namespace shardrl::data {
namespace {

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

// libpng reports errors by longjmp; the handler records the message first so that it can be
// rethrown as an exception naming the file.
void on_png_error(png_structp png, png_const_charp message) {
  auto* text = static_cast<std::string*>(png_get_error_ptr(png));
  if (text) *text = message;
  png_longjmp(png, 1);
}

// Runs libpng calls under its error handler. The lambda must only hold raw pointers and PODs:
// longjmp skips destructors, so no C++ object may live between setjmp and the failing call.
template <class Calls>
bool png_guarded(png_structp png, Calls&& calls) {
  if (setjmp(png_jmpbuf(png))) return false;
  calls();
  return true;
}

}  // namespace

torch::Tensor image_grid(const torch::Tensor& images, int64_t nrow, int64_t padding,
                         int64_t scale) {
  TORCH_CHECK(images.dim() == 4, "image_grid: images must be [N, C, H, W], got ", images.sizes());
  TORCH_CHECK(nrow >= 1 && padding >= 0 && scale >= 1,
              "image_grid: nrow and scale must be >= 1 and padding >= 0");
  const int64_t n = images.size(0), c = images.size(1);
  const int64_t h = images.size(2) * scale, w = images.size(3) * scale;
  const int64_t cols = std::min(nrow, std::max<int64_t>(n, 1));
  const int64_t rows = (n + cols - 1) / cols;
  auto pixels = ((images.detach().to(torch::kCPU, torch::kFloat).clamp(-1, 1) + 1) * 127.5)
                    .round()
                    .to(torch::kUInt8);
  if (scale > 1) pixels = pixels.repeat_interleave(scale, 2).repeat_interleave(scale, 3);
  auto grid = torch::zeros({rows * (h + padding) + padding, cols * (w + padding) + padding, c},
                           torch::kUInt8);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t top = padding + (i / cols) * (h + padding);
    const int64_t left = padding + (i % cols) * (w + padding);
    grid.narrow(0, top, h).narrow(1, left, w).copy_(pixels[i].permute({1, 2, 0}));
  }
  return grid;
}

namespace {

// libpng's write callback: appends to the std::string behind the io pointer.
void append_png_bytes(png_structp png, png_bytep data, png_size_t length) {
  static_cast<std::string*>(png_get_io_ptr(png))
      ->append(reinterpret_cast<const char*>(data), length);
}
void no_flush(png_structp) {}

// `what` names the image in errors (the file it is for).
std::string encode_png_for(const torch::Tensor& image, const std::string& what) {
  TORCH_CHECK(image.scalar_type() == torch::kUInt8, what, ": image must be uint8, got ",
              image.scalar_type());
  auto img = image.dim() == 2 ? image.unsqueeze(2) : image;
  TORCH_CHECK(img.dim() == 3 && (img.size(2) == 1 || img.size(2) == 3), what,
              ": image must be [H, W], [H, W, 1] or [H, W, 3], got ", image.sizes());
  img = img.to(torch::kCPU).contiguous();
  const auto height = static_cast<png_uint_32>(img.size(0));
  const auto width = static_cast<png_uint_32>(img.size(1));
  const int64_t channels = img.size(2);

  std::string error, bytes;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, &error, on_png_error, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!info) {
    png_destroy_write_struct(&png, nullptr);
    throw std::runtime_error(fmt::format("{}: out of memory", what));
  }
  std::string* out = &bytes;
  const uint8_t* base = img.data_ptr<uint8_t>();
  const int color = channels == 1 ? PNG_COLOR_TYPE_GRAY : PNG_COLOR_TYPE_RGB;
  const bool ok = png_guarded(png, [png, info, out, base, width, height, channels, color] {
    png_set_write_fn(png, out, append_png_bytes, no_flush);
    png_set_IHDR(png, info, width, height, 8, color, PNG_INTERLACE_NONE,
                 PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
    png_write_info(png, info);
    for (png_uint_32 y = 0; y < height; ++y) png_write_row(png, base + y * width * channels);
    png_write_end(png, nullptr);
  });
  png_destroy_write_struct(&png, &info);
  if (!ok) throw std::runtime_error(fmt::format("{}: {}", what, error));
  return bytes;
}

}  // namespace

std::string encode_png(const torch::Tensor& image) {
  return encode_png_for(image, "encode_png");
}

void write_png(const std::string& path, const torch::Tensor& image) {
  const std::string bytes = encode_png_for(image, fmt::format("write_png({})", path));
  File file(std::fopen(path.c_str(), "wb"));
  if (!file) throw std::runtime_error(fmt::format("write_png: cannot open '{}' for writing", path));
  if (std::fwrite(bytes.data(), 1, bytes.size(), file.get()) != bytes.size() ||
      std::fflush(file.get()) != 0) {
    throw std::runtime_error(
        fmt::format("write_png: cannot write '{}': {}", path, std::strerror(errno)));
  }
}

torch::Tensor read_png(const std::string& path) {
  File file(std::fopen(path.c_str(), "rb"));
  if (!file) throw std::runtime_error(fmt::format("read_png: cannot open '{}'", path));
  std::string error;
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &error, on_png_error, nullptr);
  png_infop info = png ? png_create_info_struct(png) : nullptr;
  if (!info) {
    png_destroy_read_struct(&png, nullptr, nullptr);
    throw std::runtime_error(fmt::format("read_png({}): out of memory", path));
  }
  FILE* fp = file.get();
  png_uint_32 w = 0, h = 0;
  int depth = 0, color = 0;
  bool ok = png_guarded(png, [png, info, fp, &w, &h, &depth, &color] {
    png_init_io(png, fp);
    png_read_info(png, info);
    w = png_get_image_width(png, info);
    h = png_get_image_height(png, info);
    depth = png_get_bit_depth(png, info);
    color = png_get_color_type(png, info);
  });
  if (ok && (depth != 8 || (color != PNG_COLOR_TYPE_GRAY && color != PNG_COLOR_TYPE_RGB))) {
    png_destroy_read_struct(&png, &info, nullptr);
    throw std::runtime_error(
        fmt::format("read_png({}): only 8-bit grey or RGB images are supported", path));
  }
  const int64_t c = color == PNG_COLOR_TYPE_GRAY ? 1 : 3;
  auto out = torch::empty({ok ? int64_t{h} : 0, int64_t{w}, c}, torch::kUInt8);
  uint8_t* base = out.data_ptr<uint8_t>();
  ok = ok && png_guarded(png, [png, base, w, h, c] {
         for (png_uint_32 y = 0; y < h; ++y) png_read_row(png, base + y * w * c, nullptr);
         png_read_end(png, nullptr);
       });
  png_destroy_read_struct(&png, &info, nullptr);
  if (!ok) throw std::runtime_error(fmt::format("read_png({}): {}", path, error));
  return out;
}

}  // namespace shardrl::data
