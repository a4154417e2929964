// LoRA with several named adapters on one frozen base, as RL tuning needs: "default" is trained,
// "old" (the NFT behaviour policy) follows it by EMA, and disabling adapters gives the reference.
//
// Models declare their projections as LoraLinear, which is a models::Linear (torch::nn::Linear's
// "weight" and "bias" names and output; built empty under fsdp::EmptyInit) until an adapter is
// added. Adapters are always allocated and initialised, EmptyInit or not. Adapter params are named
// as PEFT names them, `<module>.lora_A.<adapter>.weight` [r, in] and
// `<module>.lora_B.<adapter>.weight` [out, r], so they travel with the base through fully_shard
// like any other param.
//
//   lora::LoraConfig config{.r = 8, .alpha = 16, .target_modules = {"q_proj", "v_proj"}};
//   lora::apply_lora(*model, config, "default");                      // freezes everything else
//   lora::apply_lora(*model, config, "old", /*trainable=*/false);
//   fsdp::fully_shard(...);                                           // adapters exist by now
//   { lora::DisableAdapters ref(*model); ref_logits = model(x); }     // the reference policy
//   lora::ema_update(model.fsdp().sharded_parameters(), "old", "default", 0.99);
//
// Adapters must be added before fully_shard(): FSDP takes the set of params when it shards.
#pragma once

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "shardrl/checkpoint.h"
#include "shardrl/fsdp.h"
#include "shardrl/models/layers.h"

namespace shardrl::models::lora {

struct LoraConfig {
  int64_t r = 8;
  double alpha = 16.0;  // the adapter output is scaled by alpha / r
  double dropout = 0.0;
  // A module is a target when its qualified name equals an entry or ends with "." + entry
  // (PEFT's rule), or when it fully matches target_regex.
  std::vector<std::string> target_modules;
  std::string target_regex;
  double scaling() const { return alpha / static_cast<double>(r); }
  // "q_proj, v_proj" or "regex <target_regex>", for errors.
  std::string describe_targets() const;
};

// Whether a module of this qualified name carries the adapter (target_modules' rule above).
bool is_target(const LoraConfig& config, const std::string& module_name);

// A linear layer whose frozen base weight can carry named low-rank adapters.
class LoraLinearImpl : public LinearImpl {
 public:
  using LinearImpl::LinearImpl;

  // base(x) + scaling * B(A(dropout(x))) for the active adapter unless disabled or merged. The
  // adapter path runs in the adapters' dtype and is cast back, so a bf16 base can carry fp32
  // adapters.
  torch::Tensor forward(const torch::Tensor& input);

  // A is initialised as nn.Linear (kaiming uniform), B with zeros: the output is unchanged. The
  // base weight and bias are frozen. The first adapter added becomes the active one.
  void add_adapter(const std::string& name, const LoraConfig& config, bool trainable = true);
  bool has_adapter(const std::string& name) const { return adapters_.count(name) > 0; }
  std::vector<std::string> adapter_names() const;
  void set_active_adapter(const std::string& name);
  const std::string& active_adapter() const { return active_; }
  void set_adapters_disabled(bool disabled) { disabled_ = disabled; }
  bool adapters_disabled() const { return disabled_; }
  const LoraConfig& adapter_config(const std::string& name) const;
  torch::Tensor lora_A(const std::string& name) const { return adapter(name).a; }
  torch::Tensor lora_B(const std::string& name) const { return adapter(name).b; }

  // Folds scaling * B A of the adapter into the base weight (for export or faster inference);
  // unmerge subtracts it again. While merged, the forward skips the adapter path.
  void merge(const std::string& name);
  void unmerge();
  const std::string& merged_adapter() const { return merged_; }

 private:
  struct Adapter {
    LoraConfig config;
    torch::Tensor a, b;
  };
  const Adapter& adapter(const std::string& name) const;

  std::map<std::string, Adapter> adapters_;
  torch::nn::Module* a_holder_ = nullptr;  // "lora_A": one child per adapter holding "weight"
  torch::nn::Module* b_holder_ = nullptr;
  std::string active_, merged_;
  bool disabled_ = false;
};
TORCH_MODULE(LoraLinear);

// Whether a param name is an adapter tensor ("...lora_A.<adapter>.weight" or lora_B).
bool is_adapter_tensor(const std::string& name);
// Whether it is an adapter's B matrix ("...lora_B.<adapter>.weight"), which LoRA+ steps faster.
bool is_lora_b_tensor(const std::string& name);

// scaling * B A: what an adapter adds to the base weight.
torch::Tensor delta_weight(const torch::Tensor& a, const torch::Tensor& b, double scaling);

// Every LoraLinear below `model` (itself included), with its qualified name.
std::vector<std::pair<std::string, LoraLinearImpl*>> lora_linears(torch::nn::Module& model);

// Adds adapter `name` to every LoraLinear the config targets, then freezes every param of the
// model that is not an adapter param of a trainable adapter. Returns the qualified names of the
// targeted modules; errors when nothing matches.
std::vector<std::string> apply_lora(torch::nn::Module& model, const LoraConfig& config,
                                    const std::string& name, bool trainable = true);

// Selects the adapter of every LoraLinear that has it; errors when none has it.
void set_active_adapter(torch::nn::Module& model, const std::string& name);

// Scoped "use adapter X": restores every LoraLinear's previous adapter and disabled flag on exit.
class UseAdapter {
 public:
  UseAdapter(torch::nn::Module& model, const std::string& name);
  ~UseAdapter();
  UseAdapter(const UseAdapter&) = delete;
  UseAdapter& operator=(const UseAdapter&) = delete;

