#!/usr/bin/env python3
"""The update seconds a step of each variant of run.sh, its tokens, and the peak resident set.

    python3 bench/results/2026-11-29-remove-padding/summarize.py OUT > summary.json
"""
import json
import os
import statistics
import sys

out = sys.argv[1]
rows = {}
for name in ("padded", "packed", "padded_checkpointed", "packed_checkpointed"):
    path = os.path.join(out, name, "metrics.jsonl")
    if not os.path.exists(path):
        continue
    steps = [json.loads(line) for line in open(path) if line.strip()]
    steps = [s for s in steps if "time_update" in s]
    rows[name] = {
        "time_update": [s["time_update"] for s in steps],
        "median_time_update": statistics.median(s["time_update"] for s in steps),
        "step_time": [s["step_time"] for s in steps],
        "response_length": [s["response_length"] for s in steps],
        "memory_peak_rss_gb": max(s["memory_peak_rss_gb"] for s in steps),
        "loss": [s["loss"] for s in steps],
    }
if "padded" in rows:
    for name, row in rows.items():
        row["update_over_padded"] = row["median_time_update"] / rows["padded"]["median_time_update"]
        # Step 1 rolls out the same answers in every variant (same seed, same weights): its
        # update is the like-for-like comparison.
        row["step1_update_over_padded"] = row["time_update"][0] / rows["padded"]["time_update"][0]
json.dump(rows, sys.stdout, indent=2)
print()
