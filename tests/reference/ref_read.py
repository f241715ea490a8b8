#!/usr/bin/env python3
"""The reference reader over files someone else wrote, for
crates/cli/tests/place_*.rs.

Usage: ref_read.py DIR [DIR...]

Reads every *.safetensors file of each DIR (top level, sorted) with the
reference reader (`safetensors.deserialize`: the Rust reader of the
`safetensors` package; every dtype, bf16 included, as raw bytes), and
prints one line per tensor per file: "<sha256 of its bytes>  <name>",
sorted. A tensor held by several files (mirror copies) is printed once per
file, so a caller can check the copies agree. A file the reference refuses
is a failure (exit 1, the error on stderr).

Exit status 3 (with a message on stderr) when the safetensors package is
missing, so the caller can tell "no reference available" from a failure.
"""

import hashlib
import os
import sys

try:
    import safetensors
except ImportError as e:  # pragma: no cover - environment dependent
    print(f"ref_read.py: reference reader unavailable: {e}", file=sys.stderr)
    sys.exit(3)


def main():
    lines = []
    for d in sys.argv[1:]:
        for name in sorted(os.listdir(d)):
            if not name.endswith(".safetensors"):
                continue
            path = os.path.join(d, name)
            with open(path, "rb") as f:
                buf = f.read()
            try:
                tensors = safetensors.deserialize(buf)
            except Exception as e:
                print(f"ref_read.py: the reference refuses {path}: {e}", file=sys.stderr)
                sys.exit(1)
            for tname, t in tensors:
                lines.append((tname, hashlib.sha256(bytes(t["data"])).hexdigest()))
    lines.sort()
    for tname, h in lines:
        print(f"{h}  {tname}")


if __name__ == "__main__":
    main()
