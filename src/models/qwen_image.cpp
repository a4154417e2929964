#include "shardrl/models/qwen_image.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>

#include "models/diffusers_common.h"
#include "models/json_fields.h"
#include "shardrl/checkpoint.h"
#include "shardrl/models/activation_checkpoint.h"
#include "shardrl/models/weights.h"
#include "shardrl/ulysses.h"

namespace shardrl::models {
namespace {

using detail::holder;
using detail::kNormEps;
using detail::kTimestepChannels;
using detail::modulate;
using detail::plain_norm;
constexpr double kTimestepScale = 1000;  // QwenTimestepProjEmbeddings' Timesteps(scale=1000)
constexpr double kRopeTheta = 10000;
// diffusers' QwenEmbedRope tables hold positions -4096 .. 4095 of each axis.
constexpr int64_t kRopePositions = 4096;

// float16 activations are clipped to its range after every block, as diffusers does.
torch::Tensor clip_half(const torch::Tensor& x) {
  return x.scalar_type() == torch::kHalf ? x.clamp(-65504, 65504) : x;
}

}  // namespace

// ---- config ------------------------------------------------------------------------------------

void QwenImageConfig::validate() const {
  detail::require_positive(patch_size, "patch_size");
  detail::require_positive(in_channels, "in_channels");
  detail::require_positive(out_channels, "out_channels");
  detail::require_positive(num_layers, "num_layers");
  detail::require_positive(attention_head_dim, "attention_head_dim");
  detail::require_positive(num_attention_heads, "num_attention_heads");
  detail::require_positive(joint_attention_dim, "joint_attention_dim");
  if (attention_head_dim > std::numeric_limits<int64_t>::max() / num_attention_heads) {
    throw std::invalid_argument(
        fmt::format("config: num_attention_heads {} * attention_head_dim {} overflows int64",
                    num_attention_heads, attention_head_dim));
  }
  if (axes_dims_rope.size() != 3) {
    throw std::invalid_argument(
        fmt::format("config: axes_dims_rope must hold 3 dims (frame, height, width), got {}",
                    nlohmann::json(axes_dims_rope).dump()));
  }
  for (int64_t dim : axes_dims_rope) {
    if (dim <= 0 || dim % 2 != 0) {
      throw std::invalid_argument(fmt::format(
          "config: axes_dims_rope {} must hold positive even dims (rotations act on pairs)",
          nlohmann::json(axes_dims_rope).dump()));
    }
  }
  const int64_t rotary = std::accumulate(axes_dims_rope.begin(), axes_dims_rope.end(), int64_t{0});
  if (rotary != attention_head_dim) {
    throw std::invalid_argument(
        fmt::format("config: axes_dims_rope {} sum to {}, not attention_head_dim {}",
                    nlohmann::json(axes_dims_rope).dump(), rotary, attention_head_dim));
  }
  for (const auto& [flag, name] : {std::pair{zero_cond_t, "zero_cond_t"},
                                   std::pair{use_additional_t_cond, "use_additional_t_cond"},
                                   std::pair{use_layer3d_rope, "use_layer3d_rope"}}) {
    if (flag) {
      throw std::invalid_argument(fmt::format(
          "config: {} true (a Qwen-Image edit or layered variant) is not supported: only the "
          "text-to-image transformer",
          name));
    }
  }
}

nlohmann::json QwenImageConfig::to_json() const {
  return {{"_class_name", kQwenImageClassName},
          {"patch_size", patch_size},
          {"in_channels", in_channels},
          {"out_channels", out_channels},
          {"num_layers", num_layers},
          {"attention_head_dim", attention_head_dim},
          {"num_attention_heads", num_attention_heads},
          {"joint_attention_dim", joint_attention_dim},
          {"guidance_embeds", guidance_embeds},
          {"axes_dims_rope", axes_dims_rope},
          {"zero_cond_t", zero_cond_t},
          {"use_additional_t_cond", use_additional_t_cond},
          {"use_layer3d_rope", use_layer3d_rope}};
}

QwenImageConfig QwenImageConfig::from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw std::invalid_argument("config.json: not a JSON object");
  const auto cls = j.value("_class_name", std::string(kQwenImageClassName));
  if (cls != kQwenImageClassName) {
    throw std::invalid_argument(
        fmt::format("config.json: _class_name is '{}', not {}", cls, kQwenImageClassName));
  }
  // Absent fields take diffusers' defaults, as its from_pretrained does.
  QwenImageConfig c;
  detail::read_field(j, "patch_size", c.patch_size, false);
  detail::read_field(j, "in_channels", c.in_channels, false);
  // null out_channels means in_channels in diffusers.
  if (j.contains("out_channels") && j["out_channels"].is_null()) c.out_channels = c.in_channels;
  detail::read_field(j, "out_channels", c.out_channels, false);
  detail::read_field(j, "num_layers", c.num_layers, false);
  detail::read_field(j, "attention_head_dim", c.attention_head_dim, false);
  detail::read_field(j, "num_attention_heads", c.num_attention_heads, false);
  detail::read_field(j, "joint_attention_dim", c.joint_attention_dim, false);
  detail::read_field(j, "guidance_embeds", c.guidance_embeds, false);
  detail::read_field(j, "axes_dims_rope", c.axes_dims_rope, false);
  detail::read_field(j, "zero_cond_t", c.zero_cond_t, false);
  detail::read_field(j, "use_additional_t_cond", c.use_additional_t_cond, false);
  detail::read_field(j, "use_layer3d_rope", c.use_layer3d_rope, false);
  c.validate();
  return c;
}

