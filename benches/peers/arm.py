#!/usr/bin/env python3
"""One peer loader, one model, this process: how long until every tensor's
every byte is in memory the process holds, with what CPU and peak memory.

    arm.py ARM MODEL_DIR [--digest FILE]

ARM:
  safetensors       safetensors.torch.load_file(shard) per shard, every
                    result kept in one dict (its default backend maps each
                    file; the tensors are views of the mapping, so they are
                    in memory only once the touch below has faulted them in)
  safetensors09     the same, run in a venv whose safetensors is 0.9
                    (benches/peers/venv-st09.sh; refused with another)
  runai             runai_model_streamer.SafetensorsStreamer() with its
                    defaults (kept open until the clock stops):
                    stream_files(shards), every (name, tensor) of
                    get_tensors() kept
  fastsafetensors   fastsafetensors' CPU path: SafeTensorsFileLoader(
                    SingleGroup(), "cpu", nogds=True), add_filenames,
                    copy_files_to_device, get_tensor of every key; the
                    loader and its buffers alive until the clock stops
  ws-py-load        weightstream.load(MODEL_DIR): the Python module's whole-
                    model load (one mapping, every drive), torch tensors
  ws-py-safeopen    weightstream.safe_open(shard, framework="pt") and
                    get_tensor of every key, per shard: the drop-in for
                    safetensors' reader (each tensor in memory of its own)
  digest-reference  no loader: each file's header parsed here (8-byte
                    little-endian length, JSON, data_offsets) and each
                    tensor's bytes read and hashed; needs --digest. The
                    digests every arm is compared with

Prints one JSON object on stdout (anything a native library prints on
stdout goes to stderr instead).

The timed region: imports happen before it; the baseline RSS (VmRSS) is
read just before it starts; it starts before the first file is opened
(the shard list from model.safetensors.index.json is read inside it, as
`weightstream load` reads the model's headers inside its own) and
before the loader is constructed (the engine's construction is in
`weightstream load`'s time too); it stops only when one byte of every
4096 of every tensor, and each tensor's last byte, has been read from
the memory the arm holds, so every page of every tensor is resident,
whether the loader copied it there or mapped it lazily.

--digest FILE, after the clock stopped: `sha256  name` lines (sha256 of
each tensor's raw little-endian bytes, sorted by name, the format of
sha256sum and of `weightstream digest`), so a driver can compare arms
byte for byte.

Fields: arm, model_dir, shards, tensors, bytes (sum of nbytes), seconds,
gbps (bytes / 1e9 / seconds), touch_seconds (of seconds: the touch above;
for a loader whose memory is already resident it is this script's cost,
about 16 ms for the 1.85 GB reference model, which `weightstream load`
does not pay), cpu_seconds (getrusage RUSAGE_SELF user +
sys over the timed region, every thread), cpu_seconds_per_gb,
busy_cpu_seconds (the whole machine's, /proc/stat user + nice + system +
irq + softirq + steal over the timed region), steal_seconds (of that, the
host's steal: this VM's CPUs runnable while the host ran something else),
peak_rss_bytes (ru_maxrss),
rss_baseline_bytes, peak_rss_over_baseline_bytes, rss_anon_bytes and
rss_file_bytes (RssAnon / RssFile when the clock stopped: a mapped
loader's tensors are file pages), page_cache_growth_bytes (Cached of
/proc/meminfo, the machine's), copied (whether this script copied the
tensors the loader gave it), versions, config (what the loader ran with).
"""
import argparse
import glob
import hashlib
import json
import os
import sys
import time
from importlib.metadata import PackageNotFoundError, version

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import busy_ticks, cpu_seconds, page_cache_bytes, peak_rss, status_bytes  # noqa: E402

PAGE = 4096
ARMS = ("safetensors", "safetensors09", "runai", "fastsafetensors", "ws-py-load", "ws-py-safeopen", "digest-reference")


def shard_list(model_dir):
    """The files model.safetensors.index.json names (sorted), else every
    *.safetensors in the directory (sorted)."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        sys.exit(f"arm.py: no *.safetensors and no model.safetensors.index.json in {model_dir}")
    return files


def pkg_version(name):
    try:
        return version(name)
    except PackageNotFoundError:
        return None


def raw_bytes(t):
    """A tensor's bytes as a flat uint8 view of the same memory (no copy)."""
    import torch

    if not t.is_contiguous():
        raise ValueError("a non-contiguous tensor: its bytes are not one run")
    if t.dim() == 0:
        t = t.reshape(1)
    return t.view(torch.uint8).reshape(-1)


def touch(tensors):
    """Read one byte of every 4096 of each tensor, and its last byte: every
    page any tensor's bytes lie on is then resident (a lazily mapped
    tensor's pages are faulted in from its file here). Cheap: one strided
    reduction per tensor, 1/4096 of the bytes."""
    s = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        u = raw_bytes(t)
        s += int(u[::PAGE].sum()) + int(u[-1])
    return s


