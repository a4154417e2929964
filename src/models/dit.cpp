#include "shardrl/models/dit.h"

#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "models/json_fields.h"
#include "shardrl/models/activation_checkpoint.h"

namespace shardrl::models {
namespace {

namespace nn = torch::nn;

// Registers an empty module `name` on `parent`, so children get DiT's dotted names.
std::shared_ptr<nn::Module> holder(nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<nn::Module>());
}

nn::LayerNorm plain_norm(int64_t dim) {
  return nn::LayerNorm(nn::LayerNormOptions({dim}).elementwise_affine(false).eps(1e-6));
}

// adaLN: SiLU then a zero-initialised linear, so every block starts as the identity (adaLN-Zero).
nn::Sequential zero_modulation(int64_t dim, int64_t chunks) {
  Linear linear(dim, chunks * dim);
  zero_unless_empty(linear->weight);
  zero_unless_empty(linear->bias);
  return nn::Sequential(nn::SiLU(), linear);
}

torch::Tensor modulate(const torch::Tensor& x, const torch::Tensor& shift,
                       const torch::Tensor& scale) {
  return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

}  // namespace

void DiTConfig::validate() const {
  detail::require_positive(input_size, "input_size");
  detail::require_positive(patch_size, "patch_size");
  detail::require_positive(in_channels, "in_channels");
  detail::require_positive(hidden_size, "hidden_size");
  detail::require_positive(depth, "depth");
  detail::require_positive(num_heads, "num_heads");
  detail::require_positive(num_classes, "num_classes");
  detail::require_positive(frequency_embedding_size, "frequency_embedding_size");
  if (input_size % patch_size != 0) {
    throw std::invalid_argument(
        fmt::format("config: patch_size {} must divide input_size {}", patch_size, input_size));
  }
  if (hidden_size % num_heads != 0) {
    throw std::invalid_argument(
        fmt::format("config: num_heads {} must divide hidden_size {}", num_heads, hidden_size));
  }
  if (hidden_size % 4 != 0) {
    throw std::invalid_argument(fmt::format(
        "config: hidden_size {} must be a multiple of 4 (2-D sin-cos embedding)", hidden_size));
  }
  if (frequency_embedding_size % 2 != 0) {
    throw std::invalid_argument("config: frequency_embedding_size must be even");
  }
  if (!(mlp_ratio > 0)) throw std::invalid_argument("config: mlp_ratio must be positive");
}

nlohmann::json DiTConfig::to_json() const {
  return {{"model_type", "dit"},
          {"input_size", input_size},
          {"patch_size", patch_size},
          {"in_channels", in_channels},
          {"hidden_size", hidden_size},
          {"depth", depth},
          {"num_heads", num_heads},
          {"mlp_ratio", mlp_ratio},
          {"num_classes", num_classes},
          {"frequency_embedding_size", frequency_embedding_size},
          {"timestep_scale", timestep_scale}};
}

DiTConfig DiTConfig::from_json(const nlohmann::json& j) {
  DiTConfig c;
  detail::read_field(j, "input_size", c.input_size, true);
  detail::read_field(j, "patch_size", c.patch_size, true);
  detail::read_field(j, "in_channels", c.in_channels, true);
  detail::read_field(j, "hidden_size", c.hidden_size, true);
  detail::read_field(j, "depth", c.depth, true);
  detail::read_field(j, "num_heads", c.num_heads, true);
  detail::read_field(j, "mlp_ratio", c.mlp_ratio, false);
  detail::read_field(j, "num_classes", c.num_classes, true);
  detail::read_field(j, "frequency_embedding_size", c.frequency_embedding_size, false);
  detail::read_field(j, "timestep_scale", c.timestep_scale, false);
  c.validate();
  return c;
}

torch::Tensor timestep_embedding(const torch::Tensor& t, int64_t dim, double max_period) {
  const int64_t half = dim / 2;
  auto f32 = torch::dtype(torch::kFloat).device(t.device());
  auto freqs = torch::exp(-std::log(max_period) * torch::arange(half, f32) / half);
  auto args = t.to(torch::kFloat).unsqueeze(1) * freqs.unsqueeze(0);
  return torch::cat({torch::cos(args), torch::sin(args)}, -1);
}

torch::Tensor sincos_pos_embed_2d(int64_t dim, int64_t grid) {
  auto f64 = torch::dtype(torch::kDouble);
  auto omega = 1.0 / torch::pow(10000.0, torch::arange(dim / 4, f64) / (dim / 4.0));
  auto one_axis = [&](const torch::Tensor& pos) {
    auto out = torch::outer(pos, omega);
    return torch::cat({torch::sin(out), torch::cos(out)}, 1);
  };
  auto coords = torch::arange(grid, f64);
  // Token k = row * grid + col; DiT's meshgrid puts the column (width) coordinate first.
  auto col = coords.repeat({grid}), row = coords.repeat_interleave(grid);
  return torch::cat({one_axis(col), one_axis(row)}, 1).to(torch::kFloat);
}

DiTBlockImpl::DiTBlockImpl(const DiTConfig& c) : heads_(c.num_heads) {
  const int64_t d = c.hidden_size;
  norm1 = register_module("norm1", plain_norm(d));
  auto attn = holder(*this, "attn");
  qkv = attn->register_module("qkv", lora::LoraLinear(d, 3 * d));
  proj = attn->register_module("proj", lora::LoraLinear(d, d));
  norm2 = register_module("norm2", plain_norm(d));
  auto mlp = holder(*this, "mlp");
  fc1 = mlp->register_module("fc1", lora::LoraLinear(d, c.mlp_hidden()));
  fc2 = mlp->register_module("fc2", lora::LoraLinear(c.mlp_hidden(), d));
  adaLN_modulation = register_module("adaLN_modulation", zero_modulation(d, 6));
}

torch::Tensor DiTBlockImpl::forward(torch::Tensor x, torch::Tensor c) {
  if (!checkpoint_activations) return compute(x, c);
  return checkpointed(
      [this](const std::vector<torch::Tensor>& in) { return compute(in[0], in[1]); }, {x, c});
}

torch::Tensor DiTBlockImpl::compute(const torch::Tensor& x_in, const torch::Tensor& c) {
  torch::Tensor x = x_in;
  auto mod = adaLN_modulation->forward(c).chunk(6, 1);
  const int64_t N = x.size(0), T = x.size(1), D = x.size(2), hd = D / heads_;
  auto h = modulate(norm1(x), mod[0], mod[1]);
  auto parts = qkv(h).view({N, T, 3, heads_, hd}).permute({2, 0, 3, 1, 4});
  auto q = parts[0], k = parts[1], v = parts[2];
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
  auto probs = torch::softmax(scores.to(torch::kFloat), -1).to(q.scalar_type());
  auto attended = torch::matmul(probs, v).transpose(1, 2).reshape({N, T, D});
  x = x + mod[2].unsqueeze(1) * proj(attended);
  h = modulate(norm2(x), mod[3], mod[4]);
  return x + mod[5].unsqueeze(1) * fc2(torch::gelu(fc1(h), "tanh"));
}

DiTImpl::DiTImpl(const DiTConfig& c) : config_(c) {
  c.validate();
  const int64_t d = c.hidden_size;
  x_proj_ = holder(*this, "x_embedder")
                ->register_module("proj", Conv2d(c.in_channels, d, c.patch_size, c.patch_size));
  t_mlp_ = holder(*this, "t_embedder")
               ->register_module("mlp", nn::Sequential(Linear(c.frequency_embedding_size, d),
                                                       nn::SiLU(), Linear(d, d)));
  y_table_ = holder(*this, "y_embedder")
                 ->register_module("embedding_table", Embedding(c.num_classes + 1, d));
  auto list = register_module("blocks", nn::ModuleList());
  for (int64_t i = 0; i < c.depth; ++i) {
    blocks.emplace_back(c);
    list->push_back(blocks.back().ptr());
  }
  auto final_layer = holder(*this, "final_layer");
  final_norm_ = final_layer->register_module("norm_final", plain_norm(d));
  final_linear_ = final_layer->register_module(
      "linear", Linear(d, c.patch_size * c.patch_size * c.in_channels));
  final_modulation_ = final_layer->register_module("adaLN_modulation", zero_modulation(d, 2));
  // The zero head of adaLN-Zero: the initial velocity is 0.
  zero_unless_empty(final_linear_->weight);
  zero_unless_empty(final_linear_->bias);
  pos_embed_ = sincos_pos_embed_2d(d, c.grid_size()).unsqueeze(0);
}

torch::Tensor DiTImpl::patchify(const torch::Tensor& x) {
  auto tokens = x_proj_(x).flatten(2).transpose(1, 2);
  return tokens + pos_embed_.to(tokens.device(), tokens.scalar_type());
}

torch::Tensor DiTImpl::unpatchify(const torch::Tensor& x) {
  const int64_t p = config_.patch_size, g = config_.grid_size(), C = config_.in_channels;
  return x.reshape({x.size(0), g, g, p, p, C})
      .permute({0, 5, 1, 3, 2, 4})  // n h w p q c -> n c h p w q
      .reshape({x.size(0), C, g * p, g * p});
}

torch::Tensor DiTImpl::forward(torch::Tensor x, torch::Tensor t, torch::Tensor y) {
  TORCH_CHECK(x.dim() == 4 && x.size(1) == config_.in_channels && x.size(2) == config_.input_size &&
                  x.size(3) == config_.input_size,
              "DiT: x must be [N, ", config_.in_channels, ", ", config_.input_size, ", ",
              config_.input_size, "], got ", x.sizes());
  TORCH_CHECK(y.min().item<int64_t>() >= 0 && y.max().item<int64_t>() <= config_.num_classes,
              "DiT: labels must be in [0, ", config_.num_classes, "] (", config_.num_classes,
              " is the null class)");
  auto tokens = patchify(x);
  auto temb = timestep_embedding(t * config_.timestep_scale, config_.frequency_embedding_size)
                  .to(tokens.scalar_type());
  auto c = t_mlp_->forward(temb) + y_table_(y);
  for (auto& block : blocks) tokens = block(tokens, c);
  auto mod = final_modulation_->forward(c).chunk(2, 1);
  return unpatchify(final_linear_(modulate(final_norm_(tokens), mod[0], mod[1])));
}

void DiTImpl::set_activation_checkpointing(bool enabled) {
  for (auto& block : blocks) block->checkpoint_activations = enabled;
}

void shard_dit(DiT& model, const dist::DeviceMesh& mesh, const WrapPolicy& policy) {
  shard_by_block(model, model->blocks, mesh, policy);
}

torch::Tensor drop_labels(const torch::Tensor& y, int64_t null_class, double p,
                          at::Generator generator) {
  auto drop = torch::rand(y.sizes(), generator, torch::dtype(torch::kFloat).device(y.device())) < p;
  return torch::where(drop, torch::full_like(y, null_class), y);
}

std::pair<torch::Tensor, torch::Tensor> cfg_branches(DiT& model, const torch::Tensor& x,
                                                     const torch::Tensor& t,
                                                     const torch::Tensor& y) {
  auto null = torch::full_like(y, model->config().num_classes);
  auto both = model(torch::cat({x, x}), torch::cat({t, t}), torch::cat({y, null}));
  auto halves = both.chunk(2, 0);
  return {halves[0], halves[1]};
}

torch::Tensor guided_velocity(DiT& model, const torch::Tensor& x, const torch::Tensor& t,
                              const torch::Tensor& y, double scale) {
  auto [cond, uncond] = cfg_branches(model, x, t, y);
  return uncond + scale * (cond - uncond);
}

void save_dit(const std::map<std::string, torch::Tensor>& params, const DiTConfig& config,
              const std::string& dir, torch::ScalarType dtype) {
  std::filesystem::create_directories(dir);
  save_weights(params, dir + "/model.safetensors", dtype);
  std::ofstream out(dir + "/config.json");
  if (!out) throw std::runtime_error("cannot write " + dir + "/config.json");
  out << config.to_json().dump(2) << "\n";
}

}  // namespace shardrl::models
