"""Real Hugging Face clients against what ShardRL writes and reads.

Every check prints one JSON line {"check": ..., "ok": bool, ...} and the script exits non-zero if
any failed. Logits are compared in fp32 by max |a - b| / max(1, max |b|).

usage:
  hf_clients.py exports SHARDRL BASE_DIR MERGED_DIR ADAPTER_DIR CKPT_DIR TOKENS YAML OVERRIDES
      the exported config.json is transformers' config for the model YAML's
      actor_rollout_ref.model.config (with OVERRIDES, a JSON object, over it); transformers loads ShardRL's base and merged exports, PEFT its adapter export; their logits
      and greedy tokens equal `shardrl generate` on the same directories; the safetensors library
      reads every .safetensors file under the checkpoint and the exports.
  hf_clients.py pretrained SHARDRL WORK_DIR
      transformers' save_pretrained of randomly initialised Llama / Qwen2 / Qwen3 / Llama 3.x
      models (several GQA ratios, tied and untied embeddings, head_dim unlike hidden / heads,
      Llama 3's RoPE scaling) loads in `shardrl generate`, with transformers' logits and greedy
      tokens; so does a PEFT LoRA adapter PEFT saved on top of each, with PEFT's.
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

import torch

from checks import failed, relative_error, report

TOLERANCE = 1e-5
NEW_TOKENS = 8


def shardrl_generate(shardrl, model_dir, tokens, adapter=None):
    """ShardRL's logits of `tokens` and its greedy continuation (no eos stop)."""
    with tempfile.TemporaryDirectory() as tmp:
        logits_path = os.path.join(tmp, "logits.safetensors")
        argv = [shardrl, "generate", model_dir, "--token-ids", ",".join(map(str, tokens)),
                "--max-new-tokens", str(NEW_TOKENS), "--eos-token-id", "-1",
                "--logits-out", logits_path]
        if adapter:
            argv += ["--adapter", adapter]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stdout}{done.stderr}")
        from safetensors.torch import load_file
        logits = load_file(logits_path)["logits"]
    return logits, [int(t) for t in done.stdout.split()]


def transformers_run(model, tokens):
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids).logits.float()
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return logits, out[0, len(tokens):].tolist()


def compare(check, ours, theirs):
    ours_logits, ours_tokens = ours
    their_logits, their_tokens = theirs
    err = relative_error(ours_logits, their_logits)
    report(check + " logits", ours_logits.shape == their_logits.shape and err <= TOLERANCE,
           error=err, shape=list(ours_logits.shape))
    report(check + " greedy tokens", ours_tokens == their_tokens, shardrl=ours_tokens,
           reference=their_tokens)


def check_safetensors_files(paths):
    from safetensors import safe_open
    for path in paths:
        try:
            with safe_open(path, framework="pt") as f:
                names = list(f.keys())
                for name in names:
                    tensor = f.get_tensor(name)
                    assert torch.isfinite(tensor.float()).all(), f"{name} is not finite"
            report("safetensors reads " + path, len(names) > 0, tensors=len(names))
        except Exception as e:  # noqa: BLE001 - any failure of the library is the finding
            report("safetensors reads " + path, False, error=str(e))


# The fields that shape the forward pass; vocab_size and token ids come from the task's tokenizer.
ARCHITECTURE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim",
                       "max_position_embeddings", "rms_norm_eps", "hidden_act",
                       "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_parameters")


def check_config(base_dir, yaml_path, overrides_json):
    """The exported config.json against transformers' own config class built from what the user
    wrote: a field ShardRL writes wrong, or a default it fills differently, shows here even when
    ShardRL and transformers both read the wrong value back consistently."""
    import yaml
    from transformers import AutoConfig
    with open(yaml_path) as f:
        written = yaml.safe_load(f)["actor_rollout_ref"]["model"]["config"]
    written.update(json.loads(overrides_json))
    model_type = written.pop("model_type", "llama")
    expected = AutoConfig.for_model(model_type, **written).to_dict()
    exported = AutoConfig.from_pretrained(base_dir).to_dict()
    differ = {k: [exported.get(k), expected.get(k)] for k in ARCHITECTURE_FIELDS
              if exported.get(k) != expected.get(k)}
    report("the exported config.json is transformers' config for the YAML's model config",
           not differ, differ=differ)


