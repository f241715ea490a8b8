"""One rank of a test of the reads the tensor-parallel ranks share
(_tp_share; run by test_tp_share.py).

argv: MODEL INIT_FILE RANK WORLD OUT_JSON MODE
MODE: "ok"; "batches" (batches of 64 KiB: many, both halves reused);
"fail1" (rank 1's shared read fails); "abandon1" (rank 1 fails before the
agreement and abandons it); "nobuffer" (rank 1 cannot open rank 0's
buffer: every rank reads alone); "ondevice" (a.narrow lands on another
device: read alone, named).
Each rank's plan: every tensor of the model, split as a tensor-parallel
rank takes it (``SPLITS``). Writes {name: sha256 of the rank's part}, the
reference's, the report, the bytes the engine read from the drives and
the /proc/self/io read_bytes over the fill, or
{"error": message}.
"""

import datetime
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from weightstream import _native
from weightstream import _tp_share as ts
from weightstream import _weight_plan as wp
from weightstream._vllm_loader import _read_bytes

model, init, rank, world, out, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
group = dist.new_group(list(range(world)), backend="gloo")

# How each tensor is split: "rows" (dimension 0), "cols" (the last),
# "whole" (replicated), "strided" (columns into columns of a wider
# parameter: a destination of one piece per row),
# "two" (columns, written into two parameters: its first rows and the rest).
SPLITS = {"narrow": "cols", "wide": "cols", "rows": "rows", "norm": "whole", "strided": "cols", "two": "cols", "f8": "cols"}


def part(shape, how, r, w):
    box = [(0, n) for n in shape]
    d = 0 if how == "rows" else len(shape) - 1
    if how != "whole":
        n = shape[d] // w
        box[d] = (r * n, (r + 1) * n)
    return box


def sha(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()).hexdigest()


reader = _native.Reader(model)
from safetensors.torch import load_file  # noqa: E402

ref = {}
for f in sorted(os.listdir(model)):
    ref.update(load_file(os.path.join(model, f)))
plan = wp.Plan()
dests, want = {}, {}
for name, how in ((p + n, how) for p in ("a.", "b.") for n, how in SPLITS.items()):
    t = ref[name]
    box = part(list(t.shape), how, rank, world)
    sl = t[tuple(slice(a, z) for a, z in box)]
    want[name] = sha(sl)
    if name.endswith("strided"):
        dest = torch.empty((sl.shape[0], sl.shape[1] + 16), dtype=t.dtype)[:, 8 : 8 + sl.shape[1]]
        plan.writes.append(wp.Write(("m", name), box, dest))
        dests[name] = [dest]
    elif name.endswith("two"):
        h = box[0][1] // 2
        a = torch.empty((h, sl.shape[1]), dtype=t.dtype)
        b = torch.empty((sl.shape[0] - h, sl.shape[1]), dtype=t.dtype)
        plan.writes.append(wp.Write(("m", name), [(0, h), box[1]], a))
        plan.writes.append(wp.Write(("m", name), [(h, box[0][1]), box[1]], b))
        dests[name] = [a, b]
    else:
        dest = torch.empty(sl.shape, dtype=t.dtype)
        plan.writes.append(wp.Write(("m", name), box, dest))
        dests[name] = [dest]
readers = {"m": reader}
if mode == "batches":
    ts.BATCH_BYTES = 64 << 10
if mode == "fail1" and rank == 1:

    class Broken:
        """rank 1's reader, its reads failing as a drive's would."""

        def __getattr__(self, a):
            if a == "_fill":

                def fail(targets, *x, **k):
                    raise OSError("model-00001-of-00002.safetensors: Input/output error (os error 5) (simulated)")

                return fail
            return getattr(reader, a)

    readers = {"m": Broken()}
real_open = os.open
if mode == "nobuffer" and rank == 1:

    def no_proc(path, *a, **k):
        if str(path).startswith("/proc/") and "/fd/" in str(path):
            raise PermissionError(13, "Permission denied (simulated)", path)
        return real_open(path, *a, **k)

    os.open = no_proc
block = reader.direct_align()


def drive_bytes():
    """What the engine has read from the drives (its stats)."""
    return sum(d["bytes"] for d in json.loads(reader.stats_json())["drives"])


res = {"want": want}
try:
    read0 = _read_bytes()
    drive0 = drive_bytes()
    if mode == "abandon1" and rank == 1:
        ts.abandon(group, ValueError("a loader raised on a stand-in (simulated)"))
        raise ValueError("a loader raised on a stand-in (simulated)")
    if mode == "ondevice":
        # a.narrow lands on another device (meta stands in for one: split
        # only looks at where it lands, and the test reads it no further).
        for w in plan.writes:
            if w.key == ("m", "a.narrow"):
                w.dest = torch.empty(w.dest.shape, dtype=w.dest.dtype, device="meta")
    own, shared = ts.split(plan, readers, group, block)
    if mode == "ondevice":
        own.writes = [w for w in own.writes if w.dest.device.type == "cpu"]
        dests["a.narrow"] = [torch.zeros(1, dtype=torch.uint8)]
        want["a.narrow"] = sha(torch.zeros(1, dtype=torch.uint8))
    done = ts.run(shared, readers, block)
    if not done:
        own = plan
    os.open = real_open
    wp.fill(own, {"m": reader})
    res["read_bytes"] = _read_bytes() - read0
    res["drive_bytes"] = drive_bytes() - drive0
    res["done"] = done
    res["report"] = shared.report
    res["shared"] = sorted(k[1] for k in shared.writes)
    res["got"] = {name: sha(torch.cat([d.contiguous() for d in ds])) for name, ds in dests.items()}
except Exception as e:  # noqa: BLE001
    import traceback

    res["error"] = f"{type(e).__name__}: {e}"
    res["traceback"] = traceback.format_exc()
json.dump(res, open(out, "w"))
try:
    dist.destroy_process_group()
except Exception:  # noqa: BLE001
    pass
