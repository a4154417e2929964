#!/bin/bash
export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296
export OMP_WAIT_POLICY=PASSIVE
OUT=/tmp/exp/f; mkdir -p $OUT
PY=/root/.cache/shardrl/venv/bin/python
L="/work/main/build/bin/shardrl launch -n 2 --threads 1 --"
M="--d-model 512 --layers 6 --heads 8 --vocab 8192 --seq 128 --steps 5 --warmup 2 --batch 8 --threads 1"
for r in 1 2 3 4; do
  $L $PY /tmp/old/bench/torch_baseline.py --mode fsdp2 $M --json-out $OUT/f_old.r$r.json > $OUT/f_old.r$r.log 2>&1
  $L $PY /work/main/bench/torch_baseline.py --mode fsdp2 $M --json-out $OUT/f_new.r$r.json > $OUT/f_new.r$r.log 2>&1
done