QwenImageConfig QwenImageConfig::load(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::invalid_argument(fmt::format("cannot read {}", path));
  try {
    return from_json(nlohmann::json::parse(in));
  } catch (const std::exception& e) {
    throw std::invalid_argument(fmt::format("{}: {}", path, e.what()));
  }
}

// ---- rotary positions and latent packing -------------------------------------------------------

namespace {

// Angles [positions, dim / 2] of one axis: position x 1 / theta^(2k / dim), in fp32 as diffusers'
// rope_params computes its table (torch.outer of the positions and the inverse frequencies).
torch::Tensor axis_angles(const torch::Tensor& positions, int64_t dim) {
  auto inverse =
      1.0 /
      torch::pow(kRopeTheta, torch::arange(0, dim, 2, torch::kFloat).div(static_cast<double>(dim)));
  return torch::outer(positions.to(torch::kFloat), inverse);
}

void require_rope_position(bool inside, const std::string& what) {
  if (!inside) {
    throw std::invalid_argument(
        fmt::format("Qwen-Image's rotary positions reach {} a side (diffusers' table): {}",
                    kRopePositions, what));
  }
}

}  // namespace

QwenImageRotary qwen_image_rotary(const QwenImageConfig& c,
                                  const std::vector<QwenImageShape>& img_shapes,
                                  int64_t text_tokens) {
  TORCH_CHECK(!img_shapes.empty(), "qwen_image_rotary: img_shapes is empty");
  TORCH_CHECK(text_tokens >= 0, "qwen_image_rotary: text_tokens ", text_tokens, " < 0");
  const auto& axes = c.axes_dims_rope;
  std::vector<torch::Tensor> images;
  int64_t text_start = 0;
  for (size_t j = 0; j < img_shapes.size(); ++j) {
    const auto [frames, height, width] = img_shapes[j];
    TORCH_CHECK(frames > 0 && height > 0 && width > 0, "qwen_image_rotary: img_shapes[", j, "] = (",
                frames, ", ", height, ", ", width, ") must be positive");
    require_rope_position(static_cast<int64_t>(j) + frames <= kRopePositions &&
                              height - height / 2 <= kRopePositions &&
                              width - width / 2 <= kRopePositions,
                          fmt::format("img_shapes[{}] = ({}, {}, {})", j, frames, height, width));
    // Frame-major, then rows, then columns; rows and columns centred on 0 (scale_rope).
    auto frame = torch::arange(frames, torch::kLong) + static_cast<int64_t>(j);
    auto row = torch::arange(height, torch::kLong) - (height - height / 2);
    auto col = torch::arange(width, torch::kLong) - (width - width / 2);
    const int64_t per_frame = height * width;
    images.push_back(
        torch::cat({axis_angles(frame.repeat_interleave(per_frame), axes[0]),
                    axis_angles(row.repeat_interleave(width).repeat({frames}), axes[1]),
                    axis_angles(col.repeat({frames * height}), axes[2])},
                   1));
    text_start = std::max({text_start, height / 2, width / 2});
  }
  require_rope_position(text_start + text_tokens <= kRopePositions,
                        fmt::format("{} text tokens after position {}", text_tokens, text_start));
  // Text token i sits at text_start + i on every axis.
  auto text_positions = torch::arange(text_tokens, torch::kLong) + text_start;
  auto text =
      torch::cat({axis_angles(text_positions, axes[0]), axis_angles(text_positions, axes[1]),
                  axis_angles(text_positions, axes[2])},
                 1);
  auto image = torch::cat(images, 0);
  return {torch::cos(image), torch::sin(image), torch::cos(text), torch::sin(text)};
}

