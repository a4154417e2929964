set -e
BIN=/work/main/build/bin; OUT=/tmp/ab/ws1; mkdir -p $OUT
export GLIBC_TUNABLES=glibc.malloc.mmap_threshold=1073741824:glibc.malloc.trim_threshold=4294967296 OMP_WAIT_POLICY=PASSIVE
M="--d-model 512 --layers 6 --heads 8 --vocab 8192 --seq 128 --steps 5 --warmup 2"
for r in $(seq 1 ${N:-8}); do
  $BIN/shardrl launch -n 1 --threads 1 -- $BIN/bench_fsdp --mode fsdp $M --batch 4 --json-out $OUT/a1.r$r.json > /dev/null 2>&1
  env OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $BIN/bench_fsdp --mode local $M --batch 4 --threads 1 --json-out $OUT/b.r$r.json > /dev/null
  $BIN/shardrl launch -n 1 --threads 1 -- $BIN/bench_fsdp --mode local $M --batch 4 --threads 1 --json-out $OUT/bl.r$r.json > /dev/null 2>&1
done
/root/.cache/shardrl/venv/bin/python - <<'PY'
import json,statistics as st
L=lambda n,r: json.load(open(f"/tmp/ab/ws1/{n}.r{r}.json"))["median_step_s"]
R=range(1,9)
for n in ["a1","b","bl"]: print(n, " ".join("%.3f"%L(n,r) for r in R), "median %.4f"%st.median(L(n,r) for r in R))
print("per-round a1/b", " ".join("%.3f"%(L("a1",r)/L("b",r)) for r in R), "median of ratios %.4f"%st.median(L("a1",r)/L("b",r) for r in R))
print("per-round bl/b", " ".join("%.3f"%(L("bl",r)/L("b",r)) for r in R))
PY
