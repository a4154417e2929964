#!/bin/bash
# Before (46fd0a3: the token embedding's unit gathered again for backward, as FSDP2) vs after
# (6b8f04b: its backward reads no params and gathers nothing), interleaved, 6 rounds.
export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296
export OMP_WAIT_POLICY=PASSIVE
OUT=${OUT:-/tmp/exp-emb/out}; mkdir -p $OUT
M="--d-model 512 --layers 6 --heads 8 --vocab 8192 --seq 128 --steps 5 --warmup 2 --batch 8"
for r in 1 2 3 4 5 6; do
  for v in old new; do
    if [ $v = old ]; then B=/tmp/old/build/bin; else B=/work/main/build/bin; fi
    $B/shardrl launch -n 2 --threads 1 -- $B/bench_fsdp --mode fsdp $M --json-out $OUT/a_$v.r$r.json > $OUT/a_$v.r$r.log 2>&1
    $B/shardrl launch -n 2 --threads 1 -- $B/bench_fsdp --mode fsdp $M --no-host-shared-params --json-out $OUT/a5_$v.r$r.json > $OUT/a5_$v.r$r.log 2>&1
    $B/shardrl launch -n 2 --threads 1 -- $B/bench_fsdp --mode fsdp $M --no-reshard-after-forward --json-out $OUT/a2_$v.r$r.json > $OUT/a2_$v.r$r.log 2>&1
  done
done
