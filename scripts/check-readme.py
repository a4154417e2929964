#!/usr/bin/env python3
"""Runs the commands of the README's ```sh blocks as written, from the repository root.

    scripts/check-readme.py [--all] [--build DIR] [README]

Each command (a line, with its backslash continuations) runs in bash with the repository root as its
working directory, in the order the README gives them, and must exit 0 within its timeout. `make`
commands are what CI runs anyway (`make test` builds and runs the suite; `make demo` and `make smollm2`
take minutes), so they are listed and skipped unless --all. With --build DIR, `build/bin/` in a command
names DIR/bin/ instead (ctest runs this on its own build folder). Paths the commands write under
runs/readme are removed first, so a second run starts as the first did.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def commands(readme):
    """The README's shell commands: every ```sh block, a command per line with its continuations."""
    out, block, pending = [], False, ""
    for number, line in enumerate(open(readme, encoding="utf-8"), 1):
        stripped = line.rstrip("\n")
        if stripped.startswith("```"):
            block = stripped == "```sh"
            continue
        if not block:
            continue
        if pending:
            pending += "\n" + stripped
        else:
            pending, start = stripped, number
        if stripped.endswith("\\"):
            continue
        text = pending.strip()
        pending = ""
        if text and not text.startswith("#"):
            out.append((start, text))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="run the make commands too")
    parser.add_argument("--build", help="the build folder whose bin/ the commands use")
    parser.add_argument("--timeout", type=float, default=900, help="seconds a command may take")
    parser.add_argument("readme", nargs="?", default=os.path.join(REPO, "README.md"))
    args = parser.parse_args()

    shutil.rmtree(os.path.join(REPO, "runs", "readme"), ignore_errors=True)
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    found = commands(args.readme)
    if not found:
        print(f"check-readme: no ```sh commands in {args.readme}", file=sys.stderr)
        return 1
    failed = 0
    for line, command in found:
        if re.match(r"make\b", command) and not args.all:
            print(f"check-readme: line {line}: skipped (make; --all runs it): {command}")
            continue
        if args.build:
            command = re.sub(r"(?<![\w/.-])build/bin/", os.path.join(args.build, "bin") + "/", command)
        start = time.time()
        try:
            result = subprocess.run(["bash", "-o", "pipefail", "-c", command], cwd=REPO, env=env,
                                    capture_output=True, text=True, timeout=args.timeout)
            code, output = result.returncode, result.stdout + result.stderr
        except subprocess.TimeoutExpired as e:
            code, output = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
        seconds = time.time() - start
        first = command.splitlines()[0]
        if code == 0:
            print(f"check-readme: line {line}: ok in {seconds:.1f} s: {first}")
        else:
            failed += 1
            tail = "\n".join(str(output).splitlines()[-30:])
            print(f"check-readme: line {line}: FAILED ({code}) after {seconds:.1f} s: {command}\n{tail}",
                  file=sys.stderr)
    print(f"check-readme: {len(found)} commands, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
