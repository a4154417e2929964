#!/usr/bin/env bash
# Two queues of the model-folder harnesses, 10^6 inputs each, at low priority.
cd /work/wt/fuzz
q() { for t in "$@"; do FUZZ_TARGETS=$t nice -n 15 scripts/fuzz.sh build-fuzz -runs=1000000 > /work/runs/fuzz-1e6/$t.log 2>&1; echo "rc $?" >> /work/runs/fuzz-1e6/$t.log; done; }
q config_json tokenizer_config adapter_config &
q tokenizer_json vocab_txt hf_index &
wait
