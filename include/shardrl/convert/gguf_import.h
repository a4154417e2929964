// `shardrl import`: a llama.cpp GGUF file as a Hugging Face model folder.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

namespace shardrl::convert {

// Converts a llama.cpp GGUF file of a LLaMA-architecture model into a Hugging Face folder that
// load_llama() and transformers read: safetensors in `dtype` with transformers' tensor names and
// rotary row layout (GGUF permutes q/k rows for llama.cpp), config.json, generation_config.json,
// tokenizer.json and tokenizer_config.json (with the file's chat template). Reads F32, F16, BF16,
// Q8_0, Q4_0 and Q4_1 tensors and GPT-2-style byte-level BPE tokenizers. A tensor missing, left
// over or of a shape the metadata disagrees with is an error naming it and the file. Returns the
// files written.
std::vector<std::string> import_gguf(const std::string& gguf_path, const std::string& out_dir,
                                     torch::ScalarType dtype = torch::kFloat);

}  // namespace shardrl::convert