torch::Tensor qwen_image_pack_latents(const torch::Tensor& latents, int64_t p) {
  TORCH_CHECK(latents.dim() == 4 && latents.size(2) % p == 0 && latents.size(3) % p == 0,
              "qwen_image_pack_latents: latents must be [B, C, H, W] with H and W multiples of ", p,
              ", got ", latents.sizes());
  const int64_t B = latents.size(0), C = latents.size(1);
  const int64_t h = latents.size(2) / p, w = latents.size(3) / p;
  return latents.view({B, C, h, p, w, p})
      .permute({0, 2, 4, 1, 3, 5})
      .reshape({B, h * w, C * p * p});
}

torch::Tensor qwen_image_unpack_latents(const torch::Tensor& tokens, int64_t height, int64_t width,
                                        int64_t p) {
  TORCH_CHECK(height % p == 0 && width % p == 0, "qwen_image_unpack_latents: ", height, " x ",
              width, " is not a multiple of patch size ", p);
  const int64_t h = height / p, w = width / p;
  TORCH_CHECK(tokens.dim() == 3 && tokens.size(1) == h * w && tokens.size(2) % (p * p) == 0,
              "qwen_image_unpack_latents: tokens must be [B, ", h * w, ", C * ", p * p, "], got ",
              tokens.sizes());
  const int64_t B = tokens.size(0), C = tokens.size(2) / (p * p);
  return tokens.view({B, h, w, C, p, p}).permute({0, 3, 1, 4, 2, 5}).reshape({B, C, height, width});
}

namespace {

// diffusers' apply_rotary_emb_qwen (use_real=False): each (even, odd) pair of head dims of
// x [B, S, heads, head_dim] as a complex number turned by its token's angle, in fp32.
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  auto pairs = x.to(torch::kFloat).unflatten(-1, {-1, 2});
  auto re = pairs.select(-1, 0), im = pairs.select(-1, 1);
  auto c = cos.unsqueeze(1), s = sin.unsqueeze(1);  // [S, 1, head_dim / 2]: over the heads
  return torch::stack({re * c - im * s, re * s + im * c}, -1).flatten(-2).to(x.scalar_type());
}

}  // namespace

// ---- attention ---------------------------------------------------------------------------------

QwenImageAttentionImpl::QwenImageAttentionImpl(const QwenImageConfig& c)
    : heads_(c.num_attention_heads), head_dim_(c.attention_head_dim) {
  const int64_t d = c.inner_dim();
  // Registration follows diffusers' order, so a state dict lists in the same order.
  norm_q = register_module("norm_q", RMSNorm(head_dim_, kNormEps));
  norm_k = register_module("norm_k", RMSNorm(head_dim_, kNormEps));
  to_q = register_module("to_q", lora::LoraLinear(d, d));
  to_k = register_module("to_k", lora::LoraLinear(d, d));
  to_v = register_module("to_v", lora::LoraLinear(d, d));
  add_k_proj = register_module("add_k_proj", lora::LoraLinear(d, d));
  add_v_proj = register_module("add_v_proj", lora::LoraLinear(d, d));
  add_q_proj = register_module("add_q_proj", lora::LoraLinear(d, d));
  to_out = holder(*this, "to_out")->register_module("0", lora::LoraLinear(d, d));
  to_add_out = register_module("to_add_out", lora::LoraLinear(d, d));
  norm_added_q = register_module("norm_added_q", RMSNorm(head_dim_, kNormEps));
  norm_added_k = register_module("norm_added_k", RMSNorm(head_dim_, kNormEps));
}

