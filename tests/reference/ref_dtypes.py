#!/usr/bin/env python3
"""Every dtype of the reference reader, for tests/dtypes.rs.

Usage: ref_dtypes.py OUT_DIR

Asks the installed `safetensors` package (the reference) which dtypes its
reader accepts (the list its "unknown variant" error gives) and how many
bits each element takes (probed: the one byte length it accepts for 8
elements), and which dtypes its writer takes (`TensorSpec`).

Writes OUT_DIR/accepted/<DTYPE>.safetensors, one file per reader dtype:
tensors of several shapes (a matrix, one row, an empty one, and a scalar
where elements are whole bytes; sub-byte dtypes get element counts that
fill whole bytes), random bytes. Written by the reference writer
(`safetensors.serialize_file`) when it takes the dtype, otherwise by hand
(the writer of 0.8 has no F6 dtypes; its reader has), and then read back by
the reference reader (`safetensors.deserialize`), whose bytes are hashed.

Writes OUT_DIR/refused/<case>/<case>.safetensors, files the reference
reader refuses (an unknown dtype, names that are not the format's, sub-byte
dtypes whose bits do not fill whole bytes, dtype x shape != byte length,
an overflowing shape, a gap in the offsets, a non-string metadata value),
checking that it refuses each.

Prints one JSON object:
  {"version", "reader_dtypes": [[name, bits], ...], "writer_dtypes": [...],
   "accepted": {file: {tensor: {"dtype", "shape", "sha256"}}},
   "refused": {case: {"file", "error"}}}

Exit status 3 (with a message on stderr) when numpy or safetensors is
missing, so the caller can tell "no reference available" from a failure.
"""

import hashlib
import json
import math
import os
import re
import struct
import sys

try:
    import numpy as np
    import safetensors
except ImportError as e:  # pragma: no cover - environment dependent
    print(f"ref_dtypes.py: reference unavailable: {e}", file=sys.stderr)
    sys.exit(3)


def container(header, data=b""):
    """8-byte little-endian length, JSON header, data."""
    h = json.dumps(header, separators=(",", ":")).encode()
    return struct.pack("<Q", len(h)) + h + data


def read(buf):
    """The reference reader: [(name, {"dtype", "shape", "data"})]."""
    return safetensors.deserialize(buf)


def reader_dtypes():
    """(name, bits) of every dtype the reference reader accepts."""
    try:
        read(container({"t": {"dtype": "NOT_A_DTYPE", "shape": [1], "data_offsets": [0, 1]}}, b"\0"))
    except Exception as e:  # the error lists the accepted variants
        m = re.search(r"expected one of (.*?) at line", str(e))
        if not m:
            raise SystemExit(f"ref_dtypes.py: cannot find the dtype list in: {e}")
        names = re.findall(r"`([^`]+)`", m.group(1))
    else:
        raise SystemExit("ref_dtypes.py: the reference accepted dtype NOT_A_DTYPE")
    out = []
    for name in names:
        # 8 elements take exactly `bits` bytes.
        bits = None
        for b in range(1, 257):
            try:
                read(container({"t": {"dtype": name, "shape": [8], "data_offsets": [0, b]}}, b"\0" * b))
                bits = b
                break
            except Exception:
                pass
        if bits is None:
            raise SystemExit(f"ref_dtypes.py: no byte length accepted for dtype {name}")
        out.append((name, bits))
    return out


