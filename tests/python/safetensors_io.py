"""Minimal safetensors reader for the reference scripts (Debian has no safetensors package)."""
import json
import struct

import numpy as np
import torch

_DTYPES = {"F32": np.float32, "F64": np.float64, "F16": np.float16, "I64": np.int64,
           "I32": np.int32, "U8": np.uint8}


def load(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = data[begin:end]
        if info["dtype"] == "BF16":
            # bf16 is the top half of fp32.
            words = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
            array = words.view(np.float32)
        else:
            array = np.frombuffer(raw, dtype=_DTYPES[info["dtype"]])
        out[name] = torch.from_numpy(array.copy()).reshape(info["shape"])
    return out


def write_raw(tensor, path):
    """fp32, little endian, row major: what the C++ test reads back."""
    tensor.detach().to(torch.float32).contiguous().numpy().tofile(path)
