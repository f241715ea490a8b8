#!/usr/bin/env python3
"""Reference slices for tests/parts.rs.

Usage: ref_slices.py DIR   (DIR holds shards written by ref_digest.py)

For every tensor of at least 3 rows (first dimension), prints the sha256 of
rows 1..3 as the reference reader slices them (safe_open(...).get_slice(name)
[1:3], numpy), as "<hex>  <name> rows 1 3"; and for every tensor of at least
5 bytes, the sha256 of bytes 1..len-2 of the reference reader's full tensor
(get_tensor(name).tobytes()[1:-2]), as "<hex>  <name> bytes 1 <len-2>".
Exit status 3 when numpy or safetensors is missing.
"""

import hashlib
import os
import sys

try:
    import numpy as np
    from safetensors import safe_open
except ImportError as e:  # pragma: no cover - environment dependent
    print(f"ref_slices.py: reference reader unavailable: {e}", file=sys.stderr)
    sys.exit(3)


def main():
    d = sys.argv[1]
    lines = []
    for f in sorted(os.listdir(d)):
        if not f.endswith(".safetensors"):
            continue
        with safe_open(os.path.join(d, f), framework="numpy") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                shape = sl.get_shape()
                if len(shape) >= 1 and shape[0] >= 3:
                    rows = np.ascontiguousarray(sl[1:3]).tobytes()
                    lines.append(f"{hashlib.sha256(rows).hexdigest()}  {name} rows 1 3")
                whole = np.ascontiguousarray(st.get_tensor(name)).tobytes()
                if len(whole) >= 5:
                    part = whole[1 : len(whole) - 2]
                    lines.append(f"{hashlib.sha256(part).hexdigest()}  {name} bytes 1 {len(whole) - 2}")
    for line in sorted(lines):
        print(line)


if __name__ == "__main__":
    main()
