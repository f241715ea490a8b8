#!/usr/bin/env python3
"""Reference containers and digests for tests/reference.rs.

Usage: ref_digest.py OUT_DIR

Writes, into OUT_DIR, shards made by the reference writer
(safetensors.numpy.save_file) with irregular tensor sizes (odd byte
lengths, a few MiB one, empty ones), a different __metadata__ length per
shard (so header lengths differ), plus one hand-made container whose header
length is odd (the reference writer pads headers to 8 bytes; this one is
not padded). Then prints, for every tensor of every shard, the sha256 of its
bytes as the reference reader returns them
(safetensors.safe_open(path, framework="numpy"), .tobytes()), in sha256sum
format "<hex>  <name>", sorted by name.

Exit status 3 (with a message on stderr) when numpy or safetensors is
missing, so the caller can tell "no reference available" from a failure.
"""

import hashlib
import json
import os
import struct
import sys

try:
    import numpy as np
    from safetensors import safe_open
    from safetensors.numpy import save_file
except ImportError as e:  # pragma: no cover - environment dependent
    print(f"ref_digest.py: reference writer unavailable: {e}", file=sys.stderr)
    sys.exit(3)


def arr(rng, dtype, shape):
    dtype = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype == np.bool_:
        return rng.integers(0, 2, size=n).astype(np.bool_).reshape(shape)
    # Random bytes reinterpreted: every bit pattern, NaNs included, must survive.
    raw = rng.integers(0, 256, size=n * dtype.itemsize, dtype=np.uint8).tobytes()
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng(20240611)
    shards = [
        {
            "l0.tiny.u8": ("u1", [3, 7]),
            "l0.half": ("f2", [1001]),
            "l0.float": ("f4", [17, 33]),
            "l0.bool": ("?", [13]),
            "l0.i8": ("i1", [5, 5, 5]),
            "l0.empty": ("f4", [0]),
        },
        {
            "l1.experts.0.big": ("f2", [1_500_001]),  # 3,000,002 bytes
            "l1.i64": ("i8", [5, 3]),
            "l1.f64": ("f8", [11]),
            "l1.u16": ("u2", [4097]),
            "l1.scalar": ("f4", []),
        },
        {
            "l2.i32": ("i4", [999, 3]),
            "l2.odd.u8": ("u1", [4095]),
            "l2.block.u8": ("u1", [4096]),
            "l2.f16": ("f2", [63, 65]),
            "l2.u32": ("u4", [257]),
            "l2.u64": ("u8", [31]),
            "l2.i16": ("i2", [7777]),
        },
    ]
    paths = []
    for i, spec in enumerate(shards):
        tensors = {name: arr(rng, dt, shape) for name, (dt, shape) in spec.items()}
        meta = {"format": "np", "note": "x" * (i * 29 + 3)}
        path = os.path.join(out, f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        save_file(tensors, path, metadata=meta)
        paths.append(path)

    # Hand-made: header of odd length, no padding, data section at an odd offset.
    payloads = [
        ("hand.a", "U8", [1], rng.integers(0, 256, size=1, dtype=np.uint8).tobytes()),
        ("hand.b", "F32", [3, 5], arr(rng, "f4", [3, 5]).tobytes()),
        ("hand.c", "U8", [8191], rng.integers(0, 256, size=8191, dtype=np.uint8).tobytes()),
        ("hand.d", "F16", [2049], arr(rng, "f2", [2049]).tobytes()),
    ]
    header = {}
    at = 0
    for name, dt, shape, data in payloads:
        header[name] = {"dtype": dt, "shape": shape, "data_offsets": [at, at + len(data)]}
        at += len(data)
    text = json.dumps(header, separators=(",", ":"))
    if len(text) % 2 == 0:
        text += " "
    hb = text.encode()
    assert len(hb) % 2 == 1 and (8 + len(hb)) % 8 != 0
    path = os.path.join(out, "handmade.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _, _, _, data in payloads:
            f.write(data)
    paths.append(path)

    lines = []
    for path in paths:
        with safe_open(path, framework="numpy") as f:
            for name in f.keys():
                data = np.ascontiguousarray(f.get_tensor(name)).tobytes()
                lines.append((name, hashlib.sha256(data).hexdigest()))
    lines.sort()
    for name, hexd in lines:
        print(f"{hexd}  {name}")


if __name__ == "__main__":
    main()
