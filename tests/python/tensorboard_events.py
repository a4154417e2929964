"""Reads the TensorBoard event files `shardrl train` wrote with TensorBoard's own reader (PyPI
`tensorboard`: its EventAccumulator and event file loader, which check every record's CRC-32C) and
reports one JSON check per line (checks.py).

  run LOGDIR METRICS_JSONL EXPECT_JSON
      Every scalar of the run's metrics.jsonl is in TensorBoard under its name, at its step, once,
      with its value as float32, and TensorBoard has no other scalar; the images and texts that
      EXPECT_JSON names ({"images": {tag: [steps]}, "texts": {tag: [steps]},
      "text_contains": [strings]}) are there at exactly those steps, the images PNGs of the size
      their summary gives, the texts markdown of the text plugin.
  scalars LOGDIR EXPECT_JSON
      For a run without metrics.jsonl: EXPECT_JSON {"tags": [...], "steps": [...]}: those scalars
      are there, and every scalar is at exactly those steps, once each; no images, no texts.
  rollouts ROLLOUT_DATA_DIR METRICS_JSONL EXPECT_JSON
      trainer.rollout_data_dir as verl's _dump_generations writes it: <step>.jsonl for each
      training step of metrics.jsonl, EXPECT_JSON {"samples": n} lines each with input, output,
      gts, score and step, the scores' mean the step's reward_mean; with {"images": [h, w]} each
      output names a PNG of that size (read by PIL).
  truncated EVENT_FILE
      The file cut inside each of its records (in the length, the length's CRC, the data and the
      data's CRC; at most ~60 cuts, spread over the file): the reader returns exactly the events
      of the whole records before the cut, and TensorBoard's accumulator the scalars among them.
"""
import io
import json
import math
import os
import struct
import sys
import tempfile

from checks import failed, report

import numpy as np
from PIL import Image
from tensorboard.backend.event_processing import event_accumulator, event_file_loader
from tensorboard.compat.proto import event_pb2

KEEP_ALL = {
    event_accumulator.SCALARS: 0,
    event_accumulator.IMAGES: 0,
    event_accumulator.TENSORS: 0,
}


def accumulate(logdir):
    acc = event_accumulator.EventAccumulator(logdir, size_guidance=KEEP_ALL)
    acc.Reload()
    return acc


def same_float32(a, b):
    a32 = float(np.float32(a))
    return (math.isnan(a32) and math.isnan(b)) or a32 == b


def check_scalars(acc, expected):
    """expected: tag -> [(step, value or None)]"""
    tags = set(acc.Tags()["scalars"])
    report("scalar tags", tags == set(expected), extra=sorted(tags - set(expected)),
           missing=sorted(set(expected) - tags))
    for tag, points in sorted(expected.items()):
        if tag not in tags:
            continue
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        want_steps = [s for s, _ in points]
        ok = steps == want_steps
        bad = []
        if ok:
            for e, (_, v) in zip(events, points):
                if v is not None and not same_float32(v, e.value):
                    bad.append({"step": e.step, "tensorboard": e.value, "expected": v})
        report(f"scalar {tag}", ok and not bad, steps=steps, expected_steps=want_steps,
               mismatches=bad[:3])


def check_images(acc, expected):
    tags = set(acc.Tags()["images"])
    for tag, steps in sorted(expected.items()):
        events = acc.Images(tag) if tag in tags else []
        report(f"image {tag} steps", [e.step for e in events] == steps,
               steps=[e.step for e in events], expected=steps)
        for e in events:
            picture = Image.open(io.BytesIO(e.encoded_image_string))
            ok = (picture.format == "PNG" and picture.size == (e.width, e.height)
                  and picture.mode in ("L", "RGB") and e.width > 0 and e.height > 0)
            pixels = np.asarray(picture)
            report(f"image {tag} at step {e.step}", ok and pixels.std() > 0,
                   format=picture.format, size=list(picture.size), mode=picture.mode,
                   summary_size=[e.width, e.height])


def check_texts(acc, expected, contains):
    tags = set(acc.Tags()["tensors"])
    for tag, steps in sorted(expected.items()):
        events = acc.Tensors(tag) if tag in tags else []
        report(f"text {tag} steps", [e.step for e in events] == steps,
               steps=[e.step for e in events], expected=steps)
        if tag in tags:
            plugin = acc.SummaryMetadata(tag).plugin_data.plugin_name
            report(f"text {tag} plugin", plugin == "text", plugin=plugin)
        for e in events:
            text = e.tensor_proto.string_val[0].decode("utf-8")
            missing = [c for c in contains if c not in text]
            report(f"text {tag} at step {e.step}", not missing, missing=missing, text=text[:300])


