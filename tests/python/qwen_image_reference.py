"""diffusers' QwenImageTransformer2DModel against ShardRL's (tests/test_qwen_image.cpp).

Every check prints one JSON line {"check": ..., "ok": bool, ...}; the script exits non-zero if any
failed, and a missing package (diffusers, peft, safetensors) is an import error, never a skip.
Outputs are compared in fp32 by max |a - b| / max(1, max |b|).

usage:
  qwen_image_reference.py pretrained OUT_DIR VARIANT
      a randomly initialised diffusers model (VARIANT small: heads of 16 dims, rotary axes
      (4, 6, 6); wide: 3 heads of 12 dims, axes (2, 4, 6), out_channels null) saved by
      save_pretrained into OUT_DIR (and OUT_DIR-sharded, in several files with
      diffusion_pytorch_model.safetensors.index.json), and OUT_DIR/io.safetensors: inputs and
      diffusers' outputs for each case of CASES (packed latents x_<case>, prompt_embeds, mask: a
      padded text mask with a hole, t: sigmas), and diffusers' rotary angles for ROPE_SHAPES
      (rope_image_cos, rope_image_sin, rope_text_cos, rope_text_sin) and the pipeline's packing
      (latents -> packed); for `small`, QwenImagePipeline's velocity of unpacked latents without
      and with true CFG (flow_velocities).
  qwen_image_reference.py check MODEL_DIR IO_FILE [LORA_DIR]
      MODEL_DIR (ShardRL's save_qwen_image) loads with from_pretrained and gives IO_FILE's `out`
      on its inputs; LORA_DIR (ShardRL's save_qwen_image_lora) loads with load_lora_adapter and
      gives `out_lora`.
  qwen_image_reference.py export BASE_DIR MERGED_DIR ADAPTER_DIR IO_FILE
      `shardrl export` of a Qwen-Image checkpoint with a LoRA adapter: BASE_DIR (the base
      weights) loads with from_pretrained and gives IO_FILE's `out`; MERGED_DIR (--merge-adapter)
      gives `out_lora`; ADAPTER_DIR (--adapter) on the base gives MERGED_DIR's output through
      diffusers' load_lora_adapter and through PEFT's PeftModel.from_pretrained.
  qwen_image_reference.py activations
      bytes autograd keeps per token of one dual-stream block of diffusers' model in fp32 (saved
      tensors, counted once each), per inner width, for the memory plan's estimate.

The io files' inputs for `check` and `export` are x, prompt_embeds, mask, t and img_shapes (an
int64 [images, 3] tensor), shared by every sample.
"""
import json
import sys

import torch
from diffusers import QwenImagePipeline, QwenImageTransformer2DModel
from safetensors.torch import load_file, save_file

from checks import failed, relative_error, report

TOLERANCE = 1e-5

VARIANTS = {
    "small": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=3,
                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=12,
                  axes_dims_rope=(4, 6, 6)),
    "wide": dict(patch_size=2, in_channels=12, out_channels=None, num_layers=2,
                 attention_head_dim=12, num_attention_heads=3, joint_attention_dim=20,
                 axes_dims_rope=(2, 4, 6)),
}

# img_shapes of each case, in patches: a non-square image; odd sides; the two images of an edit
# sequence (its second at frame position 1); the same without the text mask.
CASES = {
    "square": [(1, 4, 4)],
    "wide": [(1, 4, 6)],
    "odd": [(1, 5, 3)],
    "two_images": [(1, 4, 6), (1, 3, 3)],
}
ROPE_SHAPES = [(1, 5, 3), (2, 3, 4), (1, 7, 2)]
ROPE_TEXT = 9
TEXT_TOKENS = 7


def run(model, x, io, shapes, mask=True):
    batch = x.shape[0]
    with torch.no_grad():
        return model(hidden_states=x, encoder_hidden_states=io["prompt_embeds"],
                     encoder_hidden_states_mask=io["mask"] if mask else None, timestep=io["t"],
                     img_shapes=[list(shapes)] * batch, return_dict=False)[0]


def shapes_of(io):
    return [tuple(int(v) for v in row) for row in io["img_shapes"].tolist()]