def writer_dtypes():
    """format code -> (constructor name, elements per storage byte factor)."""
    buf = np.zeros(16, dtype=np.uint8)
    try:
        safetensors.TensorSpec(dtype="not-a-dtype", shape=[1], data_ptr=buf.ctypes.data, data_len=1)
    except Exception as e:
        m = re.search(r"Supported dtypes: (.*)$", str(e))
        if not m:
            raise SystemExit(f"ref_dtypes.py: cannot find the writer's dtype list in: {e}")
        ctor = [x.strip() for x in m.group(1).split(",")]
    out = {}
    for c in ctor:
        spec = safetensors.TensorSpec(dtype=c, shape=[2], data_ptr=buf.ctypes.data, data_len=16)
        # The constructor turns a storage shape into the logical one (packed
        # dtypes double the last dimension).
        out[spec.dtype] = (c, spec.shape[-1] // 2)
    return out


def shapes(bits):
    """Shapes whose element count times `bits` fills whole bytes."""
    unit = 8 // math.gcd(bits, 8)  # elements per whole number of bytes
    # The unit goes in the last dimension: packed writer dtypes store it halved.
    v = [[5, 3 * unit], [unit], [0], [2, 0, unit]]
    if bits % 8 == 0:
        v.append([])  # a scalar: one element
    return v


def nbytes(bits, shape):
    n = 1
    for d in shape:
        n *= d
    assert (n * bits) % 8 == 0
    return n * bits // 8


def main():
    out = sys.argv[1]
    acc_dir = os.path.join(out, "accepted")
    os.makedirs(acc_dir, exist_ok=True)
    rng = np.random.default_rng(20251130)
    rdt = reader_dtypes()
    wdt = writer_dtypes()
    accepted = {}
    for name, bits in rdt:
        path = os.path.join(acc_dir, f"{name}.safetensors")
        tensors = {}
        keep = []  # buffers alive while the writer reads them
        for i, shape in enumerate(shapes(bits)):
            n = nbytes(bits, shape)
            data = rng.integers(0, 256, size=max(n, 1), dtype=np.uint8)[:n].copy()
            keep.append(data)
            tensors[f"{name}.t{i}"] = (shape, data)
        if name in wdt:
            ctor, per_byte = wdt[name]
            specs = {}
            for t, (shape, data) in tensors.items():
                storage = list(shape)
                if per_byte > 1 and storage:
                    storage[-1] //= per_byte
                spec = safetensors.TensorSpec(
                    dtype=ctor, shape=storage, data_ptr=data.ctypes.data, data_len=len(data)
                )
                assert list(spec.shape) == list(shape), (name, spec.shape, shape)
                specs[t] = spec
            safetensors.serialize_file(specs, path, metadata={"dtype": name})
        else:
            header = {"__metadata__": {"dtype": name, "writer": "by hand"}}
            at = 0
            blob = b""
            for t, (shape, data) in tensors.items():
                header[t] = {"dtype": name, "shape": shape, "data_offsets": [at, at + len(data)]}
                at += len(data)
                blob += data.tobytes()
            with open(path, "wb") as f:
                f.write(container(header, blob))
        with open(path, "rb") as f:
            got = read(f.read())
        files = {}
        for t, info in got:
            shape, data = tensors[t]
            assert info["dtype"] == name and list(info["shape"]) == shape, (t, info["dtype"], info["shape"])
            assert bytes(info["data"]) == data.tobytes(), t
            files[t] = {
                "dtype": info["dtype"],
                "shape": list(info["shape"]),
                "sha256": hashlib.sha256(bytes(info["data"])).hexdigest(),
            }
        assert set(files) == set(tensors), (name, set(files), set(tensors))
        accepted[f"{name}.safetensors"] = files

    def t(dtype, shape, n):
        return {"dtype": dtype, "shape": shape, "data_offsets": [0, n]}

    refused_cases = {
        "unknown_dtype": ({"a": t("Q9", [4], 4)}, 4),
        "lowercase_dtype": ({"a": t("c64", [1], 8)}, 8),
        "torch_fp8_name": ({"a": t("F8_E4M3FN", [4], 4)}, 4),
        "complex128": ({"a": t("C128", [1], 16)}, 16),
        "f4_odd_count": ({"a": t("F4", [3], 2)}, 2),
        "f6_half_byte": ({"a": t("F6_E2M3", [2], 2)}, 2),
        "f4_length_mismatch": ({"a": t("F4", [4], 3)}, 3),
        "c64_length_mismatch": ({"a": t("C64", [2], 8)}, 8),
        "fnuz_length_mismatch": ({"a": t("F8_E5M2FNUZ", [4], 5)}, 5),
        "shape_overflow": ({"a": t("U64", [2**62, 4], 0)}, 0),
        "offset_gap": ({"a": {"dtype": "U8", "shape": [2], "data_offsets": [1, 3]}}, 3),
        "metadata_not_string": ({"__metadata__": {"k": 1}, "a": t("U8", [2], 2)}, 2),
    }
    refused = {}
    for case, (header, n) in refused_cases.items():
        d = os.path.join(out, "refused", case)
        os.makedirs(d, exist_ok=True)
        path = os.path.join(d, f"{case}.safetensors")
        buf = container(header, bytes(range(n % 256)) + b"\x5a" * max(0, n - 256))
        with open(path, "wb") as f:
            f.write(buf)
        try:
            read(buf)
        except Exception as e:
            refused[case] = {"file": path, "error": str(e)}
        else:
            raise SystemExit(f"ref_dtypes.py: the reference accepted the {case} case")

    json.dump(
        {
            "version": safetensors.__version__,
            "reader_dtypes": rdt,
            "writer_dtypes": sorted(wdt),
            "accepted": accepted,
            "refused": refused,
        },
        sys.stdout,
        indent=1,
        sort_keys=True,
    )


if __name__ == "__main__":
    main()
