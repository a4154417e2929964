#include "shardrl/models/activation_checkpoint.h"

#include <torch/csrc/autograd/custom_function.h>

namespace shardrl::models {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Carries the block's forward to the backward; saved_data holds only IValues.
struct FnCapsule : torch::CustomClassHolder {
  explicit FnCapsule(CheckpointedFn f) : fn(std::move(f)) {}
  CheckpointedFn fn;
};

struct Checkpoint : public torch::autograd::Function<Checkpoint> {
  // Autograd runs this without grad: fn builds no graph and keeps no activations.
  static torch::Tensor forward(AutogradContext* ctx, at::TensorList inputs,
                               c10::intrusive_ptr<FnCapsule> capsule) {
    ctx->save_for_backward(variable_list(inputs.begin(), inputs.end()));
    auto out = capsule->fn(std::vector<torch::Tensor>(inputs.begin(), inputs.end()));
    ctx->saved_data["fn"] = c10::IValue::make_capsule(std::move(capsule));
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto capsule = c10::static_intrusive_pointer_cast<FnCapsule>(ctx->saved_data["fn"].toCapsule());
    std::vector<torch::Tensor> inputs;
    for (const auto& t : ctx->get_saved_variables()) {
      inputs.push_back(t.detach().requires_grad_(t.requires_grad()));
    }
    torch::Tensor out;
    {
      torch::AutoGradMode enable(true);
      out = capsule->fn(inputs);
    }
    // Accumulates into the params (the unit's unsharded grads) and the detached inputs.
    if (out.requires_grad()) torch::autograd::backward({out}, {grads[0]});
    variable_list input_grads;
    for (const auto& t : inputs)
      input_grads.push_back(t.requires_grad() ? t.grad() : torch::Tensor());
    input_grads.emplace_back();  // for the capsule
    return input_grads;
  }
};

}  // namespace

torch::Tensor checkpointed(CheckpointedFn fn, const std::vector<torch::Tensor>& inputs) {
  // Autograd records the checkpoint only when an input requires grad; without one (a LoRA block
  // behind frozen embeddings, say) the params inside would get no grads, so run fn plainly.
  bool any_requires_grad = false;
  for (const auto& t : inputs) any_requires_grad |= t.defined() && t.requires_grad();
  if (!torch::GradMode::is_enabled() || !any_requires_grad) return fn(inputs);
  return Checkpoint::apply(at::TensorList(inputs), c10::make_intrusive<FnCapsule>(std::move(fn)));
}

}  // namespace shardrl::models