def pretrained(out_dir, variant):
    torch.manual_seed(7)
    model = QwenImageTransformer2DModel(**VARIANTS[variant]).eval()
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
    mask = torch.ones(2, TEXT_TOKENS)
    mask[1, 4:] = 0  # padding at the end
    mask[1, 1] = 0  # and a hole: diffusers applies the mask element-wise
    io = {
        "prompt_embeds": torch.randn(2, TEXT_TOKENS, cfg.joint_attention_dim, generator=gen),
        "mask": mask,
        "t": torch.tensor([0.1375, 0.912]),
    }
    for case, shapes in CASES.items():
        tokens = sum(f * h * w for f, h, w in shapes)
        io[f"x_{case}"] = torch.randn(2, tokens, cfg.in_channels, generator=gen)
        io[f"out_{case}"] = run(model, io[f"x_{case}"], io, shapes)
    io["out_nomask"] = run(model, io["x_wide"], io, CASES["wide"], mask=False)
    # Rotary angles of several images (frames, odd sides) and text, as complex exponentials.
    image_freqs, text_freqs = model.pos_embed([ROPE_SHAPES], max_txt_seq_len=ROPE_TEXT,
                                              device=torch.device("cpu"))
    io["rope_image_cos"], io["rope_image_sin"] = image_freqs.real, image_freqs.imag
    io["rope_text_cos"], io["rope_text_sin"] = text_freqs.real, text_freqs.imag
    latents = torch.randn(2, 4, 6, 10, generator=gen)
    io["latents"] = latents
    io["packed"] = QwenImagePipeline._pack_latents(latents, 2, 4, 6, 10)
    if variant == "small":  # a latent model the pipeline packs (in_channels = 4 out_channels)
        flow_velocities(model, io, gen)
    save_file({k: v.contiguous() for k, v in io.items()}, f"{out_dir}/io.safetensors")
    print(json.dumps({"max_abs_out": io["out_wide"].abs().max().item()}))


def pipeline_velocity(model, latents, sigma, text, negative=None, true_cfg_scale=1.0):
    """QwenImagePipeline's velocity of [B, C, H, W] latents (its denoising loop's noise_pred,
    unpacked): packed latents, img_shapes (1, H / 2, W / 2), timestep / 1000 (the sigma), the
    prompt's mask, and true CFG rescaled to the conditional prediction's norm."""
    b, c, h, w = latents.shape
    packed = QwenImagePipeline._pack_latents(latents, b, c, h, w)

    def branch(embeds, mask):
        with torch.no_grad():
            return model(hidden_states=packed, encoder_hidden_states=embeds,
                         encoder_hidden_states_mask=mask, timestep=sigma,
                         img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)[0]

    noise_pred = branch(*text)
    if true_cfg_scale > 1:
        neg_noise_pred = branch(*negative)
        comb_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
        cond_norm = torch.norm(noise_pred, dim=-1, keepdim=True)
        noise_norm = torch.norm(comb_pred, dim=-1, keepdim=True)
        noise_pred = comb_pred * (cond_norm / noise_norm)
    vae_scale_factor = 8  # _unpack_latents takes pixel sides
    return QwenImagePipeline._unpack_latents(noise_pred, h * vae_scale_factor, w * vae_scale_factor,
                                             vae_scale_factor).squeeze(2)


def flow_velocities(model, io, gen):
    """The pipeline's velocity of unpacked latents, without and with true CFG (scale 3), for
    algos::flow_velocity: flow_latents [2, C, 6, 10], flow_sigma, a negative prompt's embeddings
    and mask (flow_negative_embeds, flow_negative_mask)."""
    cfg = model.config
    latents = torch.randn(2, cfg.out_channels, 6, 10, generator=gen)
    negative_mask = torch.zeros(2, TEXT_TOKENS)
    negative_mask[:, :2] = 1  # the empty prompt: [CLS] and [SEP]
    io["flow_latents"], io["flow_sigma"] = latents, torch.tensor([0.25, 0.8])
    io["flow_negative_embeds"] = torch.randn(2, TEXT_TOKENS, cfg.joint_attention_dim, generator=gen)
    io["flow_negative_mask"] = negative_mask
    text, negative = (io["prompt_embeds"], io["mask"]), (io["flow_negative_embeds"], negative_mask)
    io["flow_v"] = pipeline_velocity(model, latents, io["flow_sigma"], text)
    io["flow_v_cfg"] = pipeline_velocity(model, latents, io["flow_sigma"], text, negative, 3.0)


def check(model_dir, io_file, lora_dir=None):
    io = load_file(io_file)
    model = QwenImageTransformer2DModel.from_pretrained(model_dir).eval()
    out = run(model, io["x"], io, shapes_of(io))
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
    out_lora = run(model, io["x"], io, shapes_of(io))
    err = relative_error(io["out_lora"], out_lora)
    moved = relative_error(io["out"], out_lora)
    report("diffusers with ShardRL's LoRA: output", err <= TOLERANCE and moved > 1e-3, error=err,
           adapter_effect=moved)


