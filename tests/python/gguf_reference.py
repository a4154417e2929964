"""`shardrl import` of GGUF files against the gguf library (llama.cpp's gguf-py) and transformers.

Every check prints one JSON line {"check": ..., "ok": bool, ...} and the script exits non-zero if
any failed. Logits are compared in fp32 by max |a - b| / max |b|.

usage:
  gguf_reference.py synthetic SHARDRL WORK_DIR
      a tiny LLaMA written by gguf.GGUFWriter in each of F32, F16, BF16, Q8_0, Q4_0 and Q4_1
      (GQA, tied and untied embeddings, attention biases in one) is imported by SHARDRL: every tensor
      equals gguf.quants.dequantize of the stored data with llama.cpp's q/k row permutation undone
      (bit for bit), config.json is transformers' config of the GGUF, and transformers on the GGUF,
      transformers on the import and `shardrl generate` on the import give the same logits and
      greedy tokens; the tokenizer and chat template come through.
  gguf_reference.py broken WORK_DIR
      writes the damaged files tests/test_gguf.cpp feeds to `shardrl import` (a good one, one per
      fault) and prints {"cuts": {...}}: offsets inside the good file's header, metadata, tensor
      table and tensor data, where the test truncates it.
  gguf_reference.py smollm2 SHARDRL GGUF IMPORT_DIR
      the real model: transformers on GGUF against `shardrl generate` on IMPORT_DIR (SHARDRL's
      import of it): logits, greedy tokens, the chat prompt with and without a system message, and
      transformers' loading of IMPORT_DIR (model and tokenizer).
"""
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from checks import failed, report

THREADS = 1  # on a busy two-core machine a second torch thread is several times slower


