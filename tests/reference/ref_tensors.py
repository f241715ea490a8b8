#!/usr/bin/env python3
"""What the reference reader says of every tensor of every shard in a
folder, for `weightstream inspect --tensors` (crates/cli/tests/doors.rs).

Usage: ref_tensors.py DIR

Prints one JSON object, {tensor name: {"file", "dtype", "shape", "bytes",
"offset"}}, over every `*.safetensors` file of DIR: dtype and shape as
`safetensors.safe_open(path, framework="numpy").get_slice(name)` gives
them, bytes as the reference reader's array holds them, and the payload's
offset in its file from the format's own definition (8 + the header's
length + the tensor's first data offset), read from the header here,
independently of weightstream.

Exit status 3 (with a message on stderr) when numpy or safetensors is
missing.
"""

import json
import os
import struct
import sys

try:
    from safetensors import safe_open
except ImportError as e:  # pragma: no cover - environment dependent
    print(f"ref_tensors.py: reference reader unavailable: {e}", file=sys.stderr)
    sys.exit(3)


def main():
    d = sys.argv[1]
    out = {}
    for f in sorted(os.listdir(d)):
        if not f.endswith(".safetensors"):
            continue
        path = os.path.join(d, f)
        with open(path, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        with safe_open(path, framework="numpy") as st:
            for name in st.keys():
                s = st.get_slice(name)
                out[name] = {
                    "file": f,
                    "dtype": s.get_dtype(),
                    "shape": list(s.get_shape()),
                    "bytes": st.get_tensor(name).nbytes,
                    "offset": 8 + n + header[name]["data_offsets"][0],
                }
    json.dump(out, sys.stdout, sort_keys=True)


if __name__ == "__main__":
    main()
