#!/usr/bin/env bash
# Runs every parser's libFuzzer harness (built by `make fuzz-build` into BUILD/bin) over its seed
# corpus and fails on the first finding (a crash, an ASan/UBSan report, an unclear error: see
# fuzz/fuzz_util.h). New inputs go to a scratch corpus, never into the committed one.
#   scripts/fuzz.sh BUILD [libFuzzer flags...]   default: -max_total_time=7 each (the CI smoke)
#   scripts/fuzz.sh build-fuzz -runs=1000000      the figures in BENCHMARKS.md
# FUZZ_TARGETS picks harnesses (default: all of them: the checkpoint and config formats, then the
# files a Hugging Face model folder brings). A finding's input is saved
# as BUILD/fuzz-artifacts/<target>-crash-*; replay it with `BUILD/bin/fuzz_<target> FILE`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:?usage: scripts/fuzz.sh BUILD [libFuzzer flags...]}"
shift
flags=("$@")
[ ${#flags[@]} -gt 0 ] || flags=(-max_total_time=7)
artifacts="$build/fuzz-artifacts"
mkdir -p "$artifacts"

# The regression tests of past findings, under the same sanitizers.
"$build/bin/parser_tests" --gtest_brief=1 >/dev/null || {
  "$build/bin/parser_tests" --gtest_brief=1 >&2 || true
  echo "fuzz: parser_tests failed" >&2
  exit 1
}
echo "fuzz: parser_tests passed"

# Extra seed folders beyond fuzz/corpus/<target>.
declare -A seeds=([yaml]="$repo/examples/configs")
# Tokens that reach deeper than random bytes: the formats' field names.
declare -A dicts=([safetensors]=json [index]=json [yaml]=yaml [gguf]=gguf [config_json]=config
  [tokenizer_json]=tokenizer [tokenizer_config]=tokenizer [vocab_txt]=vocab [adapter_config]=peft
  [hf_index]=json)
all_targets="safetensors index yaml gguf config_json tokenizer_json tokenizer_config vocab_txt
  adapter_config hf_index"

for target in ${FUZZ_TARGETS:-$all_targets}; do
  scratch="$(mktemp -d)"
  start=$(date +%s)
  # -timeout: an input that runs 10 s is a hang, a finding; -rss_limit_mb: an allocation the
  # input's size does not justify is one too. One process: the cores are shared.
  if ! "$build/bin/fuzz_$target" "${flags[@]}" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
      -dict="$repo/fuzz/${dicts[$target]}.dict" -artifact_prefix="$artifacts/$target-" \
      "$scratch" "$repo/fuzz/corpus/$target" ${seeds[$target]:-} 2>"$scratch.log"; then
    tail -n 60 "$scratch.log" >&2
    echo "fuzz: $target: FINDING (input saved under $artifacts)" >&2
    rm -rf "$scratch" "$scratch.log"
    exit 1
  fi
  # The status lines: last progress line and the final statistics.
  grep -E '^#[0-9]+[[:space:]]+(DONE|pulse|NEW|REDUCE|INITED)' "$scratch.log" | tail -n 1 || true
  grep -E '^(stat::|Done )' "$scratch.log" || true
  echo "fuzz: $target: no finding in $(( $(date +%s) - start )) s"
  rm -rf "$scratch" "$scratch.log"
done
