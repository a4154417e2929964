// The data layer: the real Fashion-MNIST IDX files, the distributed sampler, PNG files, captioned
// sample grids.
#include <gtest/gtest.h>
#include <zlib.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "shardrl/data.h"
#include "test_util.h"

namespace shardrl::testing {
namespace {

TEST(Data, ReadsTheRealFashionMnistIdxFiles) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_fashion_mnist());
  auto images = data::read_idx(kFashionMnistDir + "/t10k-images-idx3-ubyte.gz");
  auto labels = data::read_idx(kFashionMnistDir + "/t10k-labels-idx1-ubyte.gz");
  EXPECT_EQ(images.sizes(), (std::vector<int64_t>{10000, 28, 28}));
  EXPECT_EQ(images.scalar_type(), torch::kUInt8);
  EXPECT_EQ(labels.sizes(), (std::vector<int64_t>{10000}));
  // Fashion-MNIST's t10k labels start 9 2 1 1 6 and hold 1000 of each class.
  EXPECT_EQ(labels.narrow(0, 0, 5).to(torch::kLong).equal(torch::tensor({9, 2, 1, 1, 6})), true);
  EXPECT_TRUE(
      torch::bincount(labels.to(torch::kLong)).equal(torch::full({10}, 1000, torch::kLong)));
  EXPECT_GT(images.max().item<int>(), 250);

  data::ImageDatasetOptions options;
  options.image_size = 14;
  options.limit = 100;
  auto ds = data::load_image_dataset(kFashionMnistDir + "/t10k-images-idx3-ubyte.gz",
                                     kFashionMnistDir + "/t10k-labels-idx1-ubyte.gz", options);
  EXPECT_EQ(ds.images.sizes(), (std::vector<int64_t>{100, 1, 14, 14}));
  EXPECT_GE(ds.images.min().item<float>(), -1.0f);
  EXPECT_LE(ds.images.max().item<float>(), 1.0f);
  // Area downsampling keeps the mean brightness.
  auto full = data::normalize_images(images.narrow(0, 0, 100));
  EXPECT_NEAR(full.mean().item<double>(), ds.images.mean().item<double>(), 1e-5);
  EXPECT_EQ(ds.labels.scalar_type(), torch::kLong);
}