def export(base_dir, merged_dir, adapter_dir, io_file):
    from peft import PeftModel

    io = load_file(io_file)
    shapes = shapes_of(io)
    base = QwenImageTransformer2DModel.from_pretrained(base_dir).eval()
    out = run(base, io["x"], io, shapes)
    err = relative_error(out, io["out"])
    report("diffusers loads the base export: output", out.shape == io["out"].shape and
           err <= TOLERANCE, error=err, max_abs=out.abs().max().item())

    merged = QwenImageTransformer2DModel.from_pretrained(merged_dir).eval()
    out_merged = run(merged, io["x"], io, shapes)
    err = relative_error(out_merged, io["out_lora"])
    moved = relative_error(out_merged, out)
    report("diffusers loads the merged export: output of the LoRA model", err <= TOLERANCE and
           moved > 1e-3, error=err, adapter_effect=moved)

    expected = json.load(open(f"{adapter_dir}/adapter_config.json"))
    with_lora = QwenImageTransformer2DModel.from_pretrained(base_dir).eval()
    with_lora.load_lora_adapter(adapter_dir, weight_name="adapter_model.safetensors",
                                prefix="base_model.model", adapter_name="trained")
    config = with_lora.peft_config["trained"]
    report("load_lora_adapter reads the adapter's config",
           config.r == expected["r"] and config.lora_alpha == expected["lora_alpha"] and
           set(config.target_modules) == set(expected["target_modules"]),
           r=config.r, lora_alpha=config.lora_alpha, target_modules=sorted(config.target_modules))
    err = relative_error(run(with_lora, io["x"], io, shapes), out_merged)
    report("diffusers' load_lora_adapter on the base: the merged output", err <= TOLERANCE,
           error=err)

    peft_model = PeftModel.from_pretrained(QwenImageTransformer2DModel.from_pretrained(base_dir),
                                           adapter_dir).eval()
    err = relative_error(run(peft_model, io["x"], io, shapes), out_merged)
    report("PEFT's PeftModel.from_pretrained on the base: the merged output", err <= TOLERANCE,
           error=err)


def activations():
    """Bytes one block keeps for backward per token, as multiples of the inner width (fp32)."""
    torch.manual_seed(0)
    dim_head, heads = 32, 4
    model = QwenImageTransformer2DModel(
        in_channels=16, out_channels=4, num_layers=1, attention_head_dim=dim_head,
        num_attention_heads=heads, joint_attention_dim=dim_head * heads,
        axes_dims_rope=(8, 12, 12)).train()
    block, inner = model.transformer_blocks[0], dim_head * heads

    def kept_bytes(image_side, text_tokens):
        image = torch.randn(1, image_side * image_side, inner, requires_grad=True)
        text = torch.randn(1, text_tokens, inner, requires_grad=True)
        temb = torch.randn(1, inner, requires_grad=True)
        rotary = model.pos_embed([[(1, image_side, image_side)]], max_txt_seq_len=text_tokens,
                                 device=torch.device("cpu"))
        seen, total = set(), 0

        def pack(t):
            nonlocal total
            key = (t.untyped_storage().data_ptr(), t.dtype)
            if key not in seen:
                seen.add(key)
                total += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out_text, out_image = block(image, text, None, temb, rotary)
        (out_text.sum() + out_image.sum()).backward()
        return total

    # The difference between two sequence lengths: what grows with the tokens (the weights and the
    # per-sample modulation cancel).
    small, large = kept_bytes(8, 16), kept_bytes(16, 16)
    per_token = (large - small) / (16 * 16 - 8 * 8)
    print(json.dumps({"bytes_per_token": per_token, "inner_dim": inner,
                      "inner_widths_fp32": per_token / (4 * inner)}))


def main():
    mode = sys.argv[1]
    if mode == "pretrained":
        pretrained(sys.argv[2], sys.argv[3])
    elif mode == "check":
        check(*sys.argv[2:5])
    elif mode == "export":
        export(*sys.argv[2:6])
    elif mode == "activations":
        activations()
    else:
        raise SystemExit(f"unknown mode {mode}")
    if failed:
        raise SystemExit(f"failed: {failed}")


if __name__ == "__main__":
    main()
