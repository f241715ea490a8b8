#!/usr/bin/env python3
"""One rank of benches/distributed.sh: joins its own blkio cgroup (its
link to the storage), the gloo group, then times one load to a full state
dict on every rank.

Usage: rank.py ARM MODEL_DIR INIT_FILE RANK WORLD OUT_JSON [CGROUP_DIR]

Arms:
  ws-dist   weightstream.torch.load_distributed(MODEL_DIR): each rank reads
            about 1/WORLD of the bytes, the rest arrives over gloo
  ws-each   weightstream.load(MODEL_DIR) on every rank: every rank reads
            every byte (what each node does today)
  runai-dist  runai_model_streamer.SafetensorsStreamer, stream_files(...,
            is_distributed=True) over the same gloo group (RUNAI_STREAMER_DIST=1:
            its gloo mode), every tensor kept (cloned: its buffers are reused)

  ws-share  no exchange: each rank reads only the tensors load_distributed
            would give it (by bytes, largest first, each to the rank with
            the fewest bytes so far) with weightstream.load(names=...), and
            keeps them: one rank's read of its share at its cap, the other
            floor under ws-dist

  gloo-floor  no reads: every tensor's bytes broadcast over the group from
            rank i % world (the exchange alone: the floor under ws-dist)

The clock: a barrier, then the load, then a barrier (so the time is the
slowest rank's, to every rank holding the whole state dict); every tensor's
pages are touched before the second barrier. Writes one JSON line.
"""

import datetime
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import peak_rss  # noqa: E402


def main():
    arm, model, init, rank, world, out = sys.argv[1:7]
    rank, world = int(rank), int(world)
    if len(sys.argv) > 7 and sys.argv[7]:
        with open(os.path.join(sys.argv[7], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    shards = sorted(os.path.join(model, f) for f in os.listdir(model) if f.endswith(".safetensors"))
    cpu0 = time.process_time()
    dist.barrier()
    t0 = time.perf_counter()
    report = {}
    if arm == "ws-dist":
        import weightstream.torch as wt

        # Each rank stands for a node of its own (its own link to the
        # storage): no split by drive among ranks of one node.
        os.environ["WEIGHTSTREAM_NODE"] = f"simulated-node-{rank}"

        sd = wt.load_distributed(model, report=report)
    elif arm == "ws-each":
        import weightstream

        sd = weightstream.load(model)
    elif arm == "runai-dist":
        # Its distributed mode runs over gloo only when asked (by default
        # only NCCL groups distribute).
        os.environ["RUNAI_STREAMER_DIST"] = "1"
        import logging

        # Its own log says whether it distributed (kept in the record).
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        from runai_model_streamer import SafetensorsStreamer

        sd = {}
        with SafetensorsStreamer() as s:
            s.stream_files(shards, is_distributed=True, device="cpu")
            for name, t in s.get_tensors():
                sd[name] = t.clone()
    elif arm == "ws-share":
        import weightstream

        os.environ["WEIGHTSTREAM_NODE"] = f"simulated-node-{rank}"
        items = [(name, nbytes) for name, _dtype, _shape, nbytes, *_ in weightstream._native.catalog(model)]
        load = [0] * world
        mine = []
        for name, nbytes in sorted(items, key=lambda x: (-x[1], x[0])):
            r = min(range(world), key=lambda k: (load[k], k))
            load[r] += nbytes
            if r == rank:
                mine.append(name)
        sd = weightstream.load(model, names=mine, report=report) if mine else {}
        if set(sd) != set(mine):
            sys.exit(f"rank.py: ws-share read {len(sd)} tensors, its share is {len(mine)}")
        report["bytes_read"] = sum(t.numel() * t.element_size() for t in sd.values())
    elif arm == "gloo-floor":
        # No reads: the exchange alone. Every tensor (its bytes, from the
        # catalog) broadcast from rank i % world, as load_distributed's
        # exchange moves them: the floor this machine puts under any
        # shared load over gloo.
        import weightstream

        sd = {}
        for i, (name, _dtype, _shape, nbytes, *_) in enumerate(weightstream._native.catalog(model)):
            buf = torch.empty(nbytes, dtype=torch.uint8)
            if nbytes:
                dist.broadcast(buf, src=i % world)
            sd[name] = buf
    else:
        sys.exit(f"rank.py: unknown arm {arm}")
    touched = 0
    for t in sd.values():
        if t.numel():
            u = t.reshape(-1).view(torch.uint8)
            touched += int(u[::4096].sum()) + int(u[-1])
    dist.barrier()
    seconds = time.perf_counter() - t0
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    rec = {
        "arm": arm,
        "rank": rank,
        "world": world,
        "seconds": seconds,
        "bytes": nbytes,
        "tensors": len(sd),
        "gbps": nbytes / seconds / 1e9,
        "cpu_seconds": time.process_time() - cpu0,
        "peak_rss_bytes": peak_rss(),
        "report": report,
    }
    with open(out, "w") as f:
        json.dump(rec, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
