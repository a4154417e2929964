// Linear layers packed once for inference on CPU: fbgemm's fp16-weight GEMM, reached through
// torch.ao's dynamic fp16 quantization ops (quantized::linear_prepack_fp16 and
// linear_dynamic_fp16, what `quantize_dynamic(model, {nn.Linear}, torch.float16)` calls). The
// weights are stored in fp16 in the GEMM's own blocked layout; activations, accumulation and the
// output stay fp32. A decode step with a few rows is bound by reading the weights, so half the
// bytes and no packing per call make each linear 2-4x faster than fp32 `linear` on this CPU
// (BENCHMARKS.md), while the output moves only by the rounding of the weights to fp16.
#pragma once

#include <ATen/core/ivalue.h>
#include <torch/torch.h>

namespace shardrl::models::packed {

// The packed weight (and bias, when defined) of a fp32 CPU linear: an opaque LinearPackedParams
// object. Errors name the shape when the weight is not a fp32 CPU matrix.
c10::IValue pack_fp16(const torch::Tensor& weight, const torch::Tensor& bias);

// linear(input, weight, bias) with a pack_fp16 result; input [..., in] fp32 -> [..., out] fp32.
// Forward only: no autograd reaches the packed weight.
torch::Tensor linear(const torch::Tensor& input, const c10::IValue& packed);

}  // namespace shardrl::models::packed
