"""The estimator table: held-out accuracy before -> after and the median seconds of each phase."""
import json
import statistics
import sys

out, estimators = sys.argv[1], sys.argv[2:]
phases = ["time_rollout", "time_values", "time_update_critic", "time_update"]
rows = {}
print("| estimator | accuracy before | at step 8 | after (16) | s/step | rollout | critic values "
      "| critic update | actor update |")
print("|---|---|---|---|---|---|---|---|---|")
for est in estimators:
    lines = [json.loads(line) for line in open(f"{out}/{est}/metrics.jsonl")]
    val = {m["step"]: m["val/accuracy"] for m in lines if "val/accuracy" in m}
    steps = [m for m in lines if "step_time" in m]
    median = {k: statistics.median(m.get(k, 0.0) for m in steps) for k in phases + ["step_time"]}
    rows[est] = {"val_accuracy": val, "median_seconds": median, "steps": len(steps)}
    print(f"| {est} | {val.get(0, float('nan')):.2f} | {val.get(8, float('nan')):.2f} "
          f"| {val.get(16, float('nan')):.2f} | {median['step_time']:.1f} | "
          + " | ".join(f"{median[k]:.1f}" if median[k] else "-" for k in phases) + " |")
json.dump(rows, open(f"{out}/table.json", "w"), indent=1)
