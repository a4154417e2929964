#!/usr/bin/env python3
"""Random-weight models at real published configs, written as a user's download is laid out.

transformers / diffusers build each model from its published config
(../shared/reference/published-configs.md) and write it with `save_pretrained`, so ShardRL loads
it through the user's path. The language models also get a tokenizer whose ids cover the whole
vocabulary (GPT-2's byte-level BPE, the family's special tokens at their published ids, fillers
between: no pretrained tokenizer can be downloaded here, and random weights sample every id) and
their family's chat template.

    python bench/make_real_models.py OUT [qwen2.5-1.5b] [qwen3-1.7b] [llama-3.2-1b] [sd3.5-medium]

Each model lands in OUT/<name>; one that is already there is kept. bf16 on disk, as published.
"""
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
GPT2_BPE = os.path.join(HERE, "..", "data", "gpt2-bpe")

QWEN_CHAT = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_CHAT = (
    "{{ '<|begin_of_text|>' }}{% for message in messages %}{{ '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

QWEN_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>"}
LLAMA3_SPECIALS = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>",
                   128006: "<|start_header_id|>", 128007: "<|end_header_id|>",
                   128009: "<|eot_id|>"}

# The published configs (published-configs.md), verbatim.
CONFIGS = {
    "qwen2.5-1.5b": {
        "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": 1536, "initializer_range": 0.02, "intermediate_size": 8960,
        "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
        "num_attention_heads": 12, "num_hidden_layers": 28, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936},
    "qwen3-1.7b": {
        "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
        "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936},
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 8192,
        "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
        "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
        "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_cache": True, "vocab_size": 128256},
    "sd3.5-medium": {
        "attention_head_dim": 64, "caption_projection_dim": 1536,
        "dual_attention_layers": list(range(13)), "in_channels": 16, "joint_attention_dim": 4096,
        "num_attention_heads": 24, "num_layers": 24, "out_channels": 16, "patch_size": 2,
        "pooled_projection_dim": 2048, "pos_embed_max_size": 384, "qk_norm": "rms_norm",
        "sample_size": 128},
}


def write_tokenizer(out, vocab_size, specials, chat_template, eos):
    """GPT-2's byte-level BPE with `specials` at their ids and fillers for every other id."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    with open(os.path.join(GPT2_BPE, "encoder.json")) as f:
        vocab = json.load(f)
    # GPT-2's own <|endoftext|> (50256) gives way to the family's specials, which the vocabulary
    # holds at their ids; marking them special (below) reuses those ids.
    vocab = {t: i for t, i in vocab.items() if t not in specials.values() and i not in specials}
    vocab.update({content: i for i, content in specials.items()})
    taken = set(vocab.values())
    for i in range(vocab_size):
        if i not in taken:
            vocab[f"<extra_{i}>"] = i  # plain printable text: decodes as itself
    with open(os.path.join(GPT2_BPE, "vocab.bpe")) as f:
        merges = [tuple(line.split()) for line in f.read().splitlines()[1:] if line]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(specials[i], special=True) for i in sorted(specials)])
    for i, content in specials.items():
        assert tok.token_to_id(content) == i, (content, tok.token_to_id(content), i)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": chat_template, "eos_token": specials[eos],
                   "pad_token": specials[eos], "tokenizer_class": "PreTrainedTokenizerFast"}, f,
                  indent=2)


def make_language_model(name, out):
    import transformers

    config = dict(CONFIGS[name])
    config_class = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
                    "llama": transformers.LlamaConfig}[config["model_type"]]
    model_class = getattr(transformers, config["architectures"][0])
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # as published; halves the builder's memory
    model = model_class(config_class(**config))
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    qwen = config["model_type"].startswith("qwen")
    write_tokenizer(out, config["vocab_size"], QWEN_SPECIALS if qwen else LLAMA3_SPECIALS,
                    QWEN_CHAT if qwen else LLAMA3_CHAT, config["eos_token_id"])
    return sum(p.numel() for p in model.parameters())


def make_sd3(name, out):
    import diffusers

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = diffusers.SD3Transformer2DModel(**CONFIGS[name])
    torch.set_default_dtype(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    root = sys.argv[1]
    names = sys.argv[2:] or list(CONFIGS)
    for name in names:
        if name not in CONFIGS:
            sys.exit(f"unknown model {name}; known: {', '.join(CONFIGS)}")
        out = os.path.join(root, name)
        if os.path.exists(os.path.join(out, "config.json")):
            print(f"{name}: kept {out}")
            continue
        tmp = out + ".tmp"
        os.makedirs(tmp, exist_ok=True)
        params = (make_sd3 if name.startswith("sd3") else make_language_model)(name, tmp)
        os.rename(tmp, out)
        print(json.dumps({"model": name, "dir": out, "params": params}))


if __name__ == "__main__":
    main()