std::pair<torch::Tensor, torch::Tensor> QwenImageAttentionImpl::forward(
    const torch::Tensor& image, const torch::Tensor& text, const QwenImageRotary& rotary,
    const torch::Tensor& keys, bool text_output) {
  const int64_t B = image.size(0), T = image.size(1), L = text.size(1);
  auto heads = [&](const torch::Tensor& h) {
    return h.view({B, h.size(1), heads_, head_dim_});  // [B, tokens, heads, head_dim]
  };
  // qk RMSNorm, then the rotation; text first in the joint sequence, as diffusers orders it.
  auto q =
      torch::cat({rotate(norm_added_q(heads(add_q_proj(text))), rotary.text_cos, rotary.text_sin),
                  rotate(norm_q(heads(to_q(image))), rotary.image_cos, rotary.image_sin)},
                 1);
  auto k =
      torch::cat({rotate(norm_added_k(heads(add_k_proj(text))), rotary.text_cos, rotary.text_sin),
                  rotate(norm_k(heads(to_k(image))), rotary.image_cos, rotary.image_sin)},
                 1);
  auto v = torch::cat({heads(add_v_proj(text)), heads(to_v(image))}, 1);
  if (sequence_parallel_) {
    // Ulysses: every rank's [text, image] slices for heads / sp of the heads. Keys arrive in the
    // order of `keys` (rank 0's slices, then rank 1's, ...); the order of keys does not matter to
    // attention, and that of queries is undone by the inverse exchange. Padding queries attend
    // and are dropped at the end.
    auto& group = *sequence_parallel_;
    q = ulysses::gather_seq_scatter_heads(q, /*seq_dim=*/1, /*head_dim=*/2, group);
    k = ulysses::gather_seq_scatter_heads(k, 1, 2, group);
    v = ulysses::gather_seq_scatter_heads(v, 1, 2, group);
  }
  // An undefined tensor is no "no mask" to SDPA: that is std::nullopt.
  const auto mask = keys.defined()
                        ? std::optional<torch::Tensor>(keys.view({B, 1, 1, -1}).to(q.device()))
                        : std::nullopt;
  auto out = at::scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                              v.transpose(1, 2), mask)
                 .transpose(1, 2);  // [B, tokens, heads, head_dim]
  if (sequence_parallel_) {
    out =
        ulysses::gather_heads_scatter_seq(out, /*head_dim=*/2, /*seq_dim=*/1, *sequence_parallel_);
  }
  out = out.reshape({B, L + T, heads_ * head_dim_});
  return {to_out(out.narrow(1, L, T)),
          text_output ? to_add_out(out.narrow(1, 0, L)) : torch::Tensor()};
}

// ---- block -------------------------------------------------------------------------------------

QwenImageTransformerBlockImpl::QwenImageTransformerBlockImpl(const QwenImageConfig& c) {
  const int64_t d = c.inner_dim();
  img_mod = holder(*this, "img_mod")->register_module("1", Linear(d, 6 * d));
  attn = register_module("attn", QwenImageAttention(c));
  const auto img_mlp = detail::feed_forward(*this, "img_mlp", d);
  img_mlp_proj = img_mlp.proj;
  img_mlp_out = img_mlp.out;
  txt_mod = holder(*this, "txt_mod")->register_module("1", Linear(d, 6 * d));
  const auto txt_mlp = detail::feed_forward(*this, "txt_mlp", d);
  txt_mlp_proj = txt_mlp.proj;
  txt_mlp_out = txt_mlp.out;
}

std::vector<torch::Tensor> QwenImageTransformerBlockImpl::forward(torch::Tensor image,
                                                                  torch::Tensor text,
                                                                  torch::Tensor temb,
                                                                  const QwenImageRotary& rotary,
                                                                  torch::Tensor keys) {
  if (!checkpoint_activations) return compute(image, text, temb, rotary, keys);
  // checkpointed() recomputes a function of one output: both streams travel concatenated. The
  // rotary angles and the key mask need no grad: captured, not inputs of the recompute.
  const int64_t T = image.size(1);
  auto joined = checkpointed(
      [this, rotary, keys](const std::vector<torch::Tensor>& in) {
        return torch::cat(compute(in[0], in[1], in[2], rotary, keys), 1);
      },
      {image, text, temb});
  if (!text_output) return {joined};
  return {joined.narrow(1, 0, T), joined.narrow(1, T, joined.size(1) - T)};
}

std::vector<torch::Tensor> QwenImageTransformerBlockImpl::compute(const torch::Tensor& image_in,
                                                                  const torch::Tensor& text_in,
                                                                  const torch::Tensor& temb,
                                                                  const QwenImageRotary& rotary,
                                                                  const torch::Tensor& keys) {
  auto c = torch::silu(temb);
  // shift, scale, gate of norm1, then shift, scale, gate of norm2, for each stream.
  auto im = img_mod(c).chunk(6, 1);
  auto tm = txt_mod(c).chunk(6, 1);
  auto [image_attn, text_attn] =
      attn(modulate(plain_norm(image_in), im[0], im[1]),
           modulate(plain_norm(text_in), tm[0], tm[1]), rotary, keys, text_output);
  auto image = image_in + im[2].unsqueeze(1) * image_attn;
  image = image + im[5].unsqueeze(1) * detail::FeedForward{img_mlp_proj, img_mlp_out}(
                                           modulate(plain_norm(image), im[3], im[4]));
  if (!text_output) return {clip_half(image)};
  auto text = text_in + tm[2].unsqueeze(1) * text_attn;
  text = text + tm[5].unsqueeze(1) * detail::FeedForward{txt_mlp_proj, txt_mlp_out}(
                                         modulate(plain_norm(text), tm[3], tm[4]));
  return {clip_half(image), clip_half(text)};
}