 private:
  struct Saved {
    LoraLinearImpl* layer;
    std::string active;
    bool disabled;
  };
  std::vector<Saved> saved_;
  friend class DisableAdapters;
};

// Scoped "disable adapters": the model computes its base output (the reference policy).
class DisableAdapters {
 public:
  explicit DisableAdapters(torch::nn::Module& model);
  ~DisableAdapters();
  DisableAdapters(const DisableAdapters&) = delete;
  DisableAdapters& operator=(const DisableAdapters&) = delete;

 private:
  std::vector<UseAdapter::Saved> saved_;
};

// Adapter tensors are found by name, so the same code serves a plain model (its params) and a
// sharded one (its fp32 master shards: both adapters shard on the same rows, and copy and EMA are
// element-wise, so updating shards is the update of the full tensors).
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;
NamedTensors named_tensors(torch::nn::Module& model);
NamedTensors named_tensors(const std::vector<fsdp::ShardedParameter>& shards);

// dst <- src, for every adapter tensor of `dst` (errors name the tensor without a counterpart).
void copy_adapter(const NamedTensors& tensors, const std::string& dst, const std::string& src);
// dst <- decay * dst + (1 - decay) * src.
void ema_update(const NamedTensors& tensors, const std::string& dst, const std::string& src,
                double decay);

// The base state dict with adapter `name` merged in (scaling from `config`) and every adapter
// tensor dropped: from full params (e.g. FSDPModule::full_parameters()) to a plain checkpoint.
std::map<std::string, torch::Tensor> merged_state_dict(
    const std::map<std::string, torch::Tensor>& params, const std::string& name,
    const LoraConfig& config);

// Adapter `name` alone with PEFT tensor names (`base_model.model.<module>.lora_A.weight`) and
// the matching adapter_config.json.
std::map<std::string, torch::Tensor> peft_state_dict(
    const std::map<std::string, torch::Tensor>& params, const std::string& name);
std::string peft_adapter_config(const LoraConfig& config, const std::string& base_model = "");
// The PEFT name of adapter `name`'s tensor `param`, or nullopt when it is no tensor of that
// adapter.
std::optional<std::string> peft_name(const std::string& param, const std::string& name);
// The config back from adapter_config.json's fields; errors name `where`.
LoraConfig config_from_peft(const nlohmann::json& peft, const std::string& where);
// An adapter_config.json file (PEFT's save_pretrained, `shardrl export --adapter`); errors name
// the file.
LoraConfig read_peft_config(const std::string& path);

// ---- adapter-only export: PEFT's adapter_model.safetensors + adapter_config.json ---------------
// The weights file also carries the config in its header, as diffusers reads it: diffusers models
// load an export with load_lora_adapter(dir, weight_name="adapter_model.safetensors",
// prefix="base_model.model").

constexpr const char* kPeftWeightsFile = "adapter_model.safetensors";
constexpr const char* kPeftConfigFile = "adapter_config.json";

// Adds a PEFT adapter directory (adapter_config.json + adapter_model.safetensors, as PEFT's
// save_pretrained or `shardrl export --adapter` write them) to `model` as adapter `name`, active.
// A tensor the model has no place for, or an adapter tensor the file lacks, is an error naming
// the file and the tensor. Call before sharding.
void load_peft_adapter(torch::nn::Module& model, const std::string& dir,
                       const std::string& name = "default");

// From a sharded checkpoint, reading one tensor at a time. The adapter's config is the PEFT JSON
// the training run saved in the checkpoint's extra as {"lora": {name: peft_adapter_config(...)}}.
// Returns the files written.
std::vector<std::string> export_peft_adapter(const std::string& ckpt_dir,
                                             const std::string& out_dir, const std::string& name,
                                             torch::ScalarType dtype = torch::kFloat);

// The Hugging Face export of a checkpoint trained with adapters (checkpoint::export_hf): the base
// weights without any adapter tensor, so transformers loads them as a plain model; with
// `merge_adapter`, that adapter is folded into its base weights first (W + alpha / r * B A, the
// scaling from the checkpoint's extra.lora.<name>). Returns the files written.
std::vector<std::string> export_base(const std::string& ckpt_dir, const std::string& out_dir,
                                     const std::string& merge_adapter = "",
                                     checkpoint::ExportOptions options = {});

// Collective over model.mesh(): from a live sharded model, gathering one adapter tensor at a time
// (base params are not gathered); the mesh's rank 0 writes.
void export_peft_adapter(const fsdp::FSDPModule& model, const LoraConfig& config,
                         const std::string& name, const std::string& out_dir,
                         torch::ScalarType dtype = torch::kFloat,
                         const std::string& base_model = "");

}  // namespace shardrl::models::lora
