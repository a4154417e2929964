"""What bf16 weights would buy a CPU rollout: transformers' generate on a model directory, fp32, then
with every nn.Linear computing in bf16 weights (activations cast to bf16 and the output back to fp32),
same prompts, seed-free sampling, exactly --new-tokens tokens a row. One thread.

    python bench/rollout_bf16_weights.py --model runs/smollm2/model --batch 16 --new-tokens 32
"""
import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True)
parser.add_argument("--batch", type=int, default=16)
parser.add_argument("--new-tokens", type=int, default=32)
args = parser.parse_args()

torch.set_num_threads(1)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
ids = torch.randint(100, 1000, (args.batch, 40), generator=torch.Generator().manual_seed(0))


def seconds():
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                       max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                       pad_token_id=0)
    return time.perf_counter() - start


seconds()  # warm-up
fp32 = seconds()
for module in model.modules():
    if isinstance(module, torch.nn.Linear):
        weight = module.weight.detach().bfloat16()
        module.forward = lambda x, w=weight: F.linear(x.bfloat16(), w).float()
seconds()
bf16 = seconds()
print(json.dumps({"batch": args.batch, "new_tokens": args.new_tokens, "fp32_s": fp32,
                  "bf16_weights_s": bf16, "speedup": fp32 / bf16}))
