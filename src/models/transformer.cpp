#include "shardrl/models/transformer.h"

#include "json_fields.h"
#include "shardrl/models/activation_checkpoint.h"
#include "shardrl/models/wrap_policy.h"

#include <cmath>

namespace shardrl::models {

int64_t TransformerConfig::parameter_count() const {
  const int64_t d = d_model, h = mlp_ratio * d_model;
  const int64_t block = 2 * 2 * d + (3 * d * d + 2 * d) + (d * d + d) + (h * d + h) + (d * h + d);
  return vocab_size * d + max_seq_len * d + n_layers * block + 2 * d + d * vocab_size;
}

nlohmann::json TransformerConfig::to_json() const {
  return {{"model_type", "shardrl-transformer"},
          {"vocab_size", vocab_size},
          {"max_seq_len", max_seq_len},
          {"d_model", d_model},
          {"n_heads", n_heads},
          {"n_layers", n_layers},
          {"mlp_ratio", mlp_ratio}};
}

TransformerConfig TransformerConfig::from_json(const nlohmann::json& j) {
  TransformerConfig c;
  detail::read_field(j, "vocab_size", c.vocab_size, true);
  detail::read_field(j, "max_seq_len", c.max_seq_len, true);
  detail::read_field(j, "d_model", c.d_model, true);
  detail::read_field(j, "n_heads", c.n_heads, true);
  detail::read_field(j, "n_layers", c.n_layers, true);
  detail::read_field(j, "mlp_ratio", c.mlp_ratio, false);
  for (auto [value, field] : {std::pair{c.vocab_size, "vocab_size"},
                              {c.max_seq_len, "max_seq_len"},
                              {c.d_model, "d_model"},
                              {c.n_heads, "n_heads"},
                              {c.n_layers, "n_layers"},
                              {c.mlp_ratio, "mlp_ratio"}}) {
    detail::require_positive(value, field);
  }
  return c;
}

BlockImpl::BlockImpl(const TransformerConfig& c) : n_heads_(c.n_heads) {
  TORCH_CHECK(c.d_model % c.n_heads == 0, "d_model must be divisible by n_heads");
  ln1_ = register_module("ln1", LayerNorm(c.d_model));
  q_proj_ =
      register_module("q_proj", lora::LoraLinear(torch::nn::LinearOptions(c.d_model, c.d_model)));
  // A key bias shifts every score of a query by the same amount, which softmax cancels: its
  // gradient is exactly zero in theory and rounding noise in practice, which Adam would amplify.
  k_proj_ = register_module(
      "k_proj", lora::LoraLinear(torch::nn::LinearOptions(c.d_model, c.d_model).bias(false)));
  v_proj_ =
      register_module("v_proj", lora::LoraLinear(torch::nn::LinearOptions(c.d_model, c.d_model)));
  proj_ = register_module("proj", lora::LoraLinear(torch::nn::LinearOptions(c.d_model, c.d_model)));
  ln2_ = register_module("ln2", LayerNorm(c.d_model));
  fc1_ = register_module(
      "fc1", lora::LoraLinear(torch::nn::LinearOptions(c.d_model, c.mlp_ratio * c.d_model)));
  fc2_ = register_module(
      "fc2", lora::LoraLinear(torch::nn::LinearOptions(c.mlp_ratio * c.d_model, c.d_model)));
}

torch::Tensor BlockImpl::attention(const torch::Tensor& x) {
  const int64_t B = x.size(0), T = x.size(1), D = x.size(2), hd = D / n_heads_;
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, n_heads_, hd}).transpose(1, 2); };
  auto q = heads(q_proj_(x)), k = heads(k_proj_(x)), v = heads(v_proj_(x));
  auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
  auto future = torch::ones({T, T}, torch::dtype(torch::kBool).device(x.device())).triu(1);
  scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
  auto out = torch::matmul(torch::softmax(scores, -1), v);
  return proj_(out.transpose(1, 2).reshape({B, T, D}));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  if (!checkpoint_activations) return compute(x);
  return checkpointed([this](const std::vector<torch::Tensor>& in) { return compute(in[0]); }, {x});
}

torch::Tensor BlockImpl::compute(const torch::Tensor& x) {
  const auto h = x + attention(ln1_(x));
  return h + fc2_(torch::gelu(fc1_(ln2_(h))));
}

TransformerImpl::TransformerImpl(const TransformerConfig& c) : config_(c) {
  tok_emb_ = register_module("tok_emb", fsdp::Unit<EmbeddingImpl>(c.vocab_size, c.d_model));
  pos_emb_ = register_module("pos_emb", Embedding(c.max_seq_len, c.d_model));
  auto list = register_module("blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layers; ++i) {
    blocks_.emplace_back(c);
    list->push_back(blocks_.back().ptr());
  }
  ln_f_ = register_module("ln_f", LayerNorm(c.d_model));
  head_ = register_module(
      "head",
      fsdp::Unit<LinearImpl>(torch::nn::LinearOptions(c.d_model, c.vocab_size).bias(false)));
}

torch::Tensor TransformerImpl::forward(torch::Tensor tokens) {
  const int64_t T = tokens.size(1);
  TORCH_CHECK(T <= config_.max_seq_len, "sequence length ", T, " exceeds max_seq_len ",
              config_.max_seq_len);
  auto positions = torch::arange(T, torch::dtype(torch::kLong).device(tokens.device()));
  auto x = tok_emb_(tokens) + pos_emb_(positions);
  for (auto& block : blocks_) x = block(x);
  return head_(ln_f_(x));
}

void TransformerImpl::set_activation_checkpointing(bool enabled) {
  for (auto& block : blocks_) block->checkpoint_activations = enabled;
}

void shard_transformer(Transformer& model, const dist::DeviceMesh& mesh,
                       const fsdp::Options& options) {
  shard_by_block(model, model->blocks(), mesh, options, model->tok_emb_, model->head_);
}

torch::Tensor next_token_loss(const torch::Tensor& logits, const torch::Tensor& tokens) {
  const int64_t V = logits.size(-1);
  auto pred = logits.narrow(1, 0, logits.size(1) - 1).reshape({-1, V}).to(torch::kFloat);
  auto target = tokens.narrow(1, 1, tokens.size(1) - 1).reshape({-1});
  return torch::nn::functional::cross_entropy(pred, target);
}

}  // namespace shardrl::models
