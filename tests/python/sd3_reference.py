"""diffusers' SD3Transformer2DModel against ShardRL's (tests/test_sd3.cpp).

Every check prints one JSON line {"check": ..., "ok": bool, ...}; the script exits non-zero if any
failed, and a missing package (diffusers, peft, safetensors) is an import error, never a skip.
Outputs are compared in fp32 by max |a - b| / max(1, max |b|).

usage:
  sd3_reference.py pretrained OUT_DIR VARIANT
      a randomly initialised diffusers model (VARIANT sd3: plain; sd35: qk_norm rms_norm and
      dual_attention_layers; bench: bench_sd3's) saved by save_pretrained into OUT_DIR (and
      OUT_DIR-sharded, in several files with diffusion_pytorch_model.safetensors.index.json), and OUT_DIR/io.safetensors:
      inputs (x, prompt_embeds, pooled, t; x_wide a non-square latent) and diffusers' outputs
      (out, out_wide).
  sd3_reference.py check MODEL_DIR IO_FILE [LORA_DIR]
      MODEL_DIR (ShardRL's save_sd3) loads with from_pretrained and gives IO_FILE's `out` on its
      inputs; LORA_DIR (ShardRL's save_sd3_lora) loads with load_lora_adapter and gives
      `out_lora`.
  sd3_reference.py export BASE_DIR MERGED_DIR ADAPTER_DIR IO_FILE
      `shardrl export` of an SD3 checkpoint with a LoRA adapter: BASE_DIR (the base weights) loads
      with from_pretrained, holds diffusers' own position table and gives IO_FILE's `out`;
      MERGED_DIR (--merge-adapter) gives `out_lora`; ADAPTER_DIR (--adapter) on the base gives
      MERGED_DIR's output through diffusers' load_lora_adapter and through PEFT's
      PeftModel.from_pretrained.
  sd3_reference.py bench MODEL_DIR IO_FILE REPEATS
      median seconds of diffusers' forward + backward (sum of the output) on IO_FILE's inputs.
"""
import json
import sys
import time

import torch
from diffusers import SD3Transformer2DModel
from safetensors.torch import load_file, save_file

from checks import failed, relative_error, report

TOLERANCE = 1e-5

VARIANTS = {
    "sd3": dict(sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=8,
                num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=16,
                pooled_projection_dim=10, out_channels=4, pos_embed_max_size=12),
    "sd35": dict(sample_size=16, patch_size=2, in_channels=4, num_layers=3, attention_head_dim=16,
                 num_attention_heads=2, joint_attention_dim=12, caption_projection_dim=32,
                 pooled_projection_dim=10, out_channels=6, pos_embed_max_size=10,
                 dual_attention_layers=(0, 1), qk_norm="rms_norm"),
    # bench/bench_sd3.cpp's: SD3.5-style, 64 x 64 latents (1024 patches), 4 blocks of width 256.
    "bench": dict(sample_size=64, patch_size=2, in_channels=16, num_layers=4,
                  attention_head_dim=64, num_attention_heads=4, joint_attention_dim=384,
                  caption_projection_dim=256, pooled_projection_dim=384, out_channels=16,
                  pos_embed_max_size=32, dual_attention_layers=(0, 1), qk_norm="rms_norm"),
}


def run(model, io, x_key="x"):
    with torch.no_grad():
        return model(io[x_key], io["prompt_embeds"], io["pooled"], io["t"], return_dict=False)[0]


