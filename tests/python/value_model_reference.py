"""transformers' AutoModelForTokenClassification (num_labels 1), verl's critic, against ShardRL's
value model (engine model_type value_model).

usage:
  value_model_reference.py actor OUT_DIR MODEL_TYPE
      a randomly initialised <MODEL_TYPE>ForCausalLM (llama, qwen2 or qwen3), save_pretrained to
      OUT_DIR: the actor's folder the critic is made from, as verl makes it.
  value_model_reference.py values EXPORT_DIR ACTOR_DIR TOKENS_CSV MASK_CSV ROWS OUT_FILE
      AutoModelForTokenClassification.from_pretrained(EXPORT_DIR) (ShardRL's `shardrl export` of
      a value-model checkpoint): one label, every decoder tensor equal to ACTOR_DIR's; writes its
      values [ROWS, T] of the tokens (left padding per MASK_CSV) to OUT_FILE as safetensors.
"""
import os
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file


def actor(out_dir, model_type):
    torch.manual_seed(5)
    common = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  tie_word_embeddings=False)
    config = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
    }[model_type](**common)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out_dir, safe_serialization=True)


def values(export_dir, actor_dir, tokens_csv, mask_csv, rows, out_file):
    model = transformers.AutoModelForTokenClassification.from_pretrained(export_dir).eval()
    assert model.config.num_labels == 1, model.config.num_labels
    assert type(model).__name__.endswith("ForTokenClassification"), type(model).__name__
    exported = load_file(os.path.join(export_dir, "model.safetensors")) if os.path.exists(
        os.path.join(export_dir, "model.safetensors")) else None
    actor_weights = {}
    # "-": a critic that trained, whose decoder is no longer the actor's.
    for name in sorted(os.listdir(actor_dir)) if actor_dir != "-" else []:
        if name.endswith(".safetensors"):
            actor_weights.update(load_file(os.path.join(actor_dir, name)))
    state = model.state_dict()
    for name, tensor in actor_weights.items():
        if name.startswith("model."):
            assert torch.equal(state[name], tensor), f"decoder tensor {name} differs from the actor's"
    assert "lm_head.weight" not in state
    del exported
    tokens = torch.tensor([int(t) for t in tokens_csv.split(",")]).view(rows, -1)
    mask = torch.tensor([int(t) for t in mask_csv.split(",")]).view(rows, -1)
    # HF's position_ids for left padding, as ShardRL counts them.
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=tokens, attention_mask=mask, position_ids=position_ids).logits
    save_file({"values": out.squeeze(-1).float().contiguous()}, out_file)


def main():
    if sys.argv[1] == "actor":
        actor(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "values":
        values(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]), sys.argv[7])
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]}")


if __name__ == "__main__":
    main()
