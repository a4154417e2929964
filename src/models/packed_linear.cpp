#include "models/packed_linear.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Exception.h>

namespace shardrl::models::packed {
namespace {

// Looked up once: the ops are registered by libtorch_cpu when it loads.
c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

}  // namespace

c10::IValue pack_fp16(const torch::Tensor& weight, const torch::Tensor& bias) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat && weight.is_cpu(),
              "packed fp16 linear: the weight must be a fp32 CPU matrix, got ", weight.toString(),
              " of shape ", weight.sizes());
  static const auto prepack = op("quantized::linear_prepack_fp16");
  std::vector<c10::IValue> stack{
      weight.detach().contiguous(),
      bias.defined() ? c10::IValue(bias.detach().contiguous()) : c10::IValue()};
  prepack.callBoxed(&stack);
  return std::move(stack.at(0));
}

torch::Tensor linear(const torch::Tensor& input, const c10::IValue& packed) {
  static const auto run = op("quantized::linear_dynamic_fp16");
  std::vector<c10::IValue> stack{input.contiguous(), packed};
  run.callBoxed(&stack);
  return stack.at(0).toTensor();
}

}  // namespace shardrl::models::packed
