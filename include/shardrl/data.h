// Training data for the image demos: IDX files (MNIST / Fashion-MNIST, gzipped or raw), a seeded
// distributed sampler that gives every rank the same number of samples, and PNG output (image
// grids, captioned ones, and line plots) drawn without any plotting library.
//
//   auto train = data::load_image_dataset(dir + "/train-images-idx3-ubyte.gz",
//                                         dir + "/train-labels-idx1-ubyte.gz");
//   data::DistributedSampler sampler(train.size(), /*global_batch=*/64, rank, world, seed);
//   auto idx = sampler.indices(step);   // this rank's 32 rows of global batch `step`
//   data::write_png("grid.png", data::image_grid(samples, /*nrow=*/8));
#pragma once

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <vector>

namespace shardrl::data {

// An IDX file (LeCun's MNIST format) as a uint8 tensor of the shape its header gives. Gzipped
// files are read through zlib (any file works, gzipped or not). Errors name the file: a missing
// file, a bad magic number, a non-uint8 element type or a truncated body.
torch::Tensor read_idx(const std::string& path);

struct ImageDatasetOptions {
  int64_t image_size = 0;  // > 0: area-downsample to image_size x image_size; 0 keeps the size
  int64_t limit = 0;       // > 0: keep only the first `limit` samples
};

struct ImageDataset {
  torch::Tensor images;  // [N, 1, H, W] fp32 in [-1, 1]
  torch::Tensor labels;  // [N] int64
  int64_t size() const { return images.size(0); }
};

// Images [N, H, W] and labels [N] from two IDX files; errors name the file whose count or rank is
// wrong.
ImageDataset load_image_dataset(const std::string& images_path, const std::string& labels_path,
                                const ImageDatasetOptions& options = {});

// uint8 pixels [N, C, H, W] or [N, H, W] -> fp32 [N, C, H, W] in [-1, 1], area-downsampled when
// image_size > 0 (it must divide the size).
torch::Tensor normalize_images(const torch::Tensor& pixels, int64_t image_size = 0);

// Every rank sees the same epoch-seeded permutation of [0, dataset_size) and takes its contiguous
// slice of each global batch, so the ranks' shards of a batch are disjoint and together are the
// batch. Each epoch has floor(dataset_size / global_batch) batches (the remainder is dropped, so
// every rank always gets global_batch / world_size samples and the collectives line up).
class DistributedSampler {
 public:
  DistributedSampler(int64_t dataset_size, int64_t global_batch, int64_t rank, int64_t world_size,
                     uint64_t seed);
  int64_t batches_per_epoch() const { return batches_per_epoch_; }
  int64_t local_batch() const { return global_batch_ / world_size_; }
  // This rank's sample indices [local_batch] of global batch `step` (steps run across epochs).
  torch::Tensor indices(int64_t step);
  // The whole global batch `step` [global_batch], the same on every rank.
  torch::Tensor global_indices(int64_t step);

 private:
  int64_t dataset_size_, global_batch_, rank_, world_size_, batches_per_epoch_;
  uint64_t seed_;
  int64_t cached_epoch_ = -1;
  torch::Tensor permutation_;
};

// Images [N, C, H, W] in [-1, 1] (clamped) -> one uint8 picture [H', W', C] with the images in
// rows of `nrow`, `padding` pixels apart, each pixel repeated `scale` times in both directions.
torch::Tensor image_grid(const torch::Tensor& images, int64_t nrow, int64_t padding = 2,
                         int64_t scale = 1);

// image_grid's rows, each below its caption (the row's prompt, "a photo of a sneaker"): the text
// in a 5x7 pixel font, each font pixel `scale` pixels square, white on the black padding, starting
// `padding` pixels in from the left and top of a band above the row, wrapped at spaces to the
// grid's width. Every row's band has the height of the longest caption's lines (8 * scale pixels
// each) plus `padding`. Lower case is drawn in capitals; a character the font lacks (see
// LinePlotOptions::title) is a box. Images [N, C, H, W] with C 1 or 3 -> uint8 [H', W', C] for
// write_png; a caption count other than the number of rows is an error naming both.
torch::Tensor captioned_grid(const torch::Tensor& images, int64_t nrow,
                             const std::vector<std::string>& row_captions, int64_t padding = 2,
                             int64_t scale = 3);

// Writes a uint8 image [H, W] (grey), [H, W, 1] or [H, W, 3] (RGB) as an 8-bit PNG.
void write_png(const std::string& path, const torch::Tensor& image);
// The bytes of that PNG file (TensorBoard's image summaries hold them).
std::string encode_png(const torch::Tensor& image);
// Reads an 8-bit grey or RGB PNG as uint8 [H, W, C].
torch::Tensor read_png(const std::string& path);

struct LinePlotOptions {
  int64_t width = 480;
  int64_t height = 320;
  // Drawn at the top in a 5x7 pixel font: digits, letters (lower case as capitals), space and
  // .,-+/:=()'";!?_&#%* (anything else as a box).
  std::string title;
};
// A line plot of `series` (one curve each, in distinct colours, x = 0, 1, ...) with axes, grid
// lines and the y range and last x labelled, as an RGB uint8 image [height, width, 3].
torch::Tensor line_plot(const std::vector<std::vector<double>>& series,
                        const LinePlotOptions& options = {});

}  // namespace shardrl::data