def run(logdir, metrics_path, expect):
    acc = accumulate(logdir)
    report("file version", acc.file_version == 2.0, file_version=acc.file_version)
    expected = {}
    with open(metrics_path) as f:
        for line in f:
            row = json.loads(line)
            for tag, value in row.items():
                if tag != "step":
                    expected.setdefault(tag, []).append((row["step"], value))
    check_scalars(acc, expected)
    check_images(acc, expect.get("images", {}))
    check_texts(acc, expect.get("texts", {}), expect.get("text_contains", []))


def scalars(logdir, expect):
    acc = accumulate(logdir)
    report("file version", acc.file_version == 2.0, file_version=acc.file_version)
    tags = acc.Tags()["scalars"]
    report("scalar tags", set(expect["tags"]) <= set(tags), tags=sorted(tags))
    check_scalars(acc, {tag: [(s, None) for s in expect["steps"]] for tag in tags})
    report("no images or texts", not acc.Tags()["images"] and not acc.Tags()["tensors"])


def rollouts(folder, metrics_path, expect):
    with open(metrics_path) as f:
        steps = [json.loads(line) for line in f]
    steps = [row for row in steps if row["step"] > 0]
    report("training steps", len(steps) > 0, steps=len(steps))
    for row in steps:
        step = row["step"]
        path = os.path.join(folder, f"{step}.jsonl")
        if not os.path.exists(path):
            report(f"rollouts of step {step}", False, missing=path)
            continue
        with open(path) as f:
            samples = [json.loads(line) for line in f]
        fields_ok = all(set(s) == {"input", "output", "gts", "score", "step"} and s["step"] == step
                        and isinstance(s["input"], str) and isinstance(s["output"], str)
                        for s in samples)
        mean = sum(s["score"] for s in samples) / max(len(samples), 1)
        report(f"rollouts of step {step}",
               len(samples) == expect["samples"] and fields_ok
               and abs(mean - row["reward_mean"]) <= 1e-6 * max(1.0, abs(row["reward_mean"])),
               samples=len(samples), fields=sorted(samples[0]) if samples else [],
               score_mean=mean, reward_mean=row["reward_mean"])
        if "images" in expect:
            sizes, distinct = set(), set()
            for s in samples:
                with Image.open(s["output"]) as picture:
                    sizes.add((picture.format, picture.size[1], picture.size[0]))
                    distinct.add(picture.tobytes())
            # Each sample its own image: samples of one prompt differ by their noise.
            report(f"rollout images of step {step}",
                   sizes == {("PNG", expect["images"][0], expect["images"][1])}
                   and len(distinct) == len(samples),
                   sizes=sorted(sizes), distinct=len(distinct))


def record_spans(data):
    """(start, end) of each TFRecord, read from its length fields alone."""
    spans, at = [], 0
    while at + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[at:at + 8])
        end = at + 12 + length + 4
        if end > len(data):
            break
        spans.append((at, end))
        at = end
    return spans


def truncated(path):
    with open(path, "rb") as f:
        data = f.read()
    spans = record_spans(data)
    whole = list(event_file_loader.LegacyEventFileLoader(path).Load())
    report("whole file", len(whole) == len(spans) and spans[-1][1] == len(data),
           events=len(whole), records=len(spans), bytes=len(data))
    # What each whole record holds, decoded by TensorBoard's own protobuf classes.
    decoded = [event_pb2.Event.FromString(data[a + 12:b - 4]) for a, b in spans]
    report("first record is the file version", decoded[0].file_version == "brain.Event:2",
           file_version=decoded[0].file_version)
    stride = max(1, len(spans) // 15)
    cuts = []
    for k in range(0, len(spans), stride):
        a, b = spans[k]
        # in the length, in its CRC, in the data, in the data's CRC
        cuts += [a + 3, a + 10, a + 12 + (b - a - 16) // 2, b - 2]
    with tempfile.TemporaryDirectory() as tmp:
        for cut in cuts:
            before = sum(1 for a, b in spans if b <= cut)
            part = os.path.join(tmp, os.path.basename(path))
            with open(part, "wb") as f:
                f.write(data[:cut])
            events = list(event_file_loader.LegacyEventFileLoader(part).Load())
            same = [e.SerializeToString() for e in events] == [
                e.SerializeToString() for e in decoded[:before]]
            want_scalars = sum(
                1 for e in decoded[:before] for v in e.summary.value if v.HasField("simple_value"))
            acc = accumulate(tmp)
            got_scalars = sum(len(acc.Scalars(t)) for t in acc.Tags()["scalars"])
            report(f"cut at byte {cut}", same and got_scalars == want_scalars,
                   events=len(events), whole_records_before=before, scalars=got_scalars,
                   expected_scalars=want_scalars)
            os.remove(part)


def main():
    mode = sys.argv[1]
    if mode == "run":
        run(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    elif mode == "scalars":
        scalars(sys.argv[2], json.loads(sys.argv[3]))
    elif mode == "truncated":
        truncated(sys.argv[2])
    elif mode == "rollouts":
        rollouts(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    else:
        raise SystemExit(f"unknown mode {mode}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
