#!/usr/bin/env bash
# a, b, b2 interleaved, N rounds
set -e
BIN=${BIN:-/work/main/build/bin}
OUT=${OUT:-/tmp/ab/out}
N=${N:-6}
mkdir -p $OUT
export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296
export OMP_WAIT_POLICY=PASSIVE
M="--d-model 512 --layers 6 --heads 8 --vocab 8192 --seq 128 --steps 5 --warmup 2"
for r in $(seq 1 $N); do
  $BIN/shardrl launch -n 2 --threads 1 -- $BIN/bench_fsdp --mode fsdp $M --batch 8 $EXTRA_A --json-out $OUT/a.r$r.json 2>&1 | grep median
  env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $BIN/bench_fsdp --mode local $M --batch 4 --threads 1 --json-out $OUT/b.r$r.json | grep median
  $BIN/shardrl launch -n 2 --threads 1 -- $BIN/bench_fsdp --mode lockstep $M --batch 8 --json-out $OUT/b3.r$r.json 2>&1 | grep median
  for p in 0 1; do env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $BIN/bench_fsdp --mode local $M --batch 4 --threads 1 --json-out $OUT/b2p$p.r$r.json >/dev/null & done; wait
done
/root/.cache/shardrl/venv/bin/python - $OUT $N <<'PY'
import json,sys,statistics as st
o,n=sys.argv[1],int(sys.argv[2])
L=lambda f: json.load(open(f"{o}/{f}.json"))["median_step_s"]
a=[L(f"a.r{r}") for r in range(1,n+1)]; b=[L(f"b.r{r}") for r in range(1,n+1)]
b3=[L(f"b3.r{r}") for r in range(1,n+1)]
b2=[max(L(f"b2p0.r{r}"),L(f"b2p1.r{r}")) for r in range(1,n+1)]
print("a ",["%.3f"%x for x in a]); print("b ",["%.3f"%x for x in b]); print("b2",["%.3f"%x for x in b2])
print("b3",["%.3f"%x for x in b3]); print("per-round a/b3",["%.3f"%(x/y) for x,y in zip(a,b3)])
print("median a/b3 %.4f  b3/b %.4f  b3/b2 %.4f"%(st.median(a)/st.median(b3), st.median(b3)/st.median(b), st.median(b3)/st.median(b2)))
print("per-round a/b",["%.3f"%(x/y) for x,y in zip(a,b)])
print("median a/b %.4f  b2/b %.4f  a/b2 %.4f"%(st.median(a)/st.median(b), st.median(b2)/st.median(b), st.median(a)/st.median(b2)))
PY
