#!/usr/bin/python3
"""An independent safetensors reader (json + struct only) for the export test.

Usage: read_safetensors.py DIR   reads DIR/model.safetensors.index.json and the files it names,
       read_safetensors.py FILE  reads one .safetensors file (e.g. a PEFT adapter_model.safetensors),
prints {"tensors": {name: {"dtype", "shape", "file", "values"}}, "files": {file: bytes}} as JSON.
"""
import json
import os
import struct
import sys

FORMATS = {"F32": ("f", 4), "F64": ("d", 8), "I64": ("q", 8), "I32": ("i", 4), "F16": ("e", 2)}


def values(dtype, raw):
    if dtype == "BF16":
        # bf16 is the top half of an fp32: widen by shifting the bits up.
        halves = struct.unpack("<%dH" % (len(raw) // 2), raw)
        return list(struct.unpack("<%df" % len(halves), struct.pack("<%dI" % len(halves),
                                                                    *[h << 16 for h in halves])))
    code, size = FORMATS[dtype]
    return list(struct.unpack("<%d%s" % (len(raw) // size, code), raw))


def read_file(path):
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        start = 8 + length
        out = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            begin, end = entry["data_offsets"]
            f.seek(start + begin)
            out[name] = {"dtype": entry["dtype"], "shape": entry["shape"],
                         "values": values(entry["dtype"], f.read(end - begin))}
        return out


def main():
    folder = sys.argv[1]
    if os.path.isfile(folder):
        tensors = read_file(folder)
        for t in tensors.values():
            t["file"] = os.path.basename(folder)
        json.dump({"tensors": tensors, "files": {os.path.basename(folder): os.path.getsize(folder)}},
                  sys.stdout)
        return
    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        index = json.load(f)
    tensors, files = {}, {}
    for file in sorted(set(index["weight_map"].values())):
        path = os.path.join(folder, file)
        files[file] = os.path.getsize(path)
        for name, t in read_file(path).items():
            if index["weight_map"].get(name) != file:
                raise SystemExit("%s: %s is not mapped to this file" % (file, name))
            t["file"] = file
            tensors[name] = t
    missing = set(index["weight_map"]) - set(tensors)
    if missing:
        raise SystemExit("tensors in the index but in no file: %s" % sorted(missing))
    json.dump({"tensors": tensors, "files": files}, sys.stdout)


if __name__ == "__main__":
    main()
