"""What the reference scripts report: one JSON line per check, and the names of the failed ones in
`failed` for the script's exit status (tests/test_util.h's expect_checks_pass reads the lines)."""
import json

failed = []


def report(check, ok, **fields):
    print(json.dumps({"check": check, "ok": bool(ok), **fields}), flush=True)
    if not ok:
        failed.append(check)


def relative_error(a, b):
    """max |a - b| / max(1, max |b|): relative for large values, absolute near 0."""
    return ((a - b).abs().max() / max(1.0, b.abs().max().item())).item()
