"""The reward table of bench/diffusion_algos.sh: one row per case from OUT_DIR/<case>/summary.json
and metrics.jsonl, as markdown, and every case's figures as OUT_DIR/summary.json.

usage: python bench/diffusion_algos_table.py OUT_DIR
"""
import json
import os
import sys


def main():
    out = sys.argv[1]
    rows, table = {}, []
    for case in sorted(os.listdir(out)):
        path = os.path.join(out, case, "summary.json")
        if not os.path.exists(path):
            continue
        s = json.load(open(path))
        # Steps only: line 0 is the evaluation before RL (trainer.val_before_train).
        metrics = [json.loads(line) for line in open(os.path.join(out, case, "metrics.jsonl"))]
        metrics = [m for m in metrics if "reward_mean" in m]
        diff = [m["rollout_corr/logprob_abs_diff_max"] for m in metrics
                if "rollout_corr/logprob_abs_diff_max" in m]
        rewards = [m["reward_mean"] for m in metrics]
        row = {
            "loss_mode": s["loss_mode"],
            "eval_reward": [s.get("eval_reward_before"), s["eval_reward_after"]],
            "eval_class_prob": [s.get("eval_class_prob_before"), s["eval_class_prob_after"]],
            "eval_realism": [s.get("eval_realism_before"), s["eval_realism_after"]],
            "eval_accuracy": [s.get("eval_accuracy_before"), s["eval_accuracy_after"]],
            "train_reward_first5": sum(rewards[:5]) / max(1, len(rewards[:5])),
            "train_reward_last5": sum(rewards[-5:]) / max(1, len(rewards[-5:])),
            "logprob_abs_diff_max": max(diff) if diff else None,
            "rl_seconds_per_step": s["rl_seconds_per_step"],
            "steps": len(metrics),
        }
        rows[case] = row
        fmt = lambda v: "-" if v is None else f"{v:.4f}"
        er, cp, re, acc = row["eval_reward"], row["eval_class_prob"], row["eval_realism"], row["eval_accuracy"]
        table.append(
            f"| {case} | {row['loss_mode']} | {fmt(er[0])} -> **{fmt(er[1])}** | {fmt(cp[0])} -> {fmt(cp[1])} | "
            f"{fmt(re[0])} -> {fmt(re[1])} | {fmt(acc[0])} -> {fmt(acc[1])} | "
            f"{'-' if row['logprob_abs_diff_max'] is None else row['logprob_abs_diff_max']} | "
            f"{row['rl_seconds_per_step']:.2f} |")
    print("| case | loss_mode | eval reward before -> after | p(class) | realism | classifier agrees | "
          "max logprob diff | s/step |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(table))
    json.dump(rows, open(os.path.join(out, "summary.json"), "w"), indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