def relative_error(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# ---- the synthetic model -----------------------------------------------------------------------

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 64, 4, 2, 256, 2  # FFN: a Q6_K row holds 256 elements
HEAD_DIM = HIDDEN // HEADS
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "a n", "Ġ c", "Ġc a", "Ġca t"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a tiny test model<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def bytes_to_unicode():
    """GPT-2's byte -> printable character table, the alphabet of a byte-level BPE vocabulary."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) +
          list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def vocabulary():
    """Special tokens (CONTROL), the 256 byte characters, then one token per merge (NORMAL)."""
    tokens = SPECIALS + bytes_to_unicode() + [m.replace(" ", "") for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types


def hf_weights(vocab, untied, bias, seed):
    """Random weights in transformers' names and layout."""
    rng = np.random.default_rng(seed)

    def normal(*shape, mean=0.0):
        return (mean + 0.2 * rng.standard_normal(shape)).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(vocab, HIDDEN),
         "model.norm.weight": normal(HIDDEN, mean=1.0)}
    if untied:
        w["lm_head.weight"] = normal(vocab, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = normal(HIDDEN, mean=1.0)
        w[p + "post_attention_layernorm.weight"] = normal(HIDDEN, mean=1.0)
        w[p + "self_attn.q_proj.weight"] = normal(HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.k_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.v_proj.weight"] = normal(KV_HEADS * HEAD_DIM, HIDDEN)
        w[p + "self_attn.o_proj.weight"] = normal(HIDDEN, HEADS * HEAD_DIM)
        w[p + "mlp.gate_proj.weight"] = normal(FFN, HIDDEN)
        w[p + "mlp.up_proj.weight"] = normal(FFN, HIDDEN)
        w[p + "mlp.down_proj.weight"] = normal(HIDDEN, FFN)
        if bias:
            # transformers' LlamaConfig.attention_bias (llama.cpp's optional bq, bk, bv, bo).
            for proj, rows in (("q", HEADS * HEAD_DIM), ("k", KV_HEADS * HEAD_DIM),
                               ("v", KV_HEADS * HEAD_DIM), ("o", HIDDEN)):
                w[p + f"self_attn.{proj}_proj.bias"] = normal(rows)
    return w


def gguf_name(hf):
    """convert_hf_to_gguf.py's tensor names for LLaMA."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    block = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    _, _, layer, rest = hf.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{block[module]}.{kind}"


def heads_of(hf):
    """The heads whose rows llama.cpp interleaves in this tensor, or None."""
    if ".q_proj." in hf:
        return HEADS
    if ".k_proj." in hf:
        return KV_HEADS
    return None


def llama_cpp_permute(w, heads):
    """convert_hf_to_gguf.py's LlamaModel.permute: transformers' rotate-half rows per head to
    llama.cpp's interleaved pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def reverse_permute(w, heads):
    """Its inverse, as transformers' LlamaTensorProcessor._reverse_permute_weights."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(
        w.shape)


def tensor_type(qtype, ndim):
    """A file's type for a tensor: llama.cpp keeps 1-D tensors in F32 unless the file is 16-bit."""
    import gguf
    Q = gguf.GGMLQuantizationType
    return qtype if ndim == 2 or qtype in (Q.F32, Q.F16, Q.BF16) else Q.F32


def stored(array, qtype):
    """The bytes (or float array) and raw dtype GGUFWriter.add_tensor takes for `qtype`."""
    import gguf
    if qtype == gguf.GGMLQuantizationType.F32:
        return array.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array, qtype), qtype


def write_gguf(path, weights, qtype, *, metadata=None, drop=(), types=None, vocab_size=None):
    """A llama.cpp-style GGUF of `weights` (transformers' layout): q/k rows permuted, 2-D tensors
    (and 1-D ones in F16 / BF16 files) in `qtype`, 1-D tensors of quantized files in F32 as
    llama.cpp keeps them. `metadata` overrides keys, `drop` leaves tensors (GGUF names) out,
    `types` sets the type of single tensors (GGUF name -> type; Q6_K, which gguf-py cannot
    quantize, gets random bytes of its size)."""
    import gguf
    Q = gguf.GGMLQuantizationType
    tokens, token_types = vocabulary()
    meta = {
        "llama.block_count": LAYERS, "llama.context_length": 128,
        "llama.embedding_length": HIDDEN, "llama.feed_forward_length": FFN,
        "llama.attention.head_count": HEADS, "llama.attention.head_count_kv": KV_HEADS,
        "llama.rope.dimension_count": HEAD_DIM, "llama.rope.freq_base": 50000.0,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        "llama.vocab_size": vocab_size or len(tokens),
        "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.padding_token_id": 2, "tokenizer.ggml.unknown_token_id": 0,
    }
    meta.update(metadata or {})
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("ShardRL GGUF test model")
    for key, value in meta.items():
        if isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(MERGES)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for hf, array in weights.items():
        name = gguf_name(hf)
        if name in drop:
            continue
        if heads_of(hf):
            array = llama_cpp_permute(array, heads_of(hf))
        t = (types or {}).get(name, tensor_type(qtype, array.ndim))
        if t == Q.Q6_K:  # gguf-py does not quantize to it
            block, size = gguf.GGML_QUANT_SIZES[t]
            raw = np.random.default_rng(0).integers(
                0, 256, (array.shape[0], array.shape[1] // block * size), dtype=np.uint8)
            w.add_tensor(name, raw, raw_dtype=t)
        else:
            data, raw_dtype = stored(array, t)
            w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def dequantized_from_file(path):
    """GGUF tensor name -> gguf-py's reading and dequantization of it, in torch's dim order."""
    import gguf
    reader = gguf.GGUFReader(path)
    by_gguf = {}
    for t in reader.tensors:
        by_gguf[t.name] = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type),
                                     dtype=np.float32).reshape(tuple(reversed(t.shape.tolist())))
    return by_gguf


def run(argv, timeout=300):
    # A tiny random model's text need not be valid UTF-8.
    done = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stdout}"
                           f"{done.stderr}")
    return done.stdout


def shardrl_generate(shardrl, model_dir, prompt_args, new_tokens, eos=None):
    """ShardRL's prompt logits and printed continuation; prompt_args e.g. ["--token-ids", "1,2"]."""
    from safetensors.torch import load_file
    with tempfile.TemporaryDirectory() as tmp:
        logits_path = os.path.join(tmp, "logits.safetensors")
        argv = [shardrl, "generate", model_dir, *prompt_args, "--max-new-tokens",
                str(new_tokens), "--logits-out", logits_path]
        if eos is not None:
            argv += ["--eos-token-id", str(eos)]
        out = run(argv)
        return load_file(logits_path)["logits"], out


def token_ids(encoding):
    """apply_chat_template's ids: a list, or a BatchEncoding's input_ids (transformers 5)."""
    return list(encoding["input_ids"] if hasattr(encoding, "keys") else encoding)


def transformers_run(model, tokens, new_tokens):
    """Prompt logits and `new_tokens` greedy tokens with no stop at EOS."""
    import torch
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids).logits.float()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return logits, out[0, len(tokens):].tolist()