def write_digests(path, named):
    """`sha256  name` per tensor, sorted by name."""
    lines = []
    for name in sorted(named):
        t = named[name]
        h = hashlib.sha256()
        if t.numel():
            h.update(memoryview(raw_bytes(t).numpy()))
        lines.append(f"{h.hexdigest()}  {name}\n")
    with open(path, "w") as f:
        f.writelines(lines)


def reference_digests(model_dir, path):
    """The reference: each tensor's bytes read straight from its file by the
    safetensors layout (u64 LE header length, JSON header, data_offsets
    relative to the end of the header), hashed in 16 MiB pieces."""
    out, nbytes = {}, 0
    for shard in shard_list(model_dir):
        with open(shard, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
            base = 8 + n
            for name, info in header.items():
                if name == "__metadata__":
                    continue
                if name in out:
                    sys.exit(f"arm.py: {name} is in more than one shard")
                start, end = info["data_offsets"]
                f.seek(base + start)
                h, left = hashlib.sha256(), end - start
                while left:
                    b = f.read(min(left, 16 << 20))
                    if not b:
                        sys.exit(f"arm.py: {shard} is truncated ({name})")
                    h.update(b)
                    left -= len(b)
                out[name] = h.hexdigest()
                nbytes += end - start
    with open(path, "w") as f:
        f.writelines(f"{out[k]}  {k}\n" for k in sorted(out))
    return len(out), nbytes


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("arm", choices=ARMS)
    ap.add_argument("model_dir")
    ap.add_argument("--digest", metavar="FILE", help="write `sha256  name` lines here after the clock stopped")
    a = ap.parse_args()
    model_dir = os.path.abspath(a.model_dir)

    # stdout carries the one JSON object: whatever a native library prints
    # there goes to stderr instead.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    if a.arm == "digest-reference":
        if not a.digest:
            sys.exit("arm.py: digest-reference needs --digest FILE")
        t0 = time.perf_counter()
        tensors, nbytes = reference_digests(model_dir, a.digest)
        json.dump({"arm": a.arm, "model_dir": model_dir, "tensors": tensors, "bytes": nbytes,
                   "seconds": time.perf_counter() - t0, "digest": os.path.abspath(a.digest)}, json_out)
        json_out.write("\n")
        return

    # Every import before the clock.
    import torch

    copied = False  # whether this script copies the tensors the loader gives it

    if a.arm in ("safetensors", "safetensors09"):
        from safetensors.torch import load_file
        pkg = "safetensors"
        if a.arm == "safetensors09" and not pkg_version(pkg).startswith("0.9"):
            sys.exit(f"arm.py: safetensors09 runs safetensors 0.9, this python has {pkg_version(pkg)}")
    elif a.arm == "runai":
        import inspect

        from runai_model_streamer import SafetensorsStreamer
        pkg = "runai-model-streamer"
        # Versions before stream_files took `owned` yield views into one
        # buffer they refill for the next request: there, every tensor is
        # cloned as it arrives (copied: true), else the bytes kept would be
        # another tensor's by the time the clock stops.
        copied = "owned" not in inspect.signature(SafetensorsStreamer.stream_files).parameters
    elif a.arm in ("ws-py-load", "ws-py-safeopen"):
        import weightstream
        pkg = "weightstream"
    else:
        from fastsafetensors import SafeTensorsFileLoader, SingleGroup
        pkg = "fastsafetensors"

    held = {}
    config = {}
    keep = []  # loader objects that must live until the clock stops

    busy0 = busy_ticks()
    cache0 = page_cache_bytes()
    cpu0 = cpu_seconds()
    rss0 = status_bytes("VmRSS")
    t0 = time.perf_counter()
    # ---- timed ----
    shards = shard_list(model_dir)
    if a.arm == "ws-py-load":
        # The model's own index and shards, read by the library (the shard
        # list above is not needed, and costs the same as the others').
        held = weightstream.load(model_dir)
    elif a.arm == "ws-py-safeopen":
        for shard in shards:
            with weightstream.safe_open(shard, framework="pt") as f:
                for name in f.keys():
                    if name in held:
                        sys.exit(f"arm.py: {name} is in more than one shard")
                    held[name] = f.get_tensor(name)
    elif a.arm in ("safetensors", "safetensors09"):
        for shard in shards:
            for name, t in load_file(shard).items():
                if name in held:
                    sys.exit(f"arm.py: {name} is in more than one shard")
                held[name] = t
    elif a.arm == "runai":
        # 0.17.1's stream_files(owned=True), the default: the ring's slots
        # are numpy buffers, a tensor is a view into one (torch.from_numpy,
        # then a dtype view), and a slot drained by get_tensors is dropped
        # by its SlotPool and replaced by a fresh allocation at the next
        # take, never refilled (file_streamer/slot_pool.py). So a kept
        # tensor keeps its slot alive and holds its bytes after the
        # iteration moves on: no copy needed, none made (copied: false).
        # With owned=False (not the default), or a version without it, the
        # slots are reused and each tensor has to be cloned here.
        streamer = SafetensorsStreamer()
        streamer.__enter__()
        keep.append(streamer)
        streamer.stream_files(shards)
        for name, t in streamer.get_tensors():
            if name in held:
                sys.exit(f"arm.py: {name} is in more than one shard")
            held[name] = t.clone() if copied else t
    else:
        # 0.5.0's CPU path: nogds=True is the "nogds" copier (16 threads,
        # 16 MiB of bounce buffers in 32 slots of 512 KiB: pread into a slot,
        # O_DIRECT unless the filesystem is a network or RAM one, then memcpy
        # into one posix_memalign'd buffer per shard). get_tensor hands out a
        # zero-copy view of that buffer which holds a reference to it (a
        # DLPack capsule over a SharedDeviceAllocation), so nothing is copied
        # here (copied: false); the loader and its buffers are still kept
        # until the clock stops.
        loader = SafeTensorsFileLoader(SingleGroup(), "cpu", nogds=True)
        keep.append(loader)
        loader.add_filenames({0: shards})
        fb = loader.copy_files_to_device()
        keep.append(fb)
        for name in loader.get_keys():
            held[name] = fb.get_tensor(name)
    t_touch = time.perf_counter()
    checksum = touch(held.values())
    # ---- clock stops ----
    t_end = time.perf_counter()
    seconds, touch_seconds = t_end - t0, t_end - t_touch
    cpu = cpu_seconds() - cpu0
    busy1 = busy_ticks()
    busy, steal = ((b - a) / os.sysconf("SC_CLK_TCK") for a, b in zip(busy0, busy1))
    cache = page_cache_bytes() - cache0
    rss_anon = status_bytes("RssAnon")
    rss_file = status_bytes("RssFile") + status_bytes("RssShmem")
    peak = peak_rss()

    if a.arm == "runai":
        ring = streamer.file_streamer.ring_info()
        if ring is not None:
            config["ring_buffers"], config["ring_buffer_bytes"] = ring[1], ring[2]
        config["unaligned_copies"] = streamer.unaligned_copies
        config["owned"] = not copied
        for k in ("RUNAI_STREAMER_MEMORY_LIMIT", "RUNAI_STREAMER_RING_BUFFERS", "RUNAI_STREAMER_CONCURRENCY",
                  "RUNAI_STREAMER_CHUNK_BYTESIZE", "RUNAI_STREAMER_FS_STRATEGY", "RUNAI_STREAMER_FS_QUEUE_DEPTH"):
            config[k] = os.environ.get(k)
    elif a.arm == "fastsafetensors":
        from fastsafetensors.common import is_odirect_enabled

        config.update(copier=type(loader).__name__ + "/" + loader.copier_class.__name__,
                      max_threads=16, bbuf_size_kb=16 * 1024,
                      o_direct=is_odirect_enabled(shards[0], buffered_ram_fs=True))
    elif a.arm in ("safetensors", "safetensors09"):
        config["backend"] = "mmap"

    if a.digest:
        write_digests(a.digest, held)

    nbytes = sum(t.numel() * t.element_size() for t in held.values())
    gb = nbytes / 1e9
    record = {
        "arm": a.arm,
        "model_dir": model_dir,
        "shards": len(shards),
        "tensors": len(held),
        "bytes": nbytes,
        "seconds": seconds,
        "gbps": gb / seconds,
        "touch_seconds": touch_seconds,
        "cpu_seconds": cpu,
        "cpu_seconds_per_gb": cpu / gb if gb else None,
        "busy_cpu_seconds": busy,
        "steal_seconds": steal,
        "peak_rss_bytes": peak,
        "rss_baseline_bytes": rss0,
        "peak_rss_over_baseline_bytes": peak - rss0,
        "rss_anon_bytes": rss_anon,
        "rss_file_bytes": rss_file,
        "page_cache_growth_bytes": cache,
        "copied": copied,
        "touch_checksum": checksum,
        "config": config,
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, pkg: pkg_version(pkg)},
    }
    if a.digest:
        record["digest"] = os.path.abspath(a.digest)
    json.dump(record, json_out)
    json_out.write("\n")
    json_out.flush()

    # Loader objects released only now.
    if a.arm == "runai":
        streamer.__exit__(None, None, None)
    elif a.arm == "fastsafetensors":
        fb.close()
        loader.close()
    del keep


if __name__ == "__main__":
    main()
