"""Held-out greedy accuracy of the SmolLM2 GRPO job, scored the same way for both trainers: transformers
loads the model folder, PEFT puts on the adapter a trainer exported (ShardRL's `shardrl export
--adapter default`, TRL's `save_pretrained`), and each of the data.val_size held-out problems is asked
as a user turn of the chat template and answered greedily.

    python bench/trl_grpo/eval_heldout.py --model runs/smollm2/model [--adapter DIR] \
        --val-size 50 --seed 0 --out heldout.json

Greedy, at most 80 new tokens, stopping at the eos (<|im_end|>), as lm_grpo validates
(rollout.response_length; validation takes the argmax). An answer is right when its last integer is
the sum (job.last_integer, written from algos::parse_last_integer). Writes the accuracy and, per
problem, the question, the answer text and its score, so that compare_val.py can set them beside the
answers ShardRL logged.
"""
import argparse
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="the model folder `shardrl import` wrote")
parser.add_argument("--adapter", default=None, help="a PEFT adapter folder; none: the base model")
parser.add_argument("--val-size", type=int, default=50, help="data.val_size")
parser.add_argument("--seed", type=int, default=0, help="trainer.seed")
parser.add_argument("--max-new-tokens", type=int, default=80, help="rollout.response_length")
parser.add_argument("--batch-size", type=int, default=25)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--out", required=True)
args = parser.parse_args()

import torch  # noqa: E402

torch.set_num_threads(args.threads)

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from job import held_out_problems, last_integer, question  # noqa: E402

tokenizer = AutoTokenizer.from_pretrained(args.model)
tokenizer.padding_side = "left"  # batched greedy decoding: every prompt ends where answers begin
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
if args.adapter:
    from peft import PeftModel

    model = PeftModel.from_pretrained(model, args.adapter)
model.eval()

problems = held_out_problems(args.val_size, args.seed)
samples = []
for begin in range(0, len(problems), args.batch_size):
    batch = problems[begin:begin + args.batch_size]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": question(a, b)}],
                                             tokenize=False, add_generation_prompt=True)
               for a, b, _ in batch]
    inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**inputs, do_sample=False, max_new_tokens=args.max_new_tokens,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    for (a, b, s), row in zip(batch, out[:, inputs["input_ids"].shape[1]:]):
        text = tokenizer.decode(row, skip_special_tokens=True)
        samples.append({"question": question(a, b), "answer": s, "output": text,
                        "score": 1.0 if last_integer(text) == s else 0.0})

result = {"model": args.model, "adapter": args.adapter, "val_size": args.val_size,
          "seed": args.seed, "accuracy": sum(x["score"] for x in samples) / len(samples),
          "samples": samples}
os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps({"adapter": args.adapter, "accuracy": result["accuracy"]}))