def same_value(a, b):
    """Config values equal, floats as the float32 the GGUF stores: transformers' GGUF reader
    widens 1e-5 to 9.999999747378752e-06, ShardRL writes the shortest decimal, 1e-05."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and \
            np.float32(a) == np.float32(b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    return a == b


ARCHITECTURE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads", "num_key_value_heads", "head_dim",
                       "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                       "vocab_size", "rope_parameters", "bos_token_id", "eos_token_id",
                       "pad_token_id")


def synthetic(shardrl, work_dir):
    import gguf
    import torch
    torch.set_num_threads(THREADS)
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    Q = gguf.GGMLQuantizationType
    tokens, _ = vocabulary()
    prompt = [1, 40, 75, 3, 260, 2, 200, 17, 259, 101, 44]
    cases = [  # type, untied embeddings, attention biases (transformers' GGUF LLaMA has none)
        (Q.F32, True, False), (Q.F16, False, False), (Q.BF16, True, False),
        (Q.Q8_0, False, False), (Q.Q4_0, True, False), (Q.Q4_1, False, False),
        (Q.Q8_0, True, True)]
    for i, (qtype, untied, bias) in enumerate(cases):
        label = qtype.name + (", untied" if untied else ", tied") + (", biases" if bias else "")
        weights = hf_weights(len(tokens), untied, bias, seed=i)
        name = f"tiny-{i}-{qtype.name}.gguf"
        path = os.path.join(work_dir, name)
        write_gguf(path, weights, qtype)
        out_dir = os.path.join(work_dir, f"import-{i}-{qtype.name}")
        run([shardrl, "import", path, out_dir])

        # The reference: gguf-py's dequantization of what the file holds, permutation undone here.
        from_file = dequantized_from_file(path)
        expected = {}
        for hf in weights:
            w = from_file[gguf_name(hf)]
            expected[hf] = reverse_permute(w, heads_of(hf)) if heads_of(hf) else w
        # The un-permute is llama.cpp's permute undone: quantizing rows commutes with reordering
        # them, so the reference equals the HF-layout weights quantized directly.
        def quantized_directly(w):
            t = tensor_type(qtype, w.ndim)
            return np.asarray(gguf.quants.dequantize(stored(w, t)[0], t),
                              dtype=np.float32).reshape(w.shape)

        sane = all(np.array_equal(expected[hf], quantized_directly(w))
                   for hf, w in weights.items())
        report(f"{label}: the reference un-permute inverts llama.cpp's permute", sane)

        imported = {}
        for f in sorted(os.listdir(out_dir)):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(out_dir, f), framework="np") as st:
                    for key in st.keys():
                        imported[key] = st.get_tensor(key)
        differ = sorted(hf for hf in expected if hf not in imported or
                        imported[hf].dtype != np.float32 or
                        not np.array_equal(imported[hf], expected[hf]))
        report(f"{label}: every imported tensor is gguf-py's dequantization, bit for bit",
               not differ and set(imported) == set(expected), differ=differ,
               extra=sorted(set(imported) - set(expected)))

        if qtype in (Q.F16, Q.BF16):
            # A 16-bit file imported in its own dtype keeps its bits.
            dtype = {Q.F16: "fp16", Q.BF16: "bf16"}[qtype]
            out16 = out_dir + "-" + dtype
            run([shardrl, "import", path, out16, "--dtype", dtype])
            torch_dtype = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
            differ16 = []
            for f in sorted(os.listdir(out16)):
                if f.endswith(".safetensors"):
                    with safe_open(os.path.join(out16, f), framework="pt") as st:
                        for key in st.keys():
                            t = st.get_tensor(key)
                            if t.dtype != torch_dtype or not torch.equal(
                                    t, torch.from_numpy(expected[key]).to(torch_dtype)):
                                differ16.append(key)
            report(f"{label}: --dtype {dtype} keeps the file's bits", not differ16,
                   differ=differ16)

        on_import = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
        from_import = transformers_run(on_import, prompt, 8)
        if bias:
            # transformers' GGUF loader drops LLaMA attention biases; its reading of the import
            # (config.json's attention_bias) is the reference.
            report(f"{label}: config.json has attention_bias",
                   on_import.config.attention_bias is True)
            reference = from_import
        else:
            gguf_config = AutoConfig.from_pretrained(work_dir, gguf_file=name).to_dict()
            ours = AutoConfig.from_pretrained(out_dir).to_dict()
            differ = {k: [ours.get(k), gguf_config.get(k)] for k in ARCHITECTURE_FIELDS
                      if not same_value(ours.get(k), gguf_config.get(k))}
            report(f"{label}: config.json is transformers' config of the GGUF", not differ,
                   differ=differ)
            on_gguf = AutoModelForCausalLM.from_pretrained(
                work_dir, gguf_file=name, dtype=torch.float32).eval()
            reference = transformers_run(on_gguf, prompt, 8)
            err = relative_error(from_import[0], reference[0])
            report(f"{label}: transformers gives the import the GGUF's logits and tokens",
                   err <= 1e-6 and from_import[1] == reference[1], error=err,
                   tokens=from_import[1], reference=reference[1])
        logits, out = shardrl_generate(shardrl, out_dir,
                                       ["--token-ids", ",".join(map(str, prompt))], 8, eos=-1)
        ours_tokens = [int(t) for t in out.split()]
        err = relative_error(logits, reference[0])
        report(f"{label}: shardrl generate on the import gives transformers' logits and tokens",
               logits.shape == reference[0].shape and err <= 1e-5 and ours_tokens == reference[1],
               error=err, tokens=ours_tokens, reference=reference[1])

        if i == 0:
            check_tokenizer(shardrl, work_dir, name, out_dir, AutoTokenizer)


def check_tokenizer(shardrl, gguf_dir, gguf_file, out_dir, AutoTokenizer):
    """The import's tokenizer.json and chat template against transformers' reading of the GGUF."""
    theirs = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    ours = AutoTokenizer.from_pretrained(out_dir)
    texts = ["the cat in the hat", " can an otter?\n\n  ok", "<|im_start|>user\nhé 日本<|im_end|>"]
    for text in texts:
        a, b = ours.encode(text), theirs.encode(text)
        report(f"the imported tokenizer.json encodes {text!r} as the GGUF's", a == b, ours=a,
               reference=b)
    for system in (None, "Be brief."):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": "the cat"}]
        ids = token_ids(theirs.apply_chat_template(messages, add_generation_prompt=True))
        imported = token_ids(ours.apply_chat_template(messages, add_generation_prompt=True))
        report(f"the import's chat template renders as the GGUF's (system: {system})",
               imported == ids, ours=imported, reference=ids)
        chat_args = ["--chat", "the cat"] + (["--system", system] if system else [])
        chat_logits, _ = shardrl_generate(shardrl, out_dir, chat_args, 1)
        ids_logits, _ = shardrl_generate(shardrl, out_dir,
                                         ["--token-ids", ",".join(map(str, ids))], 1)
        report(f"shardrl generate --chat prompts with transformers' chat template ids "
               f"(system: {system})", torch_equal(chat_logits, ids_logits),
               shape=list(chat_logits.shape), reference_tokens=len(ids))


def torch_equal(a, b):
    import torch
    return a.shape == b.shape and torch.equal(a, b)


# ---- damaged files -----------------------------------------------------------------------------

def broken(work_dir):
    import gguf
    Q = gguf.GGMLQuantizationType
    tokens, _ = vocabulary()
    weights = hf_weights(len(tokens), untied=False, bias=False, seed=0)
    good = os.path.join(work_dir, "good.gguf")
    write_gguf(good, weights, Q.Q8_0)
    faults = {
        "q5_0": dict(types={"blk.0.attn_v.weight": Q.Q5_0}),
        "q6_k": dict(types={"blk.1.ffn_down.weight": Q.Q6_K}),
        "missing": dict(drop={"blk.1.ffn_down.weight"}),
        # One key changed: the head size it implies disagrees with rope.dimension_count.
        "embedding_length": dict(metadata={"llama.embedding_length": 2 * HIDDEN}),
        "head_count": dict(metadata={"llama.attention.head_count": 2 * HEADS}),
        # The key and rope.dimension_count changed together: only the tensors disagree.
        "embedding_length_and_rope": dict(metadata={"llama.embedding_length": 2 * HIDDEN,
                                                    "llama.rope.dimension_count": 2 * HEAD_DIM}),
        "head_count_and_rope": dict(metadata={"llama.attention.head_count": 2 * HEADS,
                                              "llama.rope.dimension_count": HEAD_DIM // 2}),
        "head_count_kv": dict(metadata={"llama.attention.head_count_kv": 2 * KV_HEADS}),
        "feed_forward_length": dict(metadata={"llama.feed_forward_length": 2 * FFN}),
        "block_count": dict(metadata={"llama.block_count": LAYERS + 1}),
        "vocab_size": dict(vocab_size=len(tokens) + 5),
    }
    for name, fault in faults.items():
        write_gguf(os.path.join(work_dir, name + ".gguf"), weights, Q.Q8_0, **fault)
    # Where the good file's regions lie (offsets of the fields gguf-py read).
    reader = gguf.GGUFReader(good)
    tokens_field = reader.fields["tokenizer.ggml.tokens"]
    third = reader.tensors[2]
    cuts = {
        "header": 13,  # inside tensor_count
        "metadata": tokens_field.offset + 1000,  # inside the token list
        "tensor table": third.field.offset + 7,  # inside the third tensor's name
        "tensor data": int(reader.tensors[-1].data_offset) + 5,  # inside the last tensor
        "last byte": os.path.getsize(good) - 1,
    }
    assert cuts["metadata"] < third.field.offset < reader.tensors[0].data_offset
    print(json.dumps({"cuts": cuts, "size": os.path.getsize(good)}), flush=True)


# ---- SmolLM2 -----------------------------------------------------------------------------------

def smollm2(shardrl, gguf_path, import_dir):
    import torch
    torch.set_num_threads(THREADS)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    started = time.time()
    gguf_dir, gguf_file = os.path.split(gguf_path)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file,
                                                 dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    loaded = time.time()
    question = "What is the capital of France?"
    new_tokens = 20
    for system in (None, "You are a geography teacher. Answer in one sentence."):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}]
        ids = token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        logits, tokens = transformers_run(model, ids, new_tokens)
        ours_logits, out = shardrl_generate(
            shardrl, import_dir, ["--token-ids", ",".join(map(str, ids))], new_tokens, eos=-1)
        ours_tokens = [int(t) for t in out.split()]
        err = relative_error(ours_logits, logits)
        report(f"SmolLM2 (system: {system}): shardrl generate's logits are transformers' on the "
               f"GGUF within 1e-4", ours_logits.shape == logits.shape and err <= 1e-4, error=err,
               shape=list(ours_logits.shape))
        report(f"SmolLM2 (system: {system}): {new_tokens} greedy tokens are transformers'",
               ours_tokens == tokens, shardrl=ours_tokens, reference=tokens)

        # --chat renders the prompt transformers' apply_chat_template does: the same ids give
        # the same logits bit for bit, other ids (or another count) do not.
        chat_args = ["--chat", question] + (["--system", system] if system else [])
        chat_logits, answer = shardrl_generate(shardrl, import_dir, chat_args, 64)
        report(f"SmolLM2 (system: {system}): shardrl generate --chat prompts with "
               f"apply_chat_template's ids", torch_equal(chat_logits, ours_logits),
               shape=list(chat_logits.shape), reference_tokens=len(ids))
        with torch.no_grad():
            ids_t = torch.tensor([ids])
            generated = model.generate(ids_t, attention_mask=torch.ones_like(ids_t),
                                       max_new_tokens=64, do_sample=False)
        reference = tokenizer.decode(generated[0, len(ids):], skip_special_tokens=True)
        report(f"SmolLM2 (system: {system}): the --chat answer is transformers'",
               answer.strip() == reference.strip(), shardrl=answer.strip(),
               reference=reference.strip())

        if system is None:
            # transformers reads the import: the model gives the GGUF's logits, the tokenizer
            # (tokenizer.json + tokenizer_config.json) the GGUF's ids.
            on_import = AutoModelForCausalLM.from_pretrained(import_dir,
                                                             dtype=torch.float32).eval()
            with torch.no_grad():
                import_logits = on_import(torch.tensor([ids])).logits.float()
            err = relative_error(import_logits, logits)
            report("SmolLM2: transformers on the import gives the GGUF's logits", err <= 1e-6,
                   error=err)
            del on_import
    imported_tokenizer = AutoTokenizer.from_pretrained(import_dir)
    for system in (None, "Be brief."):
        messages = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question}]
        a = token_ids(imported_tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        b = token_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        report(f"SmolLM2: the import's tokenizer renders the chat as the GGUF's (system: "
               f"{system})", a == b, ours=a, reference=b)
    for text in ["Hello, world! It's 3.14 — naïve café 日本語\n\n\tdone  ",
                 "<|im_start|>user\nhi<|im_end|>", "   leading spaces and trailing   "]:
        a, b = imported_tokenizer.encode(text), tokenizer.encode(text)
        report(f"SmolLM2: the import's tokenizer encodes {text!r} as the GGUF's", a == b,
               ours=a, reference=b)
    print(json.dumps({"timing": {"transformers_load_s": round(loaded - started, 1),
                                 "total_s": round(time.time() - started, 1)}}), flush=True)


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode == "synthetic" and len(sys.argv) == 4:
        synthetic(*sys.argv[2:4])
    elif mode == "broken" and len(sys.argv) == 3:
        broken(sys.argv[2])
    elif mode == "smollm2" and len(sys.argv) == 5:
        smollm2(*sys.argv[2:5])
    else:
        raise SystemExit(__doc__)
    if failed:
        print(json.dumps({"failed": failed}))
        sys.exit(1)


if __name__ == "__main__":
    main()
