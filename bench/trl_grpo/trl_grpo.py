"""TRL's GRPOTrainer on the job `shardrl train examples/configs/smollm2_grpo.yaml` runs, as closely
as TRL allows, timed a step: the baseline of bench/trl_grpo/run.sh.

    python bench/trl_grpo/trl_grpo.py --model runs/smollm2/model --steps 6 --threads 2 \
        --out runs/trl_grpo/trl.json

The job (examples/configs/smollm2_grpo.yaml and src/trainer/lm_grpo.cpp):
- the model folder `shardrl import` writes (SmolLM2-135M-Instruct, fp32), loaded by transformers;
- prompts: two-digit addition "What is A + B?" as a user turn of the model's chat template, the same
  problems in the same order as ShardRL draws them with trainer.seed 0 (its std::mt19937_64 stream
  is reproduced below; the --val-size held-out problems of data.val_size are skipped as ShardRL
  skips them), 4 prompts a step (data.train_batch_size) x 8 answers (rollout.n; TRL's
  num_generations);
- reward 1 when the last integer of the answer equals the sum (algos::parse_last_integer);
- temperature 0.7, top_p 1, at most 80 new tokens, stop at the eos (<|im_end|>);
- LoRA r 16, alpha 32, no dropout, on the 7 projections; AdamW lr 2e-4 constant, no weight decay,
  gradient norm clipped at 1; clip 0.2 (TRL's epsilon); no KL (beta 0: no reference model);
  advantages normalised by the group's std (scale_rewards "group"); token-mean loss (TRL's "dapo",
  normalised by the active tokens of the whole batch);
- one optimizer step a batch: the 32 answers are generated at once, then 4 micro-batches of 8
  (ShardRL's ppo_micro_batch_size_per_gpu) accumulate into one step (num_iterations 1, so the old
  log-probs are the current policy's, detached, as in ShardRL's fp16-rollout path);
- no gradient checkpointing (TRL's GRPO default turns it on; the job has it off);
- fp32 on the CPU, one process with --threads intra-op threads.

Each step is timed from a TrainerCallback's on_step_begin to its on_step_end (generation, scoring,
the 4 forward/backward passes and the optimizer step); the generation part is TRL's own
"transformers.generate" profiling block, recorded by wrapping trl.extras.profiling.ProfilingContext.
Writes one JSON object (--out) with the per-step seconds, generation seconds, tokens and rewards;
--adapter-out saves the trained adapter, which eval_heldout.py scores as it scores ShardRL's.
"""
import argparse
import json
import os
import platform
import sys
import time

parser = argparse.ArgumentParser()
parser.add_argument("--model", required=True, help="the model folder `shardrl import` wrote")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--threads", type=int, default=2)
parser.add_argument("--out", required=True)
parser.add_argument("--work-dir", default=None, help="TRL's output_dir (nothing is saved there)")
parser.add_argument("--seed", type=int, default=0, help="ShardRL's trainer.seed: picks the problems")
parser.add_argument("--adapter-out", default=None,
                    help="save the trained LoRA adapter here (PEFT's folder) for eval_heldout.py")
parser.add_argument("--val-size", type=int, default=50,
                    help="ShardRL's data.val_size: the held-out problems the training draws skip")
args = parser.parse_args()

import torch  # noqa: E402

torch.set_num_threads(args.threads)

import datasets  # noqa: E402
import peft  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
import trl.extras.profiling as trl_profiling  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from job import (MICRO_BATCH, NUM_GENERATIONS, PROMPTS_PER_STEP, last_integer,  # noqa: E402
                 question, training_problems)


def exact_sum(completions, answer, **_):
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        rewards.append(1.0 if last_integer(text) == int(expected) else 0.0)
    return rewards


rows = []
for step in range(1, args.steps + 1):
    for a, b, s in training_problems(step, args.seed, args.val_size):
        rows.append({"prompt": [{"role": "user", "content": question(a, b)}],
                     "answer": str(s)})
dataset = datasets.Dataset.from_list(rows)

# TRL's generation block, as its own profiling names it; recorded here (TRL logs it only to
# wandb, mlflow or trackio).
generation_seconds = []
_log_metrics = trl_profiling.ProfilingContext._log_metrics


def _record(self, duration):
    if self.name.endswith(".transformers.generate"):
        generation_seconds.append(duration)
    return _log_metrics(self, duration)


trl_profiling.ProfilingContext._log_metrics = _record


class StepTimer(TrainerCallback):
    def __init__(self):
        self.seconds = []
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.seconds.append(time.perf_counter() - self._start)


tokenizer = AutoTokenizer.from_pretrained(args.model)
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
                  target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                  "down_proj"])
config = GRPOConfig(
    output_dir=args.work_dir or os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl_out"),
    max_steps=args.steps,
    per_device_train_batch_size=MICRO_BATCH,
    gradient_accumulation_steps=PROMPTS_PER_STEP * NUM_GENERATIONS // MICRO_BATCH,
    num_generations=NUM_GENERATIONS,
    num_iterations=1,
    max_completion_length=80,
    temperature=0.7,
    top_p=1.0,
    top_k=0,
    gradient_checkpointing=False,  # TRL's GRPO default is True; the job checkpoints nothing
    learning_rate=2e-4,
    lr_scheduler_type="constant",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=1.0,
    optim="adamw_torch",
    beta=0.0,
    epsilon=0.2,
    loss_type="dapo",
    scale_rewards="group",
    shuffle_dataset=False,  # step s trains on ShardRL's step-s problems
    use_cpu=True,
    bf16=False,
    fp16=False,
    seed=args.seed,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    log_completions=False,
    dataloader_num_workers=0,
    disable_tqdm=True,
)
timer = StepTimer()
trainer = GRPOTrainer(model=model, reward_funcs=exact_sum, args=config, train_dataset=dataset,
                      processing_class=tokenizer, peft_config=lora, callbacks=[timer])
wall_start = time.perf_counter()
trainer.train()
wall = time.perf_counter() - wall_start
if args.adapter_out:
    trainer.model.save_pretrained(args.adapter_out)

logs = [h for h in trainer.state.log_history if "reward" in h]
steps = []
for i, seconds in enumerate(timer.seconds):
    h = logs[i] if i < len(logs) else {}
    length = h.get("completions/mean_length")
    steps.append({
        "step": i + 1,
        "step_time": seconds,
        "time_generate": generation_seconds[i] if i < len(generation_seconds) else None,
        "reward_mean": h.get("reward"),
        "response_length": length,
        "response_tokens": length * PROMPTS_PER_STEP * NUM_GENERATIONS if length else None,
        "clipped_ratio": h.get("completions/clipped_ratio"),
        "loss": h.get("loss"),
        "grad_norm": h.get("grad_norm"),
    })
result = {
    "impl": "trl",
    "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                 "peft": peft.__version__, "torch": torch.__version__,
                 "python": platform.python_version()},
    "model": args.model,
    "threads": torch.get_num_threads(),
    "processes": 1,
    "steps": steps,
    "wall_s": wall,
    "log_history": trainer.state.log_history,
}
os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
print(json.dumps({k: result[k] for k in ("impl", "threads", "wall_s")} |
                 {"step_time": [round(s["step_time"], 3) for s in steps]}))
