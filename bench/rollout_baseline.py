"""Rollout throughput: ShardRL's batched KV-cache sampling (build/bin/bench_rollout) against
transformers' generate on the same prompts, batch, token count and threads, in one run.

    python bench/rollout_baseline.py --model runs/smollm2/model --batch 16 --new-tokens 64
    python bench/rollout_baseline.py --model runs/smollm2/model --batch 16 --n 8 \
        --rollout-dtype float16 --stop --temperature 0.7 --new-tokens 80

The prompts are the lm_grpo task's: "What is A + B?" for seeded two-digit A, B, as a user turn of
the model's chat template (transformers' apply_chat_template), left-padded. --batch rows in all:
--batch / --n prompts, each sampled --n times (GRPO's rollout.n; transformers'
num_return_sequences). Without --stop both sides generate exactly --new-tokens tokens a row; with
it a row ends at the tokenizer's eos (<|im_end|> for SmolLM2), as the job's rollout does, and both
count each row's tokens up to and including its eos. --rollout-dtype is ShardRL's
rollout.dtype; transformers runs fp32. --lora-rank R gives ShardRL's model an unmerged rank-R
adapter on every projection, as the LoRA job's rollout carries it; transformers runs the bare
base model, so the adapter's cost counts against ShardRL only, unless --hf-lora gives it the same
adapter through PEFT, unmerged (the like-for-like rollout of a LoRA policy). One thread each unless --threads says otherwise. Prints one
JSON object with both results and their ratio of tokens/s (medians of --repeats runs after a
warm-up).
"""
import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--n", type=int, default=1)
parser.add_argument("--new-tokens", type=int, default=64)
parser.add_argument("--temperature", type=float, default=1.0)
parser.add_argument("--stop", action="store_true")
parser.add_argument("--rollout-dtype", default="float32", choices=["float32", "float16"])
parser.add_argument("--lora-rank", type=int, default=0)
parser.add_argument("--hf-lora", action="store_true",
                    help="give transformers the same adapter through PEFT, unmerged")
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--repeats", type=int, default=3)
parser.add_argument("--bin", default=os.path.join(os.path.dirname(__file__), "..", "build", "bin"))
args = parser.parse_args()
if args.batch % args.n != 0:
    sys.exit(f"--batch {args.batch} must be a multiple of --n {args.n}")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

torch.set_num_threads(args.threads)
tokenizer = AutoTokenizer.from_pretrained(args.model)
eos = tokenizer.eos_token_id if args.stop else -1
rng = random.Random(0)
rows = []
for _ in range(args.batch // args.n):
    question = f"What is {rng.randrange(10, 100)} + {rng.randrange(10, 100)}?"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, tokenize=True)
    rows.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
width = max(len(r) for r in rows)
input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])


def response_tokens(new):
    """Tokens of each row up to and including its first eos (all of them without one)."""
    if eos < 0:
        return new.numel()
    ended = (new == eos).int().cumsum(1)
    return int(((ended == 0) | ((ended == 1) & (new == eos))).sum())


model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
if args.hf_lora and args.lora_rank > 0:
    from peft import LoraConfig, get_peft_model  # noqa: E402
    model = get_peft_model(model, LoraConfig(
        r=args.lora_rank, lora_alpha=2 * args.lora_rank, lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj"])).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1e-3)  # a trained adapter's B, as bench_rollout sets it
hf_seconds, hf_tokens = [], []
with torch.no_grad():
    for r in range(args.repeats + 1):
        torch.manual_seed(r)
        start = time.perf_counter()
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=True,
                             temperature=args.temperature, top_p=1.0, top_k=0,
                             num_return_sequences=args.n, max_new_tokens=args.new_tokens,
                             min_new_tokens=0 if args.stop else args.new_tokens,
                             eos_token_id=eos if args.stop else None, pad_token_id=pad)
        elapsed = time.perf_counter() - start
        assert out.shape[0] == args.batch, out.shape
        if r > 0:
            hf_seconds.append(elapsed)
            hf_tokens.append(response_tokens(out[:, width:]))
hf = {"impl": "transformers", "lora_rank": args.lora_rank if args.hf_lora else 0,
      "batch": args.batch, "n": args.n, "prompt_width": width,
      "new_tokens": args.new_tokens, "eos_id": eos, "temperature": args.temperature,
      "threads": args.threads, "seconds": hf_seconds, "tokens": hf_tokens,
      "median_s": statistics.median(hf_seconds),
      "tokens_per_s": statistics.median(t / s for t, s in zip(hf_tokens, hf_seconds))}

with tempfile.TemporaryDirectory() as tmp:
    prompts = os.path.join(tmp, "prompts.json")
    with open(prompts, "w") as f:
        json.dump(rows, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    result = subprocess.run(
        [os.path.join(args.bin, "bench_rollout"), "--model", args.model, "--prompts", prompts,
         "--new-tokens", str(args.new_tokens), "--pad-id", str(pad), "--repeats",
         str(args.repeats), "--threads", str(args.threads), "--n", str(args.n),
         "--eos-id", str(eos), "--temperature", str(args.temperature),
         "--rollout-dtype", args.rollout_dtype, "--lora-rank", str(args.lora_rank)],
        env=env, check=True, capture_output=True, text=True)
    ours = json.loads(result.stdout.strip().splitlines()[-1])

print(json.dumps({"model": args.model, "shardrl": ours, "transformers": hf,
                  "ratio_tokens_per_s": ours["tokens_per_s"] / hf["tokens_per_s"]}))
sys.stdout.flush()