// ---- model -------------------------------------------------------------------------------------

QwenImageTransformer2DModelImpl::QwenImageTransformer2DModelImpl(const QwenImageConfig& c)
    : config_(c) {
  c.validate();
  const int64_t d = c.inner_dim();
  auto t_embedder = holder(*holder(*this, "time_text_embed"), "timestep_embedder");
  t_linear_1_ = t_embedder->register_module("linear_1", Linear(kTimestepChannels, d));
  t_linear_2_ = t_embedder->register_module("linear_2", Linear(d, d));
  txt_norm_ = register_module("txt_norm", RMSNorm(c.joint_attention_dim, kNormEps));
  img_in_ = register_module("img_in", Linear(c.in_channels, d));
  txt_in_ = register_module("txt_in", Linear(c.joint_attention_dim, d));
  auto list = register_module("transformer_blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.num_layers; ++i) {
    blocks.emplace_back(c);
    list->push_back(blocks.back().ptr());
  }
  blocks.back()->text_output = false;
  norm_out_ = holder(*this, "norm_out")->register_module("linear", Linear(d, 2 * d));
  proj_out_ = register_module("proj_out", Linear(d, c.patch_size * c.patch_size * c.out_channels));
}

torch::Tensor QwenImageTransformer2DModelImpl::forward(
    torch::Tensor hidden_states, torch::Tensor encoder_hidden_states,
    torch::Tensor encoder_hidden_states_mask, torch::Tensor timestep,
    const std::vector<QwenImageShape>& img_shapes) {
  const auto& c = config_;
  TORCH_CHECK(!img_shapes.empty(), "QwenImageTransformer2DModel: img_shapes is empty");
  int64_t image_tokens = 0;
  for (const auto& [f, h, w] : img_shapes) image_tokens += f * h * w;
  TORCH_CHECK(hidden_states.dim() == 3 && hidden_states.size(1) == image_tokens &&
                  hidden_states.size(2) == c.in_channels,
              "QwenImageTransformer2DModel: hidden_states must be [B, ", image_tokens,
              " (the tokens of img_shapes), ", c.in_channels, "], got ", hidden_states.sizes());
  const int64_t B = hidden_states.size(0);
  TORCH_CHECK(encoder_hidden_states.dim() == 3 && encoder_hidden_states.size(0) == B &&
                  encoder_hidden_states.size(2) == c.joint_attention_dim,
              "QwenImageTransformer2DModel: encoder_hidden_states must be [", B, ", L, ",
              c.joint_attention_dim, "], got ", encoder_hidden_states.sizes());
  const int64_t L = encoder_hidden_states.size(1);
  TORCH_CHECK(!encoder_hidden_states_mask.defined() ||
                  encoder_hidden_states_mask.sizes() == torch::IntArrayRef({B, L}),
              "QwenImageTransformer2DModel: encoder_hidden_states_mask must be [", B, ", ", L,
              "], got ", encoder_hidden_states_mask.sizes());
  TORCH_CHECK(timestep.dim() == 1 && timestep.size(0) == B,
              "QwenImageTransformer2DModel: timestep must be [", B, "], got ", timestep.sizes());

  auto image = img_in_(hidden_states);
  // The timestep in the activations' dtype, as diffusers casts it before embedding it.
  auto t_proj = detail::timestep_embedding(timestep.to(image.scalar_type()), kTimestepChannels,
                                           kTimestepScale)
                    .to(image.scalar_type());
  auto temb = t_linear_2_(torch::silu(t_linear_1_(t_proj)));
  auto text = txt_in_(txt_norm_(encoder_hidden_states));
  auto rotary = qwen_image_rotary(c, img_shapes, L);
  for (auto* angle : {&rotary.image_cos, &rotary.image_sin, &rotary.text_cos, &rotary.text_sin}) {
    *angle = angle->to(image.device());
  }
  const auto text_real = encoder_hidden_states_mask.defined()
                             ? encoder_hidden_states_mask.to(torch::kBool)
                             : torch::Tensor();
  torch::Tensor keys;
  if (sequence_parallel_) {
    // Each rank keeps its slice of the text tokens and of the image tokens (and of their
    // angles); `keys` marks the real, unmasked positions of every rank's [text, image] slices,
    // as the attention exchange lays them out.
    auto& group = *sequence_parallel_;
    const int64_t sp = group.size();
    const auto text_slice = ulysses::sequence_slice(L, group);
    const auto image_slice = ulysses::sequence_slice(image_tokens, group);
    const auto options = torch::dtype(torch::kBool).device(image.device());
    auto text_keys =
        at::constant_pad_nd(text_real.defined() ? text_real : torch::ones({B, L}, options),
                            {0, text_slice.padded_length - L}, 0);
    auto image_keys =
        (torch::arange(image_slice.padded_length,
                       torch::dtype(torch::kLong).device(image.device())) < image_tokens)
            .view({1, sp, image_slice.local_length})
            .expand({B, sp, image_slice.local_length});
    keys = torch::cat({text_keys.view({B, sp, text_slice.local_length}), image_keys}, 2)
               .reshape({B, -1});
    image = ulysses::pad_and_slice(image, 1, group);
    text = ulysses::pad_and_slice(text, 1, group);
    for (auto* angle : {&rotary.image_cos, &rotary.image_sin, &rotary.text_cos, &rotary.text_sin}) {
      *angle = ulysses::pad_and_slice(*angle, 0, group);
    }
  } else if (text_real.defined()) {
    keys = torch::cat({text_real, torch::ones({B, image_tokens}, text_real.options())}, 1);
  }
  for (auto& block : blocks) {
    auto out = block(image, text, temb, rotary, keys);
    image = out[0];
    if (block->text_output) text = out[1];
  }
  auto mod = norm_out_(torch::silu(temb)).chunk(2, 1);  // scale, shift
  auto out = proj_out_(modulate(plain_norm(image), mod[1], mod[0]));
  if (sequence_parallel_) {
    out = ulysses::gather_outputs_and_unpad(out, 1, image_tokens, *sequence_parallel_);
  }
  return out;
}

