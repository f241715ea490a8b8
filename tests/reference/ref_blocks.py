#!/usr/bin/env python3
"""Reference blocks (tensor-parallel slices) for tests/slices.rs.

Usage: ref_blocks.py DIR

Writes DIR/blocks.safetensors with the reference writer (safetensors.numpy),
tensors shaped as tensor-parallel layers are (wide rows, a 3-D expert
block, odd widths), then prints for a grid of blocks the sha256 of the
reference reader's slice (safe_open(...).get_slice(name)[...], numpy), as
"<hex>  <name> <a:b,c:d,...>" (one range per sliced dimension). The grid:
for every tensor, each rank's rows and each rank's columns (last
dimension) for 2 and 4 ranks, and a few blocks at awkward offsets.
Exit status 3 when numpy or safetensors is missing.
"""

import hashlib
import os
import sys

try:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file
except ImportError as e:  # pragma: no cover - environment dependent
    print(f"ref_blocks.py: reference reader unavailable: {e}", file=sys.stderr)
    sys.exit(3)

# name -> (dtype, shape). "wide.*": every rank's column part of a row is at
# least 64 KiB for 2 ranks (wide.w2) and for 4 ranks (wide.w4).
TENSORS = {
    "a.odd": (np.uint8, (13, 1001)),
    "b.narrow": (np.float32, (300, 96)),
    "c.cube": (np.float16, (5, 7, 33)),
    "d.vec": (np.int64, (77,)),
    "wide.w2": (np.float16, (12, 65536)),
    "wide.w4": (np.float32, (6, 65536)),
}


def parts(n, world):
    step = -(-n // world)
    return [(min(r * step, n), min((r + 1) * step, n)) for r in range(world)]


def main():
    d = sys.argv[1]
    os.makedirs(d, exist_ok=True)
    rng = np.random.default_rng(23)
    arrays = {}
    for name, (dtype, shape) in TENSORS.items():
        n = int(np.prod(shape))
        raw = rng.integers(0, 256, size=n * np.dtype(dtype).itemsize, dtype=np.uint8).tobytes()
        arrays[name] = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    path = os.path.join(d, "blocks.safetensors")
    save_file(arrays, path, metadata={"format": "np"})
    lines = []
    with safe_open(path, framework="numpy") as st:
        for name in st.keys():
            sl = st.get_slice(name)
            shape = sl.get_shape()
            blocks = []
            for world in (2, 4):
                for a, b in parts(shape[0], world):
                    if a < b:
                        blocks.append([(a, b)])
                if len(shape) >= 2:
                    for a, b in parts(shape[-1], world):
                        if a < b:
                            blocks.append([(0, n) for n in shape[:-1]] + [(a, b)])
            if len(shape) >= 2:
                blocks.append([(1, shape[0] - 1), (3, shape[1] - 2)])
                blocks.append([(shape[0] - 1, shape[0]), (shape[1] - 1, shape[1])])
                blocks.append([(0, 1), (0, 1)])
            if len(shape) == 3:
                blocks.append([(1, 4), (2, 5)])
                blocks.append([(0, 5), (0, 7), (32, 33)])
                blocks.append([(2, 3), (0, 7), (1, 30)])
            for block in blocks:
                index = tuple(slice(a, b) for a, b in block)
                got = np.ascontiguousarray(sl[index]).tobytes()
                spec = ",".join(f"{a}:{b}" for a, b in block)
                lines.append(f"{hashlib.sha256(got).hexdigest()}  {name} {spec}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