TEST(Data, IdxErrorsNameTheFile) {
  const auto dir = make_temp_dir("idx");
  const std::string bad = dir + "/bad.idx";
  std::ofstream(bad) << "not an idx file at all";
  for (const std::string& path : {bad, dir + "/missing-images-idx3-ubyte.gz"}) {
    try {
      data::read_idx(path);
      ADD_FAILURE() << "no error for " << path;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
  // A header promising more pixels than the (gzipped) body holds.
  const std::string truncated = dir + "/truncated.gz";
  gzFile f = gzopen(truncated.c_str(), "wb");
  const unsigned char header[] = {0, 0, 8, 3, 0, 0, 0, 2, 0, 0, 0, 28, 0, 0, 0, 28, 1, 2, 3};
  gzwrite(f, header, sizeof(header));
  gzclose(f);
  try {
    data::read_idx(truncated);
    ADD_FAILURE() << "no error for a truncated file";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(truncated), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("truncated"), std::string::npos) << e.what();
  }
}

TEST(Data, SamplerShardsAreDisjointCoverTheBatchAndChangePerEpoch) {
  const int64_t n = 103, batch = 12, world = 3;
  std::vector<data::DistributedSampler> ranks;
  for (int64_t r = 0; r < world; ++r) ranks.emplace_back(n, batch, r, world, 7);
  EXPECT_EQ(ranks[0].batches_per_epoch(), 8);
  std::set<int64_t> epoch0;
  for (int64_t step = 0; step < 8; ++step) {
    std::set<int64_t> seen;
    for (auto& s : ranks) {
      auto idx = s.indices(step);
      ASSERT_EQ(idx.numel(), 4);
      for (int64_t i = 0; i < idx.numel(); ++i) {
        EXPECT_TRUE(seen.insert(idx[i].item<int64_t>()).second) << "repeated in step " << step;
      }
    }
    std::set<int64_t> global;
    auto g = ranks[1].global_indices(step);
    for (int64_t i = 0; i < g.numel(); ++i) global.insert(g[i].item<int64_t>());
    EXPECT_EQ(seen, global);
    for (int64_t i : seen) EXPECT_TRUE(epoch0.insert(i).second) << "sample reused in an epoch";
  }
  EXPECT_EQ(epoch0.size(), 96u);
  EXPECT_FALSE(ranks[0].indices(8).equal(ranks[0].indices(0)));  // epoch 1 reshuffles
  data::DistributedSampler again(n, batch, 0, world, 7);
  EXPECT_TRUE(again.indices(9).equal(ranks[0].indices(9)));  // seeded
  expect_invalid_argument_naming([] { data::DistributedSampler(100, 10, 0, 3, 0); }, "global_batch",
                                 "10");
}

TEST(Data, PngRoundTripsGreyAndRgb) {
  SHARDRL_REQUIRE_DEPENDENCY(missing_python_modules({"PIL"}));
  const auto dir = make_temp_dir("png");
  auto images = torch::rand({5, 1, 6, 4}) * 2 - 1;
  auto grid = data::image_grid(images, 3, 1, 2);
  EXPECT_EQ(grid.sizes(), (std::vector<int64_t>{2 * 13 + 1, 3 * 9 + 1, 1}));
  // Image 4 sits in row 1, column 1, each pixel doubled.
  const auto expected = ((images[4][0][2][1] + 1) * 127.5).round().item<int>();
  EXPECT_EQ(grid[1 + 13 + 4][1 + 9 + 2][0].item<int>(), expected);
  data::write_png(dir + "/grid.png", grid);
  EXPECT_TRUE(data::read_png(dir + "/grid.png").equal(grid));

  data::LinePlotOptions plot_options;
  plot_options.title = "reward";
  auto plot = data::line_plot({{0.1, 0.3, 0.2, 0.9}, {0.5, 0.5, 0.4, 0.6}}, plot_options);
  EXPECT_EQ(plot.sizes(), (std::vector<int64_t>{320, 480, 3}));
  data::write_png(dir + "/plot.png", plot);
  EXPECT_TRUE(data::read_png(dir + "/plot.png").equal(plot));
  // Both curves' colours are drawn.
  auto is = [&](int r, int g, int b) {
    return (plot.select(2, 0) == r)
        .logical_and(plot.select(2, 1) == g)
        .logical_and(plot.select(2, 2) == b)
        .any()
        .item<bool>();
  };
  EXPECT_TRUE(is(31, 119, 180));
  EXPECT_TRUE(is(255, 127, 14));
  // Pillow, an independent decoder (ours writes and reads through libpng), decodes both files to
  // exactly the pixels written: its raw bytes, row-major, are compared with the tensor's.
  for (const auto& [file, image] : {std::pair<std::string, torch::Tensor>{"grid", grid},
                                    std::pair<std::string, torch::Tensor>{"plot", plot}}) {
    const std::string path = dir + "/" + file + ".png";
    const auto decoded = run_process({SHARDRL_PYTHON, "-c",
                                      "import sys; from PIL import Image\n"
                                      "im = Image.open(sys.argv[1]); im.load()\n"
                                      "open(sys.argv[2], 'wb').write(im.tobytes())\n"
                                      "print(im.format, im.mode, im.size[0], im.size[1])\n",
                                      path, path + ".raw"});
    ASSERT_EQ(decoded.exit_code, 0) << decoded.output;
    const bool rgb = image.size(2) == 3;
    EXPECT_EQ(decoded.output, std::string("PNG ") + (rgb ? "RGB " : "L ") +
                                  std::to_string(image.size(1)) + " " +
                                  std::to_string(image.size(0)) + "\n");
    std::ifstream in(path + ".raw", std::ios::binary);
    const std::string raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    ASSERT_EQ(static_cast<int64_t>(raw.size()), image.numel()) << file;
    const auto pixels =
        torch::from_blob(const_cast<char*>(raw.data()), image.sizes(), torch::kUInt8);
    EXPECT_TRUE(pixels.equal(image.to(torch::kUInt8))) << file;
  }
  EXPECT_THROW(data::write_png(dir + "/no/such/dir/x.png", grid), std::runtime_error);
}

// Expects the 5x7 glyph `rows` ('#' lit) at (x, y) of image, each font pixel scale x scale: 255
// in every channel where lit, 0 elsewhere in the cell.
void expect_glyph(const torch::Tensor& image, int64_t x, int64_t y, int64_t scale,
                  const std::vector<std::string>& rows, const std::string& what) {
  ASSERT_EQ(rows.size(), 7u);
  const auto cell = image.narrow(0, y, 7 * scale).narrow(1, x, 5 * scale);
  auto expected = torch::zeros({7, 5}, torch::kUInt8);
  for (int r = 0; r < 7; ++r) {
    for (int c = 0; c < 5; ++c) expected[r][c] = rows[r][c] == '#' ? 255 : 0;
  }
  expected = expected.repeat_interleave(scale, 0).repeat_interleave(scale, 1);
  for (int64_t ch = 0; ch < image.size(2); ++ch) {
    EXPECT_TRUE(cell.select(2, ch).equal(expected))
        << what << " at (" << x << ", " << y << "), channel " << ch << ":\n"
        << cell.select(2, ch) << "\nexpected\n"
        << expected;
  }
}

const std::vector<std::string> kI = {".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."};
const std::vector<std::string> kApostrophe = {".##..", "..#..", ".#...", ".....",
                                              ".....", ".....", "....."};
const std::vector<std::string> kT = {"#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."};
const std::vector<std::string> kA = {".###.", "#...#", "#...#", "#...#", "#####", "#...#", "#...#"};
const std::vector<std::string> kBox = {"#####", "#...#", "#...#", "#...#",
                                       "#...#", "#...#", "#####"};

TEST(Data, CaptionedGridWritesEachRowsCaptionAboveItAndLeavesTheImages) {
  const auto dir = make_temp_dir("captioned_grid");
  auto images = torch::rand({5, 3, 8, 16}) * 2 - 1;
  // nrow 3, padding 1, scale 2: rows 8 * 2 + 1 = 17 pixels apart, 3 * 33 + 1 = 100 wide, so a
  // caption line holds (100 - 1) / 12 = 8 characters. "it's a top" wraps to "it's a" / "top";
  // every band is 1 + 2 lines * 16 = 33 pixels.
  const std::vector<std::string> captions = {"it's a top", "ab \xC3\xA9~"};
  auto grid = data::captioned_grid(images, 3, captions, 1, 2);
  ASSERT_EQ(grid.sizes(), (std::vector<int64_t>{2 * (33 + 17) + 1, 100, 3}));
  data::write_png(dir + "/grid.png", grid);
  const auto read_back = data::read_png(dir + "/grid.png");
  EXPECT_EQ(read_back.sizes(), grid.sizes());
  EXPECT_TRUE(read_back.equal(grid));

  // Row 0's band: line 0 from (1, 1), characters 12 pixels apart; line 1 16 pixels lower.
  expect_glyph(grid, 1, 1, 2, kI, "'i' of row 0");
  expect_glyph(grid, 1 + 2 * 12, 1, 2, kApostrophe, "apostrophe of row 0");
  expect_glyph(grid, 1, 1 + 16, 2, kT, "'t' of row 0, line 1");
  // Row 1's band starts at 33 + 17 = 50. Lower case is drawn in capitals; the two-byte UTF-8 'é'
  // and '~', which the font lacks, are one box each.
  expect_glyph(grid, 1, 51, 2, kA, "'a' of row 1");
  expect_glyph(grid, 1 + 3 * 12, 51, 2, kBox, "'\xC3\xA9' of row 1");
  expect_glyph(grid, 1 + 4 * 12, 51, 2, kBox, "'~' of row 1");
  // Nothing is drawn past the text: row 1's band holds only its five characters' cells.
  EXPECT_EQ(grid.narrow(0, 50, 33).narrow(1, 1 + 5 * 12, 100 - 61).max().item<int>(), 0);
  EXPECT_EQ(grid.narrow(0, 51 + 16, 16).max().item<int>(), 0);

  // The images' rows are image_grid's, moved down by the bands, pixel for pixel.
  const auto plain = data::image_grid(images, 3, 1, 2);
  for (int64_t r = 0; r < 2; ++r) {
    EXPECT_TRUE(grid.narrow(0, r * 50 + 33, 17).equal(plain.narrow(0, r * 17, 17))) << "row " << r;
  }
  EXPECT_EQ(grid.narrow(0, 100, 1).max().item<int>(), 0);

  // Grey images give a grey grid, drawn the same way.
  auto grey = data::captioned_grid(images.narrow(1, 0, 1), 3, {"it", "a"}, 1, 2);
  ASSERT_EQ(grey.sizes(), (std::vector<int64_t>{2 * (17 + 17) + 1, 100, 1}));
  expect_glyph(grey, 1, 1, 2, kI, "'i' of the grey grid");
  expect_glyph(grey, 1, 34 + 1, 2, kA, "'a' of the grey grid");

  // A word longer than a line is split; a grid narrower than one glyph clips it.
  EXPECT_EQ(data::captioned_grid(images, 3, {std::string(20, 'x'), ""}, 1, 2).size(0),
            2 * (1 + 3 * 16 + 17) + 1);
  EXPECT_EQ(data::captioned_grid(torch::zeros({1, 1, 1, 1}), 1, {"wide"}, 0, 1).sizes(),
            (std::vector<int64_t>{4 * 8 + 1, 1, 1}));
}

TEST(Data, CaptionedGridErrorsNameTheCounts) {
  auto images = torch::zeros({5, 1, 4, 4});
  try {
    data::captioned_grid(images, 3, {"a", "b", "c"});
    ADD_FAILURE() << "three captions for two rows were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("3 row captions for 2 rows"), std::string::npos)
        << e.what();
  }
  try {
    data::captioned_grid(torch::zeros({2, 2, 4, 4}), 2, {"a"});
    ADD_FAILURE() << "two-channel images were accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("got 2"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace shardrl::testing
