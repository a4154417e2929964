// IDX files (MNIST / Fashion-MNIST) through zlib, which reads gzipped and plain files alike.
#include <fmt/format.h>
#include <zlib.h>

#include <array>
#include <memory>
#include <stdexcept>

#include "shardrl/data.h"

namespace shardrl::data {
namespace {

struct GzCloser {
  void operator()(gzFile_s* f) const { gzclose(f); }
};

// Reads exactly n bytes or throws naming the file and what was being read.
void read_exact(gzFile file, void* out, size_t n, const std::string& path, const char* what) {
  auto* dst = static_cast<char*>(out);
  size_t done = 0;
  while (done < n) {
    const unsigned chunk = static_cast<unsigned>(std::min<size_t>(n - done, 1u << 30));
    const int got = gzread(file, dst + done, chunk);
    if (got <= 0) {
      int err = Z_OK;
      const char* msg = gzerror(file, &err);
      throw std::runtime_error(fmt::format(
          "{}: truncated or corrupt while reading the {} ({} of {} bytes){}", path, what, done, n,
          err != Z_OK && err != Z_STREAM_END ? std::string(": ") + msg : ""));
    }
    done += static_cast<size_t>(got);
  }
}

}  // namespace

torch::Tensor read_idx(const std::string& path) {
  std::unique_ptr<gzFile_s, GzCloser> file(gzopen(path.c_str(), "rb"));
  if (!file) throw std::runtime_error(fmt::format("{}: cannot open IDX file", path));
  std::array<unsigned char, 4> magic{};
  read_exact(file.get(), magic.data(), 4, path, "IDX header");
  if (magic[0] != 0 || magic[1] != 0) {
    throw std::runtime_error(fmt::format("{}: not an IDX file (magic {:02x}{:02x}{:02x}{:02x})",
                                         path, magic[0], magic[1], magic[2], magic[3]));
  }
  if (magic[2] != 0x08) {
    throw std::runtime_error(fmt::format(
        "{}: IDX element type 0x{:02x} is not supported (only uint8, 0x08)", path, magic[2]));
  }
  const int ndim = magic[3];
  if (ndim < 1 || ndim > 4) {
    throw std::runtime_error(fmt::format("{}: IDX rank {} is out of range [1, 4]", path, ndim));
  }
  std::vector<int64_t> shape;
  int64_t numel = 1;
  for (int d = 0; d < ndim; ++d) {
    std::array<unsigned char, 4> b{};
    read_exact(file.get(), b.data(), 4, path, "IDX dimensions");
    const int64_t size =
        (int64_t{b[0]} << 24) | (int64_t{b[1]} << 16) | (int64_t{b[2]} << 8) | b[3];
    shape.push_back(size);
    numel *= size;
  }
  auto out = torch::empty(shape, torch::kUInt8);
  read_exact(file.get(), out.data_ptr(), static_cast<size_t>(numel), path, "IDX body");
  return out;
}

torch::Tensor normalize_images(const torch::Tensor& pixels, int64_t image_size) {
  TORCH_CHECK(pixels.dim() == 3 || pixels.dim() == 4,
              "normalize_images: pixels must be [N, H, W] or [N, C, H, W], got ", pixels.sizes());
  auto x = pixels.dim() == 3 ? pixels.unsqueeze(1) : pixels;
  x = x.to(torch::kFloat) / 255.0;
  if (image_size > 0 && image_size != x.size(-1)) {
    TORCH_CHECK(x.size(-1) % image_size == 0 && x.size(-2) % image_size == 0, "image_size ",
                image_size, " must divide the image size ", x.size(-2), "x", x.size(-1));
    x = torch::avg_pool2d(x, {x.size(-2) / image_size, x.size(-1) / image_size});
  }
  return x * 2.0 - 1.0;
}

ImageDataset load_image_dataset(const std::string& images_path, const std::string& labels_path,
                                const ImageDatasetOptions& options) {
  auto pixels = read_idx(images_path);
  auto labels = read_idx(labels_path);
  if (pixels.dim() != 3) {
    throw std::runtime_error(
        fmt::format("{}: expected images [N, H, W], got rank {}", images_path, pixels.dim()));
  }
  if (labels.dim() != 1 || labels.size(0) != pixels.size(0)) {
    throw std::runtime_error(
        fmt::format("{}: expected {} labels (one per image of {}), got shape {}", labels_path,
                    pixels.size(0), images_path, fmt::join(labels.sizes(), "x")));
  }
  if (options.limit > 0 && options.limit < pixels.size(0)) {
    pixels = pixels.narrow(0, 0, options.limit);
    labels = labels.narrow(0, 0, options.limit);
  }
  return {normalize_images(pixels, options.image_size).contiguous(), labels.to(torch::kLong)};
}

}  // namespace shardrl::data