void QwenImageTransformer2DModelImpl::set_activation_checkpointing(bool enabled) {
  for (auto& block : blocks) block->checkpoint_activations = enabled;
}

void QwenImageTransformer2DModelImpl::set_sequence_parallel(
    std::shared_ptr<dist::ProcessGroup> group) {
  if (group) {
    ulysses::check_heads(config_.num_attention_heads, config_.num_attention_heads, group->size());
  }
  sequence_parallel_ = group && group->size() > 1 ? group : nullptr;
  for (auto& block : blocks) block->attn->set_sequence_parallel(sequence_parallel_.get());
}

void shard_qwen_image(QwenImageTransformer2DModel& model, const dist::DeviceMesh& mesh,
                      const WrapPolicy& policy) {
  shard_by_block(model, model->blocks, mesh, policy);
}

std::vector<std::string> qwen_image_lora_targets() {
  return {"to_q",
          "to_k",
          "to_v",
          "to_out.0",
          "add_q_proj",
          "add_k_proj",
          "add_v_proj",
          "to_add_out",
          "img_mlp.net.0.proj",
          "img_mlp.net.2",
          "txt_mlp.net.0.proj",
          "txt_mlp.net.2"};
}

// ---- files -------------------------------------------------------------------------------------

void load_qwen_image_weights(QwenImageTransformer2DModelImpl& model, const std::string& path) {
  load_weights(model, path);
}

QwenImageTransformer2DModel load_qwen_image(const std::string& dir) {
  QwenImageTransformer2DModel model(
      QwenImageConfig::load((std::filesystem::path(dir) / "config.json").string()));
  load_qwen_image_weights(*model, dir);
  return model;
}

void save_qwen_image(const std::map<std::string, torch::Tensor>& params,
                     const QwenImageConfig& config, const std::string& dir,
                     torch::ScalarType dtype) {
  detail::save_diffusers_folder(params, config.to_json(), dir, dtype);
}

void add_qwen_image_export(checkpoint::ExportOptions& options) {
  detail::set_diffusers_export_layout(options);
}

void save_qwen_image_lora(const std::map<std::string, torch::Tensor>& params,
                          const lora::LoraConfig& config, const std::string& name,
                          const std::string& dir) {
  detail::save_diffusers_lora(params, config, name, dir, "save_qwen_image_lora");
}

}  // namespace shardrl::models
