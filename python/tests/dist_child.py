"""One rank of a load_distributed test (run by test_distributed.py).

argv: MODEL INIT_FILE RANK WORLD OUT_JSON MODE
MODE: "all" (every tensor on every rank), "split" (a split model, its
second folder in WS_TEST_SPLIT_DIR), "tp2" (tensor parallel 2 inside
the world: rank r is TP rank r % 2), "fail1" (rank 1's read fails), "badrule" (rank 1's shard rule is
wrong), "die1" (rank 1 exits before the exchange).
Writes {name: [dtype, shape, sha256]} and the report to OUT_JSON, or
{"error": message} when load_distributed raised.
"""

import datetime
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

import weightstream
import weightstream.torch as wt

model, init, rank, world, out, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6]
# The group's timeout: what the dead-rank test waits out (20 s); a watchdog
# elsewhere, long enough for ranks that import torch at once on two busy
# cores.
timeout = datetime.timedelta(seconds=20 if mode == "die1" else 180)
dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=timeout)

shard = None
if mode == "tp2":
    tp = rank % 2
    shard = {"*.q.weight": (0, tp, 2), "*.k.weight": (1, tp, 2)}
if mode == "fail1" and rank == 1:
    # Rank 1's second read fails as a drive error would (the library's
    # errors name the file; this one is raised in its place).
    real = weightstream._native.Stream

    class Broken:
        def __init__(self, *a, **k):
            self.inner = real(*a, **k)
            self.n = 0

        def __iter__(self):
            return self

        def stats_json(self):
            return self.inner.stats_json()

        def __next__(self):
            self.n += 1
            item = next(self.inner)
            if self.n == 2:
                raise OSError("Input/output error (os error 5) (simulated)")
            return item

    weightstream._native.Stream = Broken
if mode == "badrule":
    # Rank 1's rule names a dimension the tensors do not have.
    shard = {"*.q.weight": (5, 0, 2)} if rank == 1 else None
if mode == "die1" and rank == 1:
    os._exit(3)

dirs = [os.environ["WS_TEST_SPLIT_DIR"]] if mode == "split" else None
report = {}
try:
    sd = wt.load_distributed(model, shard=shard, dirs=dirs, report=report)
    res = {
        n: [str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()]
        for n, t in sd.items()
    }
    json.dump({"tensors": res, "report": report}, open(out, "w"))
except Exception as e:  # noqa: BLE001
    json.dump({"error": f"{type(e).__name__}: {e}"}, open(out, "w"))
try:
    dist.destroy_process_group()
except Exception:  # noqa: BLE001
    pass
