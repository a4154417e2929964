"""The realism scorer's ceiling per class: real Fashion-MNIST test images scored as the demo scores
its samples (reward.reward_functions.realism: the largest correlation with the first bank_per_class
training images of the class, each image centred and scaled to unit norm), written from the scorer's
definition in numpy, not from ShardRL's code. A generated class that scores well under its real
images' mean is far from them; one at or above it is as close to the bank as real images are.

  python bench/fmnist_realism_ceiling.py [DATA_DIR] [BANK_PER_CLASS] [TEST_PER_CLASS] > ceiling.json
"""

import gzip
import json
import sys

import numpy as np

CLASSES = ["t-shirt", "pair of trousers", "pullover", "dress", "coat", "sandal", "shirt",
           "sneaker", "bag", "ankle boot"]


def idx(path, header):
    with gzip.open(path) as f:
        return np.frombuffer(f.read()[header:], np.uint8)


def standardized(x):
    x = x.astype(np.float64)
    x = x - x.mean(1, keepdims=True)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-8)


def main():
    data = sys.argv[1] if len(sys.argv) > 1 else "/usr/share/datasets/fashion-mnist"
    bank_per_class = int(sys.argv[2]) if len(sys.argv) > 2 else 512
    test_per_class = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    train = idx(f"{data}/train-images-idx3-ubyte.gz", 16).reshape(-1, 784)
    train_labels = idx(f"{data}/train-labels-idx1-ubyte.gz", 8)
    test = idx(f"{data}/t10k-images-idx3-ubyte.gz", 16).reshape(-1, 784)
    test_labels = idx(f"{data}/t10k-labels-idx1-ubyte.gz", 8)
    out = {"bank_per_class": bank_per_class, "test_per_class": test_per_class, "per_class": {}}
    for c, name in enumerate(CLASSES):
        bank = standardized(train[train_labels == c][:bank_per_class])
        x = standardized(test[test_labels == c][:test_per_class])
        score = np.clip((x @ bank.T).max(1), 0, None)
        out["per_class"][name] = {"mean": float(score.mean()), "median": float(np.median(score))}
    out["mean"] = float(np.mean([v["mean"] for v in out["per_class"].values()]))
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
