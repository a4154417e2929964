"""summary.json of bench/trl_grpo/run.sh: per side, the median seconds a step over the timed
steps (the first --warmup of each run left out) of all rounds, and of each round; the generation
and update parts; response tokens a step; reward mean; the ratio TRL / ShardRL.

    python bench/trl_grpo/summarize.py runs/trl_grpo --warmup 1

ShardRL's parts are its metrics.jsonl's time_rollout (weight sync + sampling) and time_update;
TRL's are its "transformers.generate" block and the rest of the step (scoring, the log-prob
passes, the 4 forward/backward micro-batches and the optimizer step).

With --accuracy (run.sh's accuracy mode) it prints instead the held-out greedy accuracy of the base
model and of each side's adapter (eval_heldout.py's JSONs), the scorer's agreement with ShardRL's own
validation (compare_val.json), each side's steps per second and the ratio ShardRL / TRL.
"""
import argparse
import glob
import json
import os
import re
import statistics

parser = argparse.ArgumentParser()
parser.add_argument("dir")
parser.add_argument("--warmup", type=int, default=1)
parser.add_argument("--accuracy", action="store_true",
                    help="run.sh's accuracy mode: held-out accuracy before and after, per side")
args = parser.parse_args()


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def side(impl):
    runs = {}
    for path in sorted(glob.glob(os.path.join(args.dir, f"{impl}.r*.json"))):
        r = int(re.search(r"\.r(\d+)\.json$", path).group(1))
        runs[r] = json.load(open(path))
    timed = []
    per_round = {}
    for r, run in sorted(runs.items()):
        steps = [s for s in run["steps"] if s["step"] > args.warmup]
        timed += steps
        per_round[f"r{r}"] = {"median_step_s": median([s["step_time"] for s in steps]),
                              "step_s": [round(s["step_time"], 3) for s in run["steps"]]}
    if impl == "shardrl":
        generate = [s.get("time_rollout") for s in timed]
        tokens = [s["response_length"] * 32 for s in timed]
    else:
        generate = [s.get("time_generate") for s in timed]
        tokens = [s.get("response_tokens") for s in timed]
    update = [s["step_time"] - g if g is not None else None for s, g in zip(timed, generate)]
    step = median([s["step_time"] for s in timed])
    return {
        "runs": len(runs),
        "timed_steps": len(timed),
        "processes_x_threads": f"{runs[min(runs)]['processes']}x{runs[min(runs)]['threads']}"
        if runs else None,
        "median_step_s": step,
        "median_generate_s": median(generate),
        "median_rest_of_step_s": median(update),
        "median_response_tokens_per_step": median(tokens),
        "median_s_per_1000_response_tokens": median(
            [1000 * s["step_time"] / t for s, t in zip(timed, tokens) if t]),
        "reward_mean_all_steps": statistics.mean(
            [s["reward_mean"] for run in runs.values() for s in run["steps"]]) if runs else None,
        "per_round": per_round,
    }


shardrl, trl = side("shardrl"), side("trl")
ratio = lambda key: (trl[key] / shardrl[key]  # noqa: E731
                     if trl.get(key) and shardrl.get(key) else None)
summary = {
    "warmup_steps_dropped": args.warmup,
    "shardrl": shardrl,
    "trl": trl,
    "ratio_trl_over_shardrl": {
        "step": ratio("median_step_s"),
        "generate": ratio("median_generate_s"),
        "rest_of_step": ratio("median_rest_of_step_s"),
        "s_per_1000_response_tokens": ratio("median_s_per_1000_response_tokens"),
    },
}
if args.accuracy:
    def accuracy(name):
        return json.load(open(os.path.join(args.dir, f"{name}.heldout.json")))["accuracy"]

    compare = json.load(open(os.path.join(args.dir, "compare_val.json")))
    steps_per_s = {k: 1 / v["median_step_s"] for k, v in (("shardrl", shardrl), ("trl", trl))}
    summary = {
        "held_out_accuracy": {"base": accuracy("base"), "shardrl": accuracy("shardrl"),
                              "trl": accuracy("trl")},
        "steps_per_s": steps_per_s,
        "speedup_shardrl_over_trl": steps_per_s["shardrl"] / steps_per_s["trl"],
        "median_step_s": {"shardrl": shardrl["median_step_s"], "trl": trl["median_step_s"]},
        "median_generate_s": {"shardrl": shardrl["median_generate_s"],
                              "trl": trl["median_generate_s"]},
        "scorer_vs_shardrl_validation": {k: v for k, v in compare.items() if k != "differing"},
        "timed_steps": {"shardrl": shardrl["timed_steps"], "trl": trl["timed_steps"]},
    }
print(json.dumps(summary, indent=1))
