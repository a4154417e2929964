#!/bin/bash
# Old wrap (root holds tok_emb, head) vs new (tok_emb, head units; head kept through backward).
export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296
export OMP_WAIT_POLICY=PASSIVE
OUT=/tmp/exp/out; mkdir -p $OUT
M="--d-model 512 --layers 6 --heads 8 --vocab 8192 --seq 128 --steps 5 --warmup 2 --batch 8"
for r in 1 2 3 4 5 6; do
  for v in old new; do
    if [ $v = old ]; then B=/tmp/old/build/bin; else B=/work/main/build/bin; fi
    $B/shardrl launch -n 2 --threads 1 -- $B/bench_fsdp --mode fsdp $M --json-out $OUT/a_$v.r$r.json > $OUT/a_$v.r$r.log 2>&1
    $B/shardrl launch -n 2 --threads 1 -- $B/bench_fsdp --mode fsdp $M --no-host-shared-params --json-out $OUT/a5_$v.r$r.json > $OUT/a5_$v.r$r.log 2>&1
  done
  B=/work/main/build/bin
  $B/shardrl launch -n 2 --threads 1 -- $B/bench_fsdp --mode lockstep $M --json-out $OUT/b3.r$r.json > $OUT/b3.r$r.log 2>&1
done