def exports(shardrl, base_dir, merged_dir, adapter_dir, ckpt_dir, tokens_csv, yaml_path,
            overrides_json):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    tokens = [int(t) for t in tokens_csv.split(",")]
    check_config(base_dir, yaml_path, overrides_json)

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    base_out = transformers_run(base, tokens)
    compare("transformers loads the base export", shardrl_generate(shardrl, base_dir, tokens),
            base_out)

    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    merged_out = transformers_run(merged, tokens)
    compare("transformers loads the merged export",
            shardrl_generate(shardrl, merged_dir, tokens), merged_out)

    peft_model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter_dir).eval()
    peft_out = transformers_run(peft_model, tokens)
    compare("PEFT loads the adapter export",
            shardrl_generate(shardrl, base_dir, tokens, adapter=adapter_dir), peft_out)
    # PEFT's base + adapter against transformers on the merged weights: the merge is PEFT's sum.
    err = relative_error(merged_out[0], peft_out[0])
    report("merged export equals PEFT's base + adapter", err <= TOLERANCE, error=err)
    # Without this the adapter checks above could pass with an adapter that does nothing.
    effect = relative_error(peft_out[0], base_out[0])
    report("the trained adapter changes the logits", effect > 100 * TOLERANCE, effect=effect)

    files = sorted(glob.glob(os.path.join(ckpt_dir, "**", "*.safetensors"), recursive=True))
    report("the checkpoint has safetensors shards", len(files) > 0, files=len(files))
    for d in (base_dir, merged_dir, adapter_dir):
        files += sorted(glob.glob(os.path.join(d, "*.safetensors")))
    check_safetensors_files(files)


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


def pretrained(shardrl, work_dir):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                              Qwen3Config, Qwen3ForCausalLM)
    common = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-6)
    theta = dict(rope_theta=10000.0)
    cases = {
        "llama, GQA, untied": (LlamaForCausalLM, LlamaConfig(
            tie_word_embeddings=False, **common, **theta)),
        "llama, tied, attention bias": (LlamaForCausalLM, LlamaConfig(
            tie_word_embeddings=True, attention_bias=True, **common, **theta)),
        "qwen2, GQA, tied": (Qwen2ForCausalLM, Qwen2Config(
            tie_word_embeddings=True, **common, **theta)),
        "qwen2, untied": (Qwen2ForCausalLM, Qwen2Config(
            tie_word_embeddings=False, **common, **theta)),
        # Qwen3: q/k norms per head; head_dim 12 and 16, not hidden 48 / 6 heads = 8.
        "qwen3, GQA 3:1, head_dim 12, tied": (Qwen3ForCausalLM, Qwen3Config(
            tie_word_embeddings=True, head_dim=12, rope_theta=1e6, **common)),
        "qwen3, GQA 6:1, head_dim 16, untied, attention bias": (Qwen3ForCausalLM, Qwen3Config(
            **{**common, "num_key_value_heads": 1}, head_dim=16, tie_word_embeddings=False,
            attention_bias=True)),
        # Llama 3.x: RoPE scaling (a context of 32 puts frequencies in all three of its bands).
        "llama3 rope, GQA 3:1, tied": (LlamaForCausalLM, LlamaConfig(
            tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE), **common)),
        "llama3 rope, no GQA, head_dim 16, untied": (LlamaForCausalLM, LlamaConfig(
            **{**common, "num_key_value_heads": 6}, head_dim=16, tie_word_embeddings=False,
            rope_parameters=dict(LLAMA3_ROPE))),
    }
    tokens = [3, 17, 45, 2, 88, 61, 9, 30, 30, 1, 72]
    for i, (name, (cls, config)) in enumerate(cases.items()):
        torch.manual_seed(i)
        model = cls(config).eval()
        # Random init draws small weights; larger ones make the logits (and a wrong op) show.
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0, 0.2)
        out_dir = os.path.join(work_dir, f"case{i}")
        model.save_pretrained(out_dir)
        base = transformers_run(model, tokens)
        compare(f"shardrl loads transformers' save_pretrained ({name})",
                shardrl_generate(shardrl, out_dir, tokens), base)
        # A LoRA adapter PEFT made and saved (B drawn non-zero, so it acts), read by ShardRL.
        torch.manual_seed(100 + i)
        peft_model = get_peft_model(
            cls.from_pretrained(out_dir, dtype=torch.float32),
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                          "gate_proj", "up_proj", "down_proj"]))
        with torch.no_grad():
            for n, p in peft_model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.2)
        adapter_dir = os.path.join(work_dir, f"case{i}-adapter")
        peft_model.save_pretrained(adapter_dir)
        peft_out = transformers_run(PeftModel.from_pretrained(
            cls.from_pretrained(out_dir, dtype=torch.float32), adapter_dir).eval(), tokens)
        compare(f"shardrl loads PEFT's save_pretrained adapter ({name})",
                shardrl_generate(shardrl, out_dir, tokens, adapter=adapter_dir), peft_out)
        effect = relative_error(peft_out[0], base[0])
        report(f"the PEFT adapter changes the logits ({name})", effect > 100 * TOLERANCE,
               effect=effect)


def main():
    torch.set_num_threads(1)
    mode = sys.argv[1]
    if mode == "exports":
        exports(*sys.argv[2:10])
    elif mode == "pretrained":
        pretrained(*sys.argv[2:4])
    else:
        raise SystemExit(__doc__)
    if failed:
        print(json.dumps({"failed": failed}))
        sys.exit(1)


if __name__ == "__main__":
    main()
