#include "shardrl/rollout/packed_linear.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/ivalue.h>
#include <c10/util/Exception.h>

namespace shardrl::rollout {
namespace {

// Looked up once: the ops are registered by libtorch_cpu when it loads.
c10::OperatorHandle op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// The packed weight (and bias, when defined) of a fp32 CPU linear: an opaque LinearPackedParams
// object. Errors name the shape when the weight is not a fp32 CPU matrix.
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

// linear(input, weight, bias) with a pack_fp16 result; input [..., in] fp32 -> [..., out] fp32.
torch::Tensor packed_linear(const torch::Tensor& input, const c10::IValue& packed) {
  static const auto run = op("quantized::linear_dynamic_fp16");
  std::vector<c10::IValue> stack{input.contiguous(), packed};
  run.callBoxed(&stack);
  return stack.at(0).toTensor();
}

}  // namespace

void pack_for_inference(models::LlamaForCausalLMImpl& model, torch::ScalarType dtype) {
  TORCH_CHECK(dtype == torch::kHalf || dtype == torch::kFloat,
              "pack_for_inference: float16 or float32, got ", c10::toString(dtype));
  auto packed_kernel = [](const torch::Tensor& weight, const torch::Tensor& bias) {
    return [packed = pack_fp16(weight, bias)](const torch::Tensor& input) {
      return packed_linear(input, packed);
    };
  };
  const bool pack = dtype == torch::kHalf;
  for (auto& module : model.modules()) {
    if (auto* linear = dynamic_cast<models::LinearImpl*>(module.get())) {
      linear->set_inference_kernel(pack ? packed_kernel(linear->weight, linear->bias)
                                        : models::LinearImpl::InferenceKernel());
    }
  }
  if (!model.lm_head) {
    model.set_tied_head_inference_kernel(
        pack ? packed_kernel(model.model->embed_tokens->weight, torch::Tensor())
             : models::LinearImpl::InferenceKernel());
  }
}

}  // namespace shardrl::rollout
