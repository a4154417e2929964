#!/usr/bin/env bash
# Installs the Debian packages ShardRL builds, tests and benchmarks with.
# Idempotent: only what is missing is installed, so `make` can call it every time.
set -euo pipefail

packages=(
  build-essential cmake ccache pkg-config
  libtorch-dev libgloo-dev libopenblas0-pthread libblas3
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libfmt-dev libspdlog-dev
  googletest libgtest-dev libbenchmark-dev
  zlib1g-dev libpng-dev
  python3-torch python3-numpy
  dataset-fashion-mnist
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
