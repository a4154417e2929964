#!/usr/bin/env bash
# Installs what ShardRL builds, tests and benchmarks with:
#   - Debian packages (compiler, clang with its libFuzzer runtime for fuzz/, Gloo headers,
#     JSON/YAML/CLI/logging libraries, GoogleTest, ...);
#   - a Python venv with the pinned torch 2.11 wheel, whose LibTorch (headers, libraries, CMake
#     config) the C++ build links, plus the Python references the tests compare against
#     (scripts/requirements.txt).
# Idempotent: only what is missing is installed, so `make` calls it every time. The venv lives
# outside the checkout (SHARDRL_VENV, default ~/.cache/shardrl/venv) so later clones and CI reuse
# its ~5.5 GB instead of downloading it again; it is rebuilt when requirements.txt changes.
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

packages=(
  build-essential cmake ccache pkg-config python3 python3-venv
  libgloo-dev
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libfmt-dev libspdlog-dev
  googletest libgtest-dev libbenchmark-dev
  zlib1g-dev libisal-dev libpng-dev
  clang libclang-rt-14-dev
  dataset-fashion-mnist
  bible-kjv fortunes fortunes-min
  iproute2  # ip netns and veth pairs: the two-host tests (tests/test_multihost.cpp)
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive

if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# Debian's LibTorch 1.13 is no longer used; its libc10.so is a trap for CMake's find_library (two
# libc10 in one process abort at start-up). The build avoids it, but say so once.
if dpkg-query -W -f='${Status}' libtorch-dev 2>/dev/null | grep -q "install ok installed"; then
  echo "install-deps: note: Debian's libtorch-dev (1.13) is installed; ShardRL builds against" \
    "the torch 2.11 venv and ignores it" >&2
fi

venv="${SHARDRL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/shardrl/venv}"
requirements="$repo_root/scripts/requirements.txt"
nodeps="$repo_root/scripts/requirements-nodeps.txt"
stamp="$venv/.shardrl-requirements"
if [ ! -x "$venv/bin/python" ] || ! cat "$requirements" "$nodeps" | cmp -s - "$stamp"; then
  echo "install-deps: installing the Python environment into $venv (torch 2.11, ~5.5 GB, ~2 min)"
  # The system python: a pyenv shim or a conda python in PATH would tie the venv to a shell setup.
  python=/usr/bin/python3
  [ -x "$python" ] || python=python3
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  "$venv/bin/python" -m pip install -q -r "$requirements"
  "$venv/bin/python" -m pip install -q --no-deps -r "$nodeps"
  cat "$requirements" "$nodeps" >"$stamp"
fi
