// Rollout replicas with packed weights: every projection and the head of an unsharded decoder
// packed once into fbgemm's fp16-weight GEMM (torch.ao's dynamic fp16 quantization: fp16
// weights, fp32 activations and output; what `quantize_dynamic(model, {nn.Linear},
// torch.float16)` calls: quantized::linear_prepack_fp16 and linear_dynamic_fp16), the weights in
// the GEMM's own blocked layout, half the bytes of fp32 and no repacking per call. A
// decode step with a few rows is bound by reading the weights, so each linear runs 2-4x faster
// than fp32 `linear` on a CPU (BENCHMARKS.md), while its output moves only by the rounding of the
// weights to fp16.
#pragma once

#include <torch/torch.h>

#include "shardrl/models/llama.h"

namespace shardrl::rollout {

// kHalf packs every projection and the head, tied or not, as forward-only kernels
// (models::LinearImpl::set_inference_kernel); kFloat unpacks. Any other dtype is an error naming
// it. The packed copies do not follow the weights: pack again after every weight sync. A forward
// with grad on a packed model is an error.
void pack_for_inference(models::LlamaForCausalLMImpl& model, torch::ScalarType dtype);

}  // namespace shardrl::rollout
