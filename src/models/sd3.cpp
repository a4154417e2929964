#include "shardrl/models/sd3.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "models/json_fields.h"
#include "shardrl/checkpoint.h"
#include "shardrl/models/activation_checkpoint.h"
#include "shardrl/models/weights.h"
#include "shardrl/ulysses.h"

namespace shardrl::models {
namespace {

namespace nn = torch::nn;

constexpr double kNormEps = 1e-6;  // every LayerNorm and qk RMSNorm of the model
constexpr int64_t kTimestepChannels = 256;
// diffusers' weight files: `<stem>.safetensors`, or numbered files with
// `<stem>.safetensors.index.json`.
constexpr const char* kWeightsStem = "diffusion_pytorch_model";
const std::string kWeightsFile = std::string(kWeightsStem) + ".safetensors";

// Registers an empty module `name` on `parent`, so children get diffusers' dotted names.
std::shared_ptr<nn::Module> holder(nn::Module& parent, const std::string& name) {
  return parent.register_module(name, std::make_shared<nn::Module>());
}

// LayerNorm without affine params, as every norm of the model is before its modulation.
torch::Tensor plain_norm(const torch::Tensor& x) {
  return torch::layer_norm(x, {x.size(-1)}, {}, {}, kNormEps);
}

torch::Tensor modulate(const torch::Tensor& normed, const torch::Tensor& shift,
                       const torch::Tensor& scale) {
  return normed * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

// diffusers' FeedForward(dim, activation_fn="gelu-approximate"): net.0.proj, tanh GELU, net.2.
std::pair<lora::LoraLinear, lora::LoraLinear> feed_forward(nn::Module& block, const char* name,
                                                           int64_t dim) {
  auto net = holder(*holder(block, name), "net");
  auto proj = holder(*net, "0")->register_module("proj", lora::LoraLinear(dim, 4 * dim));
  auto out = net->register_module("2", lora::LoraLinear(4 * dim, dim));
  return {proj, out};
}

torch::Tensor run_feed_forward(lora::LoraLinear proj, lora::LoraLinear out,
                               const torch::Tensor& x) {
  return out->forward(torch::gelu(proj->forward(x), "tanh"));
}

}  // namespace

// ---- config ------------------------------------------------------------------------------------

bool SD3Config::dual_attention(int64_t layer) const {
  return std::find(dual_attention_layers.begin(), dual_attention_layers.end(), layer) !=
         dual_attention_layers.end();
}

void SD3Config::validate() const {
  detail::require_positive(sample_size, "sample_size");
  detail::require_positive(patch_size, "patch_size");
  detail::require_positive(in_channels, "in_channels");
  detail::require_positive(num_layers, "num_layers");
  detail::require_positive(attention_head_dim, "attention_head_dim");
  detail::require_positive(num_attention_heads, "num_attention_heads");
  detail::require_positive(joint_attention_dim, "joint_attention_dim");
  detail::require_positive(caption_projection_dim, "caption_projection_dim");
  detail::require_positive(pooled_projection_dim, "pooled_projection_dim");
  detail::require_positive(out_channels, "out_channels");
  detail::require_positive(pos_embed_max_size, "pos_embed_max_size");
  if (attention_head_dim > std::numeric_limits<int64_t>::max() / num_attention_heads) {
    throw std::invalid_argument(
        fmt::format("config: num_attention_heads {} * attention_head_dim {} overflows int64",
                    num_attention_heads, attention_head_dim));
  }
  if (caption_projection_dim != inner_dim()) {
    // The text stream enters the joint blocks at their width.
    throw std::invalid_argument(fmt::format(
        "config: caption_projection_dim {} must equal num_attention_heads * attention_head_dim "
        "= {}",
        caption_projection_dim, inner_dim()));
  }
  if (inner_dim() % 4 != 0) {
    throw std::invalid_argument(
        fmt::format("config: num_attention_heads * attention_head_dim = {} must be a multiple of "
                    "4 (2-D sin-cos position embedding)",
                    inner_dim()));
  }
  if (sample_size / patch_size > pos_embed_max_size) {
    throw std::invalid_argument(
        fmt::format("config: sample_size / patch_size = {} exceeds pos_embed_max_size {}",
                    sample_size / patch_size, pos_embed_max_size));
  }
  for (int64_t layer : dual_attention_layers) {
    if (layer < 0 || layer >= num_layers) {
      throw std::invalid_argument(
          fmt::format("config: dual_attention_layers holds {}, not a layer of num_layers {}", layer,
                      num_layers));
    }
  }
  if (!qk_norm.empty() && qk_norm != "rms_norm") {
    throw std::invalid_argument(
        fmt::format("config: qk_norm '{}' is not supported (null or rms_norm)", qk_norm));
  }
}

nlohmann::json SD3Config::to_json() const {
  return {{"_class_name", "SD3Transformer2DModel"},
          {"sample_size", sample_size},
          {"patch_size", patch_size},
          {"in_channels", in_channels},
          {"num_layers", num_layers},
          {"attention_head_dim", attention_head_dim},
          {"num_attention_heads", num_attention_heads},
          {"joint_attention_dim", joint_attention_dim},
          {"caption_projection_dim", caption_projection_dim},
          {"pooled_projection_dim", pooled_projection_dim},
          {"out_channels", out_channels},
          {"pos_embed_max_size", pos_embed_max_size},
          {"dual_attention_layers", dual_attention_layers},
          {"qk_norm", qk_norm.empty() ? nlohmann::json(nullptr) : nlohmann::json(qk_norm)}};
}

SD3Config SD3Config::from_json(const nlohmann::json& j) {
  if (!j.is_object()) throw std::invalid_argument("config.json: not a JSON object");
  const auto cls = j.value("_class_name", std::string("SD3Transformer2DModel"));
  if (cls != "SD3Transformer2DModel") {
    throw std::invalid_argument(
        fmt::format("config.json: _class_name is '{}', not SD3Transformer2DModel", cls));
  }
  // Absent fields take diffusers' defaults, as its from_pretrained does.
  SD3Config c;
  detail::read_field(j, "sample_size", c.sample_size, false);
  detail::read_field(j, "patch_size", c.patch_size, false);
  detail::read_field(j, "in_channels", c.in_channels, false);
  detail::read_field(j, "num_layers", c.num_layers, false);
  detail::read_field(j, "attention_head_dim", c.attention_head_dim, false);
  detail::read_field(j, "num_attention_heads", c.num_attention_heads, false);
  detail::read_field(j, "joint_attention_dim", c.joint_attention_dim, false);
  detail::read_field(j, "caption_projection_dim", c.caption_projection_dim, false);
  detail::read_field(j, "pooled_projection_dim", c.pooled_projection_dim, false);
  // null out_channels means in_channels in diffusers.
  c.out_channels = c.in_channels;
  detail::read_field(j, "out_channels", c.out_channels, false);
  detail::read_field(j, "pos_embed_max_size", c.pos_embed_max_size, false);
  detail::read_field(j, "dual_attention_layers", c.dual_attention_layers, false);
  detail::read_field(j, "qk_norm", c.qk_norm, false);
  c.validate();
  return c;
}

SD3Config SD3Config::load(const std::string& path) {
  return detail::with_path(path, [](const nlohmann::json& j) { return from_json(j); });
}

// ---- embeddings --------------------------------------------------------------------------------

torch::Tensor sd3_timestep_embedding(const torch::Tensor& t, int64_t dim) {
  const int64_t half = dim / 2;
  // Operation for operation diffusers' fp32 arithmetic, so the embedding matches to the bit.
  auto exponent =
      -std::log(10000.0) * torch::arange(half, torch::dtype(torch::kFloat).device(t.device()));
  exponent = exponent / static_cast<double>(half);
  auto args = t.to(torch::kFloat).unsqueeze(1) * torch::exp(exponent).unsqueeze(0);
  return torch::cat({torch::cos(args), torch::sin(args)}, -1);
}

torch::Tensor sd3_pos_embed(int64_t dim, int64_t grid, int64_t base_size) {
  // Positions in fp32 (grid / base_size steps), frequencies and products in fp64, as diffusers.
  auto pos = torch::arange(grid, torch::kFloat) /
             (static_cast<double>(grid) / static_cast<double>(base_size));
  auto omega = torch::arange(dim / 4, torch::kDouble) / (dim / 4.0);
  omega = 1.0 / torch::pow(10000.0, omega);
  auto one_axis = [&](const torch::Tensor& p) {
    auto out = torch::outer(p.to(torch::kDouble), omega);
    return torch::cat({torch::sin(out), torch::cos(out)}, 1);
  };
  // Token k = row * grid + col; the column (width) coordinate takes the first half.
  auto col = pos.repeat({grid}), row = pos.repeat_interleave(grid);
  return torch::cat({one_axis(col), one_axis(row)}, 1).to(torch::kFloat);
}

namespace {

// The whole table diffusers keeps as `pos_embed.pos_embed`: [1, max * max, D], scaled for
// sample_size.
torch::Tensor full_pos_embed(const SD3Config& c) {
  return sd3_pos_embed(c.inner_dim(), c.pos_embed_max_size, c.sample_size / c.patch_size)
      .unsqueeze(0);
}

}  // namespace

// ---- attention ---------------------------------------------------------------------------------

SD3AttentionImpl::SD3AttentionImpl(const SD3Config& c, bool joint, bool context_out)
    : heads_(c.num_attention_heads), head_dim_(c.attention_head_dim) {
  const int64_t d = c.inner_dim();
  const bool rms = c.qk_norm == "rms_norm";
  // Registration follows diffusers' order, so a state dict lists in the same order.
  if (rms) {
    norm_q = register_module("norm_q", RMSNorm(head_dim_, kNormEps));
    norm_k = register_module("norm_k", RMSNorm(head_dim_, kNormEps));
  }
  to_q = register_module("to_q", lora::LoraLinear(d, d));
  to_k = register_module("to_k", lora::LoraLinear(d, d));
  to_v = register_module("to_v", lora::LoraLinear(d, d));
  if (joint) {
    add_k_proj = register_module("add_k_proj", lora::LoraLinear(d, d));
    add_v_proj = register_module("add_v_proj", lora::LoraLinear(d, d));
    add_q_proj = register_module("add_q_proj", lora::LoraLinear(d, d));
  }
  to_out = holder(*this, "to_out")->register_module("0", lora::LoraLinear(d, d));
  if (context_out) to_add_out = register_module("to_add_out", lora::LoraLinear(d, d));
  if (joint && rms) {
    norm_added_q = register_module("norm_added_q", RMSNorm(head_dim_, kNormEps));
    norm_added_k = register_module("norm_added_k", RMSNorm(head_dim_, kNormEps));
  }
}

std::pair<torch::Tensor, torch::Tensor> SD3AttentionImpl::forward(const torch::Tensor& x,
                                                                  const torch::Tensor& context,
                                                                  bool need_context,
                                                                  const torch::Tensor& keys) {
  const int64_t B = x.size(0), T = x.size(1);
  auto heads = [&](const torch::Tensor& h) {
    return h.view({B, -1, heads_, head_dim_}).transpose(1, 2);  // [B, heads, tokens, head_dim]
  };
  auto normed = [](RMSNorm norm, const torch::Tensor& h) { return norm ? norm->forward(h) : h; };
  auto q = normed(norm_q, heads(to_q(x)));
  auto k = normed(norm_k, heads(to_k(x)));
  auto v = heads(to_v(x));
  if (context.defined()) {
    // Text tokens follow the image tokens in the joint sequence.
    k = torch::cat({k, normed(norm_added_k, heads(add_k_proj(context)))}, 2);
    v = torch::cat({v, heads(add_v_proj(context))}, 2);
    // Each query attends independently, so leaving out the text queries the last block would
    // discard changes nothing the image stream sees.
    if (need_context) q = torch::cat({q, normed(norm_added_q, heads(add_q_proj(context)))}, 2);
  }
  const int64_t local_queries = q.size(2);
  torch::Tensor out;
  if (sequence_parallel_) {
    // Ulysses: every rank's [image, text] slices for heads / sp of the heads. The keys arrive
    // in the order of `keys` rows (rank 0's image and text slices, then rank 1's, ...); the
    // order of keys does not matter to attention, and that of queries is undone by the inverse
    // exchange. Padding keys are hidden; padding queries attend and are dropped at the end.
    auto& group = *sequence_parallel_;
    q = ulysses::gather_seq_scatter_heads(q, /*seq_dim=*/2, /*head_dim=*/1, group);
    k = ulysses::gather_seq_scatter_heads(k, 2, 1, group);
    v = ulysses::gather_seq_scatter_heads(v, 2, 1, group);
    const auto real = context.defined() ? keys : keys.narrow(1, 0, T);
    out = at::scaled_dot_product_attention(q, k, v, real.reshape({1, 1, 1, -1}).to(q.device()));
    out = ulysses::gather_heads_scatter_seq(out, /*head_dim=*/1, /*seq_dim=*/2, group);
  } else {
    out = at::scaled_dot_product_attention(q, k, v);
  }
  out = out.transpose(1, 2).reshape({B, local_queries, heads_ * head_dim_});
  auto image = to_out(out.narrow(1, 0, T));
  if (!context.defined() || !need_context) return {image, {}};
  auto text = out.narrow(1, T, out.size(1) - T);
  return {image, to_add_out ? to_add_out(text) : text};
}

// ---- block -------------------------------------------------------------------------------------

JointTransformerBlockImpl::JointTransformerBlockImpl(const SD3Config& c, int64_t layer)
    : context_pre_only_(layer == c.num_layers - 1),
      dual_(c.dual_attention(layer)),
      dim_(c.inner_dim()) {
  const int64_t d = dim_;
  norm1 = holder(*this, "norm1")->register_module("linear", Linear(d, (dual_ ? 9 : 6) * d));
  norm1_context = holder(*this, "norm1_context")
                      ->register_module("linear", Linear(d, (context_pre_only_ ? 2 : 6) * d));
  attn = register_module("attn", SD3Attention(c, /*joint=*/true, !context_pre_only_));
  if (dual_) attn2 = register_module("attn2", SD3Attention(c, /*joint=*/false, false));
  std::tie(ff_proj, ff_out) = feed_forward(*this, "ff", d);
  if (!context_pre_only_)
    std::tie(ff_context_proj, ff_context_out) = feed_forward(*this, "ff_context", d);
}

std::vector<torch::Tensor> JointTransformerBlockImpl::forward(torch::Tensor hidden,
                                                              torch::Tensor context,
                                                              torch::Tensor temb,
                                                              torch::Tensor keys) {
  if (!checkpoint_activations) return compute(hidden, context, temb, keys);
  // checkpointed() recomputes a function of one output: both streams travel concatenated. The
  // key mask needs no grad: captured, not an input of the recompute.
  const int64_t T = hidden.size(1);
  auto joined = checkpointed(
      [this, keys](const std::vector<torch::Tensor>& in) {
        return torch::cat(compute(in[0], in[1], in[2], keys), 1);
      },
      {hidden, context, temb});
  if (context_pre_only_) return {joined};
  return {joined.narrow(1, 0, T), joined.narrow(1, T, joined.size(1) - T)};
}

std::vector<torch::Tensor> JointTransformerBlockImpl::compute(const torch::Tensor& hidden_in,
                                                              const torch::Tensor& context_in,
                                                              const torch::Tensor& temb,
                                                              const torch::Tensor& keys) {
  auto c = torch::silu(temb);
  // shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp[, shift2, scale2, gate2]
  auto m = norm1(c).chunk(dual_ ? 9 : 6, 1);
  auto normed = plain_norm(hidden_in);
  auto x = modulate(normed, m[0], m[1]);
  auto cm = norm1_context(c).chunk(context_pre_only_ ? 2 : 6, 1);
  // AdaLayerNormContinuous (the last block) chunks scale before shift.
  auto ctx = context_pre_only_ ? modulate(plain_norm(context_in), cm[1], cm[0])
                               : modulate(plain_norm(context_in), cm[0], cm[1]);

  auto [attn_out, context_attn_out] = attn(x, ctx, !context_pre_only_, keys);
  auto hidden = hidden_in + m[2].unsqueeze(1) * attn_out;
  if (dual_) {
    hidden = hidden + m[8].unsqueeze(1) *
                          attn2(modulate(normed, m[6], m[7]), torch::Tensor(), false, keys).first;
  }
  hidden = hidden + m[5].unsqueeze(1) *
                        run_feed_forward(ff_proj, ff_out, modulate(plain_norm(hidden), m[3], m[4]));
  if (context_pre_only_) return {hidden};
  auto context = context_in + cm[2].unsqueeze(1) * context_attn_out;
  context =
      context + cm[5].unsqueeze(1) * run_feed_forward(ff_context_proj, ff_context_out,
                                                      modulate(plain_norm(context), cm[3], cm[4]));
  return {hidden, context};
}

// ---- model -------------------------------------------------------------------------------------

SD3Transformer2DModelImpl::SD3Transformer2DModelImpl(const SD3Config& c) : config_(c) {
  c.validate();
  const int64_t d = c.inner_dim();
  pos_proj_ = holder(*this, "pos_embed")
                  ->register_module("proj", Conv2d(c.in_channels, d, c.patch_size, c.patch_size));
  auto time_text = holder(*this, "time_text_embed");
  auto t_embedder = holder(*time_text, "timestep_embedder");
  t_linear_1_ = t_embedder->register_module("linear_1", Linear(kTimestepChannels, d));
  t_linear_2_ = t_embedder->register_module("linear_2", Linear(d, d));
  auto text_embedder = holder(*time_text, "text_embedder");
  text_linear_1_ = text_embedder->register_module("linear_1", Linear(c.pooled_projection_dim, d));
  text_linear_2_ = text_embedder->register_module("linear_2", Linear(d, d));
  context_embedder_ =
      register_module("context_embedder", Linear(c.joint_attention_dim, c.caption_projection_dim));
  auto list = register_module("transformer_blocks", nn::ModuleList());
  for (int64_t i = 0; i < c.num_layers; ++i) {
    blocks.emplace_back(c, i);
    list->push_back(blocks.back().ptr());
  }
  norm_out_ = holder(*this, "norm_out")->register_module("linear", Linear(d, 2 * d));
  proj_out_ = register_module("proj_out", Linear(d, c.patch_size * c.patch_size * c.out_channels));
  pos_embed_ = full_pos_embed(c);
}

void SD3Transformer2DModelImpl::set_pos_embed_table(const torch::Tensor& table) {
  TORCH_CHECK(table.sizes() == pos_embed_.sizes(), kSD3PosEmbedName, " must be ",
              pos_embed_.sizes(), ", got ", table.sizes());
  pos_embed_ = table.detach().to(torch::kFloat).clone();
}

torch::Tensor SD3Transformer2DModelImpl::patch_embed(const torch::Tensor& x) {
  const int64_t p = config_.patch_size, max = config_.pos_embed_max_size;
  const int64_t h = x.size(2) / p, w = x.size(3) / p;
  auto tokens = pos_proj_(x).flatten(2).transpose(1, 2);
  // The centre h x w window of the max x max table.
  auto pos = pos_embed_.view({1, max, max, -1})
                 .narrow(1, (max - h) / 2, h)
                 .narrow(2, (max - w) / 2, w)
                 .reshape({1, h * w, -1});
  return (tokens + pos.to(tokens.device())).to(tokens.scalar_type()).contiguous();
}

torch::Tensor SD3Transformer2DModelImpl::forward(torch::Tensor hidden_states,
                                                 torch::Tensor encoder_hidden_states,
                                                 torch::Tensor pooled_projections,
                                                 torch::Tensor timestep) {
  const auto& c = config_;
  const int64_t p = c.patch_size;
  TORCH_CHECK(hidden_states.dim() == 4 && hidden_states.size(1) == c.in_channels &&
                  hidden_states.size(2) % p == 0 && hidden_states.size(3) % p == 0,
              "SD3Transformer2DModel: hidden_states must be [B, ", c.in_channels,
              ", H, W] with H and W multiples of patch_size ", p, ", got ", hidden_states.sizes());
  TORCH_CHECK(hidden_states.size(2) / p <= c.pos_embed_max_size &&
                  hidden_states.size(3) / p <= c.pos_embed_max_size,
              "SD3Transformer2DModel: hidden_states ", hidden_states.sizes(), " has more than ",
              "pos_embed_max_size = ", c.pos_embed_max_size, " patches a side");
  const int64_t B = hidden_states.size(0);
  TORCH_CHECK(encoder_hidden_states.dim() == 3 && encoder_hidden_states.size(0) == B &&
                  encoder_hidden_states.size(2) == c.joint_attention_dim,
              "SD3Transformer2DModel: encoder_hidden_states must be [", B, ", L, ",
              c.joint_attention_dim, "], got ", encoder_hidden_states.sizes());
  TORCH_CHECK(pooled_projections.dim() == 2 && pooled_projections.size(0) == B &&
                  pooled_projections.size(1) == c.pooled_projection_dim,
              "SD3Transformer2DModel: pooled_projections must be [", B, ", ",
              c.pooled_projection_dim, "], got ", pooled_projections.sizes());
  TORCH_CHECK(timestep.dim() == 1 && timestep.size(0) == B,
              "SD3Transformer2DModel: timestep must be [", B, "], got ", timestep.sizes());
  const int64_t h = hidden_states.size(2) / p, w = hidden_states.size(3) / p;

  auto hidden = patch_embed(hidden_states);
  auto t_proj =
      sd3_timestep_embedding(timestep, kTimestepChannels).to(pooled_projections.scalar_type());
  auto temb = t_linear_2_(torch::silu(t_linear_1_(t_proj))) +
              text_linear_2_(torch::silu(text_linear_1_(pooled_projections)));
  auto context = context_embedder_(encoder_hidden_states);
  torch::Tensor keys;
  if (sequence_parallel_) {
    // Each rank keeps its slice of the image tokens and of the text tokens; `keys` marks the real
    // positions of every rank's slices, as the attention exchange lays them out.
    auto& group = *sequence_parallel_;
    const auto image = ulysses::sequence_slice(hidden.size(1), group);
    const auto text = ulysses::sequence_slice(context.size(1), group);
    auto real = [&](const ulysses::SequenceSlice& slice) {
      auto position = torch::arange(slice.padded_length, torch::kLong).view({group.size(), -1});
      return position < slice.length;
    };
    keys = torch::cat({real(image), real(text)}, 1);
    hidden = ulysses::pad_and_slice(hidden, 1, group);
    context = ulysses::pad_and_slice(context, 1, group);
  }
  for (auto& block : blocks) {
    auto out = block(hidden, context, temb, keys);
    hidden = out[0];
    if (out.size() > 1) context = out[1];
  }
  auto mod = norm_out_(torch::silu(temb)).chunk(2, 1);  // scale, shift
  hidden = proj_out_(modulate(plain_norm(hidden), mod[1], mod[0]));
  if (sequence_parallel_) {
    hidden = ulysses::gather_outputs_and_unpad(hidden, 1, h * w, *sequence_parallel_);
  }
  return hidden.reshape({B, h, w, p, p, c.out_channels})
      .permute({0, 5, 1, 3, 2, 4})  // n h w p q c -> n c h p w q
      .reshape({B, c.out_channels, h * p, w * p});
}

void SD3Transformer2DModelImpl::set_activation_checkpointing(bool enabled) {
  for (auto& block : blocks) block->checkpoint_activations = enabled;
}

void SD3Transformer2DModelImpl::set_sequence_parallel(std::shared_ptr<dist::ProcessGroup> group) {
  if (group) {
    ulysses::check_heads(config_.num_attention_heads, config_.num_attention_heads, group->size());
  }
  sequence_parallel_ = group && group->size() > 1 ? group : nullptr;
  for (auto& block : blocks) {
    block->attn->set_sequence_parallel(sequence_parallel_.get());
    if (block->attn2) block->attn2->set_sequence_parallel(sequence_parallel_.get());
  }
}

void shard_sd3(SD3Transformer2DModel& model, const dist::DeviceMesh& mesh,
               const WrapPolicy& policy) {
  shard_by_block(model, model->blocks, mesh, policy);
}

// ---- files -------------------------------------------------------------------------------------

void load_sd3_weights(SD3Transformer2DModelImpl& model, const std::string& path) {
  auto table = torch::empty_like(model.pos_embed_table());
  LoadWeightsOptions options;
  options.extra = {{kSD3PosEmbedName, table}};
  load_weights(model, path, options);
  model.set_pos_embed_table(table);
}

SD3Transformer2DModel load_sd3(const std::string& dir) {
  SD3Transformer2DModel model(
      SD3Config::load((std::filesystem::path(dir) / "config.json").string()));
  load_sd3_weights(*model, dir);
  return model;
}

void save_sd3(const std::map<std::string, torch::Tensor>& params, const SD3Config& config,
              const std::string& dir, torch::ScalarType dtype) {
  std::filesystem::create_directories(dir);
  auto with_table = params;
  with_table[kSD3PosEmbedName] = full_pos_embed(config);
  save_weights(with_table, dir + "/" + kWeightsFile, dtype);
  std::ofstream out(dir + "/config.json");
  if (!out) throw std::runtime_error("cannot write " + dir + "/config.json");
  out << config.to_json().dump(2) << "\n";
}

void add_sd3_export(const SD3Config& config, checkpoint::ExportOptions& options) {
  options.layout.weights_stem = kWeightsStem;
  options.layout.single_file_unindexed = true;
  options.layout.config_torch_dtype = false;
  options.extra_tensors.emplace_back(kSD3PosEmbedName, full_pos_embed(config));
}

void save_sd3_lora(const std::map<std::string, torch::Tensor>& params,
                   const lora::LoraConfig& config, const std::string& name,
                   const std::string& dir) {
  // diffusers' SD3 LoRA layout: the module path under the pipeline's "transformer", the
  // adapter name dropped, and the config in the header with the same prefix on every key.
  const std::string peft_prefix = "base_model.model.";
  std::vector<checkpoint::TensorInfo> infos;
  std::map<std::string, torch::Tensor> tensors;
  for (const auto& [param, tensor] : params) {
    auto peft = lora::peft_name(param, name);
    if (!peft) continue;
    const std::string key = "transformer." + peft->substr(peft_prefix.size());
    infos.push_back({key, torch::kFloat, tensor.sizes().vec()});
    tensors[key] = tensor;
  }
  if (infos.empty()) {
    throw std::invalid_argument(fmt::format("save_sd3_lora: no tensors of adapter '{}'", name));
  }
  const auto peft_config = nlohmann::json::parse(lora::peft_adapter_config(config));
  nlohmann::json metadata = nlohmann::json::object();
  for (const auto& [key, value] : peft_config.items()) metadata["transformer." + key] = value;
  std::filesystem::create_directories(dir);
  checkpoint::SafetensorsWriter writer(
      dir + "/" + lora::kPeftWeightsFile, infos,
      {{"format", "pt"}, {"lora_adapter_metadata", metadata.dump()}});
  for (const auto& info : infos) {
    writer.write(info.name, tensors.at(info.name).detach().to(torch::kFloat).contiguous());
  }
  writer.close();
  std::ofstream out(dir + "/" + lora::kPeftConfigFile);
  if (!out) throw std::runtime_error("cannot write " + dir + "/" + lora::kPeftConfigFile);
  out << peft_config.dump(2) << "\n";
}

}  // namespace shardrl::models
