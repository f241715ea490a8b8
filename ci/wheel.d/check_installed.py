#!/usr/bin/env python3
"""Run by ci/wheel inside a fresh venv that holds only the wheel, numpy and
safetensors (the reference reader), with no cargo or rustc on PATH: the
installed module is the wheel's (not a checkout's), it loads without a
toolchain, and `weightstream.load`, `stream` and `safe_open` hand back the
reference reader's bytes for checkpoints written by the reference writer
(several shards, odd byte lengths, an empty tensor, every numpy dtype
safetensors writes). Prints one line per check; exits non-zero on the first
difference."""

import json
import os
import shutil
import sys
import tempfile

import numpy as np
from safetensors import safe_open as ref_open
from safetensors.numpy import save_file

import weightstream


def fail(msg):
    print("ci/wheel check: " + msg, file=sys.stderr)
    sys.exit(1)


here = os.path.dirname(os.path.abspath(weightstream.__file__))
if "site-packages" not in here:
    fail(f"weightstream imported from {here}, not the venv's site-packages")
for tool in ("cargo", "rustc"):
    if shutil.which(tool):
        fail(f"{tool} is on PATH ({shutil.which(tool)}): the check must run without a toolchain")
print(f"weightstream {weightstream.__version__} from {here}")

rng = np.random.default_rng(7)
d = tempfile.mkdtemp(prefix="ws-wheel-")
dtypes = [np.float32, np.float16, np.float64, np.int8, np.uint8, np.int16, np.int32, np.int64, np.bool_]
shards, index = [], {}
for s in range(3):
    tensors = {}
    for i, dt in enumerate(dtypes):
        shape = (int(rng.integers(1, 40)), int(rng.integers(1, 33)) + s)
        if dt is np.bool_:
            a = rng.integers(0, 2, size=shape).astype(np.bool_)
        elif np.issubdtype(dt, np.integer):
            a = rng.integers(0, 100, size=shape).astype(dt)
        else:
            a = rng.standard_normal(shape).astype(dt)
        tensors[f"layer{s}.t{i}"] = a
    tensors[f"layer{s}.big"] = rng.standard_normal((1037, 515)).astype(np.float32)  # 2.1 MB, odd rows
    tensors[f"layer{s}.empty"] = np.zeros((0, 4), dtype=np.float32)
    name = f"model-{s + 1:05d}-of-00003.safetensors"
    save_file(tensors, os.path.join(d, name), metadata={"shard": "x" * (s * 7 + 1)})
    shards.append(name)
    index.update({k: name for k in tensors})
with open(os.path.join(d, "model.safetensors.index.json"), "w") as fh:
    json.dump({"metadata": {}, "weight_map": index}, fh)

ref = {}
for name in shards:
    with ref_open(os.path.join(d, name), framework="numpy") as f:
        for k in f.keys():
            ref[k] = f.get_tensor(k)


def same(what, got):
    if set(got) != set(ref):
        fail(f"{what}: names differ: {sorted(set(got) ^ set(ref))[:5]}")
    for k, a in ref.items():
        b = got[k]
        if b.dtype != a.dtype or b.shape != a.shape or b.tobytes() != a.tobytes():
            fail(f"{what}: {k} differs from the reference reader's ({b.dtype} {b.shape} vs {a.dtype} {a.shape})")
    print(f"{what}: {len(ref)} tensors, {sum(a.nbytes for a in ref.values())} bytes, equal to the reference reader's")


same("weightstream.load(folder)", weightstream.load(d, framework="np"))
same("weightstream.load(index json)", weightstream.load(os.path.join(d, "model.safetensors.index.json"), framework="np"))
same("weightstream.stream(folder)", dict(weightstream.stream(d, framework="np")))
got = {}
for name in shards:
    with weightstream.safe_open(os.path.join(d, name), framework="np") as f:
        for k in f.keys():
            got[k] = f.get_tensor(k)
same("weightstream.safe_open(each shard)", got)

# A bad input is an error naming the file, not a crash of the module.
bad = os.path.join(d, "bad.safetensors")
with open(bad, "wb") as fh:
    fh.write(b"\xff" * 16)
try:
    weightstream.safe_open(bad, framework="np")
except Exception as e:  # noqa: BLE001 - any exception type; what matters is the message
    if "bad.safetensors" not in str(e):
        fail(f"the error for a bad file does not name it: {e}")
    print(f"a bad file: {type(e).__name__} naming it")
else:
    fail("a bad file opened")
shutil.rmtree(d)
print("ci/wheel check: ok")