def pretrained(out_dir, variant):
    torch.manual_seed(7)
    model = SD3Transformer2DModel(**VARIANTS[variant]).eval()
    # Random init is nowhere zero or an identity (nn.Linear's defaults, RMSNorm weights moved).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight") and p.dim() == 1:
                p.normal_(1.0, 0.2)
    model.save_pretrained(out_dir)
    # The same weights split into several files with diffusers' sharded index.
    model.save_pretrained(out_dir + "-sharded", max_shard_size="40KB")
    cfg = model.config
    gen = torch.Generator().manual_seed(11)
    size, tokens = cfg.sample_size, 5 if variant != "bench" else 32
    io = {
        "x": torch.randn(2, cfg.in_channels, size, size, generator=gen),
        # size x 3/4 size latents: a non-square crop of the position table.
        "x_wide": torch.randn(2, cfg.in_channels, size, size * 3 // 4, generator=gen),
        "prompt_embeds": torch.randn(2, tokens, cfg.joint_attention_dim, generator=gen),
        "pooled": torch.randn(2, cfg.pooled_projection_dim, generator=gen),
        "t": torch.tensor([137.5, 912.0]),
    }
    io["out"] = run(model, io)
    io["out_wide"] = run(model, io, "x_wide")
    save_file({k: v.contiguous() for k, v in io.items()}, f"{out_dir}/io.safetensors")
    print(json.dumps({"max_abs_out": io["out"].abs().max().item()}))


def check(model_dir, io_file, lora_dir=None):
    io = load_file(io_file)
    model = SD3Transformer2DModel.from_pretrained(model_dir).eval()
    out = run(model, io)
    err = relative_error(io["out"], out)
    report("diffusers loads ShardRL's export: output", out.shape == io["out"].shape and
           err <= TOLERANCE, error=err, max_abs=out.abs().max().item())
    if lora_dir is None:
        return
    model.load_lora_adapter(lora_dir, weight_name="adapter_model.safetensors")
    config = model.peft_config["default_0"]
    expected = json.load(open(f"{lora_dir}/adapter_config.json"))
    report("load_lora_adapter reads the adapter's config",
           config.r == expected["r"] and config.lora_alpha == expected["lora_alpha"] and
           set(config.target_modules) == set(expected["target_modules"]),
           r=config.r, lora_alpha=config.lora_alpha, target_modules=sorted(config.target_modules))
    out_lora = run(model, io)
    err = relative_error(io["out_lora"], out_lora)
    moved = relative_error(io["out"], out_lora)
    report("diffusers with ShardRL's LoRA: output", err <= TOLERANCE and moved > 1e-3, error=err,
           adapter_effect=moved)


def export(base_dir, merged_dir, adapter_dir, io_file):
    from peft import PeftModel

    io = load_file(io_file)
    base = SD3Transformer2DModel.from_pretrained(base_dir).eval()
    out = run(base, io)
    err = relative_error(out, io["out"])
    report("diffusers loads the base export: output", out.shape == io["out"].shape and
           err <= TOLERANCE, error=err, max_abs=out.abs().max().item())
    # The table is no checkpoint tensor: the export computes it, diffusers computes its own.
    fresh = SD3Transformer2DModel.from_config(base.config).pos_embed.pos_embed
    err = relative_error(base.pos_embed.pos_embed, fresh)
    report("the export's pos_embed.pos_embed is diffusers' table", err <= 1e-6, error=err)

    merged = SD3Transformer2DModel.from_pretrained(merged_dir).eval()
    out_merged = run(merged, io)
    err = relative_error(out_merged, io["out_lora"])
    moved = relative_error(out_merged, out)
    report("diffusers loads the merged export: output of the LoRA model", err <= TOLERANCE and
           moved > 1e-3, error=err, adapter_effect=moved)

    expected = json.load(open(f"{adapter_dir}/adapter_config.json"))
    with_lora = SD3Transformer2DModel.from_pretrained(base_dir).eval()
    with_lora.load_lora_adapter(adapter_dir, weight_name="adapter_model.safetensors",
                                prefix="base_model.model", adapter_name="trained")
    config = with_lora.peft_config["trained"]
    report("load_lora_adapter reads the adapter's config",
           config.r == expected["r"] and config.lora_alpha == expected["lora_alpha"] and
           set(config.target_modules) == set(expected["target_modules"]),
           r=config.r, lora_alpha=config.lora_alpha, target_modules=sorted(config.target_modules))
    err = relative_error(run(with_lora, io), out_merged)
    report("diffusers' load_lora_adapter on the base: the merged output", err <= TOLERANCE,
           error=err)

    peft_model = PeftModel.from_pretrained(SD3Transformer2DModel.from_pretrained(base_dir),
                                           adapter_dir).eval()
    err = relative_error(run(peft_model, io), out_merged)
    report("PEFT's PeftModel.from_pretrained on the base: the merged output", err <= TOLERANCE,
           error=err)


def bench(model_dir, io_file, repeats):
    io = load_file(io_file)
    model = SD3Transformer2DModel.from_pretrained(model_dir).train()

    def step():
        model.zero_grad()
        model(io["x"], io["prompt_embeds"], io["pooled"], io["t"], return_dict=False)[0].sum().backward()

    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    print(json.dumps({"diffusers_median_seconds": sorted(times)[len(times) // 2],
                      "threads": torch.get_num_threads()}))


def main():
    mode = sys.argv[1]
    if mode == "pretrained":
        pretrained(sys.argv[2], sys.argv[3])
    elif mode == "check":
        check(*sys.argv[2:5])
    elif mode == "export":
        export(*sys.argv[2:6])
    elif mode == "bench":
        bench(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode}")
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
