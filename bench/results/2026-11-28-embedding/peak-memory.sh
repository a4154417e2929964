#!/bin/bash
# Rank 0's peak CPU allocation over one profiled step (Kineto's [memory] events, profile_memory),
# before (46fd0a3) and after (6b8f04b), private unsharded copies, with and without
# reshard_after_forward. Writes peak-memory.json.
export OMP_WAIT_POLICY=PASSIVE
M="--d-model 512 --layers 6 --heads 8 --vocab 8192 --seq 128 --steps 1 --warmup 1 --batch 8"
HERE=$(cd "$(dirname "$0")" && pwd)
echo "{" > $HERE/peak-memory.json
for v in old new; do
  if [ $v = old ]; then B=/tmp/old/build/bin; else B=/work/main/build/bin; fi
  for reshard in --reshard-after-forward --no-reshard-after-forward; do
    $B/shardrl launch -n 2 --threads 1 -- $B/bench_fsdp --mode fsdp $M $reshard --no-host-shared-params \
      --profile-out /tmp/peak_$v$reshard.json --profile-steps 1 > /dev/null 2>&1
    python3 - "$v" "$reshard" /tmp/peak_$v$reshard.json >> $HERE/peak-memory.json <<'PY'
import json, sys
events = json.load(open(sys.argv[3]))["traceEvents"]
peak = max(e["args"].get("Total Allocated", 0) for e in events if e.get("name") == "[memory]")
print(f'  "{sys.argv[1]} {sys.argv[2]}": {peak},')
PY
  done
done
sed -i '$ s/,$//' $HERE/peak-memory.json; echo "}" >> $HERE/peak-memory.json
cat $HERE/peak-memory.json
