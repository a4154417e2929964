"""Checks the held-out scorer (eval_heldout.py) against ShardRL's own validation of the same adapter:
the accuracy ShardRL logged (metrics.jsonl's val/accuracy at the last step) and, answer by answer, the
greedy answers it logged to TensorBoard (trainer.log_val_generations, verl's "val/generations" text),
read with tensorboard's own reader.

    python bench/trl_grpo/compare_val.py --heldout shardrl.heldout.json --run RUN_DIR \
        --tensorboard TB_DIR [--out compare.json]

The two sides decode differently (ShardRL's rollout replica computes in fp16 weights with fp32
activations, transformers in fp32), so an argmax can flip where two tokens nearly tie; the report
counts the answers whose text differs and whose score differs, rather than asserting they are all
equal. A scorer that asked other problems, or scored them otherwise, disagrees on most.
"""
import argparse
import json
import re

parser = argparse.ArgumentParser()
parser.add_argument("--heldout", required=True, help="eval_heldout.py's JSON for ShardRL's adapter")
parser.add_argument("--run", required=True, help="ShardRL's trainer.default_local_dir")
parser.add_argument("--tensorboard", required=True, help="the run's TensorBoard folder")
parser.add_argument("--out", default=None)
args = parser.parse_args()

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

heldout = json.load(open(args.heldout))
metrics = [json.loads(line) for line in open(f"{args.run}/metrics.jsonl") if line.strip()]
logged = [m for m in metrics if "val/accuracy" in m]
last = max(logged, key=lambda m: m["step"])

events = EventAccumulator(args.tensorboard, size_guidance={"tensors": 0})
events.Reload()
# ShardRL's tag is verl's "val/generations"; torch's SummaryWriter would append "/text_summary".
tag = next(t for t in events.Tags()["tensors"] if t.startswith("val/generations"))
texts = {e.step: e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)}
text = texts[last["step"]]
sample = re.compile(r"\*\*Input:\*\* (.*?)\n\n\*\*Output:\*\* (.*?)\n\n\*\*Score:\*\* (\S+)\n",
                    re.S)
shardrl = {}
for prompt, output, score in sample.findall(text):
    q = re.search(r"What is \d+ \+ \d+\?", prompt)
    shardrl[q.group(0)] = {"output": output, "score": float(score)}

matched = [s for s in heldout["samples"] if s["question"] in shardrl]
same_text = sum(shardrl[s["question"]]["output"].strip() == s["output"].strip() for s in matched)
same_score = sum(shardrl[s["question"]]["score"] == s["score"] for s in matched)
report = {
    "step": last["step"],
    "shardrl_val_accuracy": last["val/accuracy"],
    "scorer_accuracy": heldout["accuracy"],
    "logged_answers": len(shardrl),
    "matched_questions": len(matched),
    "same_text": same_text,
    "same_score": same_score,
    "differing": [{"question": s["question"], "scorer": s["output"],
                   "shardrl": shardrl[s["question"]]["output"]}
                  for s in matched if shardrl[s["question"]]["score"] != s["score"]],
}
if args.out:
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
print(json.dumps({k: v for k, v in report.items() if k != "differing"}))
