#!/usr/bin/env bash
# Builds ShardRL against another release's LibTorch and runs the suite with it: the check behind
# docs/building.md's "your own LibTorch 2.x". It takes the torch wheel of that release from PyPI (the
# wheel alone, ~0.6-0.9 GB, kept under ~/.cache/shardrl/libtorch-VERSION) and the two CUDA runtime
# libraries its libtorch_cpu needs even on a CPU (cudart, cupti), then builds in build-torch-VERSION
# with SHARDRL_LIBTORCH pointing at it, as a user would. The tests' Python references keep the
# venv's torch 2.11: they are separate processes.
# Usage: scripts/check-libtorch.sh VERSION [CTEST_ARGS...]    e.g. 2.15.0 -R 'FSDP|Trainer'
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: scripts/check-libtorch.sh VERSION [CTEST_ARGS...]}
shift
cache="${XDG_CACHE_HOME:-$HOME/.cache}/shardrl"
venv="${SHARDRL_VENV:-$cache/venv}"
python="$venv/bin/python"
[ -x "$python" ] || { echo "check-libtorch: no venv at $venv (scripts/install-deps.sh)" >&2; exit 1; }
prefix="$cache/libtorch-$version"
download() {  # wheels alone, no dependencies, for the venv's Python and this platform
  "$python" -m pip download --quiet --no-deps --only-binary=:all: -d "$prefix/wheels" "$@"
}
if [ ! -f "$prefix/.complete" ]; then
  rm -rf "$prefix"
  mkdir -p "$prefix/wheels"
  echo "check-libtorch: downloading torch==$version (the wheel alone)"
  download "torch==$version"
  wheel=$(ls "$prefix"/wheels/torch-*.whl)
  # The CUDA runtime and CUPTI packages this torch names: pinned as nvidia-cuda-runtime-cu12
  # (up to CUDA 12), or through cuda-toolkit[cudart,cupti] (CUDA 13). libtorch_cpu finds them
  # through its RPATH ($ORIGIN/../../nvidia/...), so they unpack beside torch/.
  mapfile -t runtime < <("$python" - "$wheel" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    for line in wheel.read(meta).decode().splitlines():
        m = re.match(r"Requires-Dist: (nvidia-cuda-(?:runtime|cupti)-cu\d+)\s*\(?(==[^;)]*)", line)
        if m:
            print(m.group(1) + m.group(2).strip())
        m = re.match(r"Requires-Dist: cuda-toolkit\[[^\]]*\]\s*==\s*(\d+)\.", line)
        if m:
            print(f"nvidia-cuda-runtime=={m.group(1)}.*")
            print(f"nvidia-cuda-cupti=={m.group(1)}.*")
EOF
)
  [ "${#runtime[@]}" -eq 0 ] || download "${runtime[@]}"
  for w in "$prefix"/wheels/*.whl; do "$python" -m zipfile -e "$w" "$prefix"; done
  rm -rf "$prefix/wheels"
  touch "$prefix/.complete"
fi
build="build-torch-$version"
mkdir -p "$build"
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DSHARDRL_LIBTORCH="$prefix/torch" >"$build/configure.log" 2>&1 || {
  tail -n 20 "$build/configure.log" >&2
  exit 1
}
echo "check-libtorch: $(grep -m1 "^__version__" "$prefix/torch/version.py") at $prefix/torch"
cmake --build "$build" -j "$(nproc)"
cd "$build"
ctest -j "$(nproc)" --timeout 900 --output-on-failure "$@"
