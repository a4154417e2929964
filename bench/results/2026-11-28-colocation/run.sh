#!/bin/bash
# perf samples of a (FSDP 2x1), b (1x1, batch 4) and b3 (two b in lock-step), 4 interleaved rounds,
# 12 timed steps after 1, at the model and settings of scripts/bench.sh. Writes perf data, JSON and
# logs into the current folder; then, there, python3 summarize.py and symbols.py of this folder.
set -eu
B=${B:-$(git -C "$(dirname "$0")" rev-parse --show-toplevel)/build/bin}
export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296
export OMP_WAIT_POLICY=PASSIVE
M="--d-model 512 --layers 6 --heads 8 --vocab 8192 --seq 128 --steps 12 --warmup 1"
for r in 1 2 3 4; do
  perf record -q -F 499 -o a.$r.data -- $B/shardrl launch -n 2 --threads 1 -- \
    $B/bench_fsdp --mode fsdp $M --batch 8 --json-out a.$r.json > a.$r.log 2>&1
  OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 perf record -q -F 499 -o b.$r.data -- \
    $B/bench_fsdp --mode local $M --batch 4 --threads 1 --json-out b.$r.json > b.$r.log 2>&1
  perf record -q -F 499 -o b3.$r.data -- $B/shardrl launch -n 2 --threads 1 -- \
    $B/bench_fsdp --mode lockstep $M --batch 8 --json-out b3.$r.json > b3.$r.log 2>&1
done
