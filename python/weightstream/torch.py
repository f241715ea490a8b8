"""``safetensors.torch``'s reader (``load_file``), and loads shared across
the ranks of a ``torch.distributed`` process group (``load_distributed``)."""

from . import _backend, _device, _native, _paths, _model_path, _names, _on, _shard_rule, shard_bounds
from . import load as _load
from ._convert import torch_dtype as _torch_dtype
from ._convert import torch_shape as _torch_shape
from ._load_into import LoadIntoResult, load_into, transformers_rename  # noqa: F401 - the API


def load_file(filename, device="cpu", *, backend="mmap"):
    """``safetensors.torch.load_file``: ``{name: torch.Tensor}`` of one file,
    read O_DIRECT into memory the tensors keep alive, then moved to
    ``device`` when it is not the CPU (safetensors' device names).
    ``backend`` ("mmap" or "pread") is accepted and changes nothing: every
    tensor is read weightstream's way; another value is refused as
    safetensors refuses it."""
    dev = _device(device, "pytorch")
    _backend(backend)
    sd = _load(filename, framework="pt")
    return sd if dev is None else {k: _on(v, dev) for k, v in sd.items()}


# Reads a rank keeps in flight, refilled by a thread as each lands. Few:
# each read is already split into chunks over the drive's queue, and with
# many in flight a capped link is shared by all of them, so that they all
# land late (4 ranks at 100 MB/s each: 4.1 s with every read in flight at
# once, against 2 s of reading).
WINDOW = 4


class DistributedLoadError(RuntimeError):
    """A rank could not read its part: raised on every rank, naming the rank
    that failed and the file."""


def load_distributed(
    model,
    group=None,
    shard=None,
    device="cpu",
    *,
    dirs=None,
    mirrors=None,
    route=None,
    direct=None,
    names=None,
    report=None,
):
    """A state dict on every rank of ``group`` (default: the world), each
    rank reading only its part of the model from the drives and receiving
    the rest from the ranks that read it.

    - Without ``shard``, every rank ends with every tensor. The tensors are
      split over the ranks by bytes (largest first, each to the rank with
      the fewest bytes so far: no rank reads more than its share plus one
      tensor); each rank reads its part with weightstream, and each tensor
      is broadcast from the rank that read it.
    - Ranks that share a node (the same host name and boot id, or the same
      ``WEIGHTSTREAM_NODE``) also split by drive: the node's drives are
      shared out among its ranks, and a tensor goes to a rank that owns a
      drive holding it whenever that keeps the rank within its share plus
      the largest tensor, so the ranks of a node do not all contend for
      every drive (see ``_assign``).
    - With ``shard`` (as ``weightstream.load``'s: a rule table or a
      function, evaluated on each rank for that rank), each rank ends with
      its own slices and the whole of every tensor no rule slices. A slice
      that several ranks need (data-parallel replicas of one
      tensor-parallel rank) is read once, by one of them, and sent only to
      the others that need it.

    Collectives follow the group's backend: gloo moves CPU tensors, NCCL
    moves CUDA tensors (``device`` must then be a CUDA device). The bytes
    are sent as uint8, so every dtype travels (bf16, float8).

    The reads and the exchange overlap: each rank streams its items in
    file order (4 reads in flight, refilled by a thread as each lands, so
    they land one after another), and the exchange takes the ranks'
    items interleaved by when each lands (the bytes its reader reads before
    it), sending each as soon as it is there.

    Memory: a rank's final tensors, and nothing sized to the model. Every
    tensor or slice is read by one of the ranks that need it, into memory
    the tensor keeps; a receiver's bytes land in the tensor it keeps.

    Errors: a rank that cannot open the model or apply its ``shard`` rule
    says so when the ranks exchange their needs, and every rank raises
    ``DistributedLoadError`` with its message. A rank whose read fails
    sends a failure in place of that tensor
    (and of the rest it was to read), the exchange runs to its end, and
    then every rank raises ``DistributedLoadError`` naming the rank and the
    file. A rank that dies makes the others raise when the group's timeout
    expires.

    ``report``: a dict, filled with this rank's ``bytes_read`` (the
    payload bytes it read from the drives), ``bytes_sent``,
    ``bytes_received``, ``tensors_read``, ``seconds``, ``node``,
    ``drives_owned`` (``st_dev`` of the drives it owns on its node; empty
    when it owns none) and ``bytes_by_drive`` (what its engine read from
    each drive, by ``st_dev``; absent when it read nothing).
    """
    out = dict(
        iter_distributed(
            model, group, shard, device, dirs=dirs, mirrors=mirrors, route=route, direct=direct, names=names, report=report
        )
    )
    return dict(sorted(out.items()))


def iter_distributed(
    model,
    group=None,
    shard=None,
    device="cpu",
    *,
    dirs=None,
    mirrors=None,
    route=None,
    direct=None,
    names=None,
    select=None,
    report=None,
    env=False,
    inherit=True,
):
    """:func:`load_distributed` as a stream: yields ``(name, tensor)`` on
    every rank as the exchange reaches each tensor (the rank's own reads
    and what the others send it), so a consumer that copies each tensor
    away (vLLM's ``load_weights``) holds a window of tensors, not the
    model. The same plan, reads and exchange; its errors are raised when
    the stream ends (every rank raises ``DistributedLoadError``), after the
    tensors that arrived were yielded, so a consumer must not treat a
    stream that raised as loaded. ``select``: only these tensor names (a
    set), on every rank; ``env``: the ``WEIGHTSTREAM_*`` layout variables
    apply where ``dirs``, ``mirrors``, ``route`` or ``direct`` are not given;
    ``inherit=False``: the tensors this rank reads are not handed to forked
    children (for a consumer that copies each away and forks nothing).
    """
    import time

    import torch
    import torch.distributed as dist

    t0 = time.perf_counter()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("load_distributed: torch.distributed is not initialized (init_process_group first)")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    backend = str(dist.get_backend(group)).lower()
    device = torch.device(device)
    wire = device if backend == "nccl" else torch.device("cpu")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"load_distributed: an NCCL group moves CUDA tensors; device={device} is not one")
    path, names = _model_path(model), _names(names)

    # The catalog, in file order: every rank reads the same headers and so
    # computes the same plan. What each rank needs: {name: bounds or None
    # (whole)}, gathered so every rank knows every rank's needs. A rank
    # that cannot open the model or apply its rule says so in the gather,
    # and every rank raises (none is left waiting for it).
    try:
        catalog = _native.catalog(path, dirs=_paths(dirs), mirrors=_paths(mirrors), env=env)
        info = {name: (dtype, list(shape), nbytes, file, offset) for name, dtype, shape, nbytes, file, offset, _ in catalog}
        drives_of = {name: tuple(drives) for name, *_, drives in catalog}
        order = sorted(info, key=lambda n: (info[n][3], info[n][4], n))
        if names:
            order = [n for n in order if any(p in n for p in names)]
        if select is not None:
            order = [n for n in order if n in select]
        mine = _needs(order, info, shard)
        # Every tensor this rank will hold must have a torch type here: a
        # dtype the installed torch lacks (F6, F4 before torch 2.8) is said
        # now, by every rank, never raised by a receiver mid-exchange.
        for n, bounds in mine.items():
            dtype, shape = info[n][0], info[n][1]
            block = shape if bounds is None else [b - a for a, b in bounds] + shape[len(bounds) :]
            try:
                _torch_dtype(dtype)
                _torch_shape(dtype, block, n)
            except TypeError as e:
                raise TypeError(f"tensor {n} in {info[n][3]}: {e}") from None
        mine[_NODE] = _node_key()
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        mine = {_ERROR: f"rank {rank}: {e}"}
    needs = [None] * world
    dist.all_gather_object(needs, mine, group=group)
    bad = next((v[_ERROR] for v in needs if _ERROR in v), None)
    if bad:
        raise DistributedLoadError(bad)
    nodes = [v.pop(_NODE) for v in needs]

    # Items: (name, bounds) -> the ranks needing it, in file order; each
    # read by one of them, the one with the fewest bytes so far.
    items = []
    for n in order:
        by_block = {}
        for r in range(world):
            if n in needs[r]:
                key = None if needs[r][n] is None else tuple(tuple(x) for x in needs[r][n])
                by_block.setdefault(key, []).append(r)
        for key, ranks in by_block.items():
            items.append((n, key, ranks))
    sized = [(i, ranks, _block_bytes(info[n], key), drives_of[n]) for i, (n, key, ranks) in enumerate(items)]
    readers, owned = _assign(sized, world, nodes)
    assigned = [(i, n, key, ranks, readers[i], sized[i][2]) for i, (n, key, ranks) in enumerate(items)]
    # Each rank reads its items in file order; the exchange takes them
    # interleaved by when each lands on its reader (the bytes it reads
    # before it), so every rank's reads feed it at once.
    ahead = [0] * world
    plan = []
    for i, n, key, ranks, reader, nbytes in sorted(assigned):
        plan.append((ahead[reader], i, n, key, ranks, reader, nbytes))
        ahead[reader] += nbytes
    plan = [p[2:] for p in sorted(plan, key=lambda p: (p[0], p[1]))]

    # The reads and the exchange overlap: this rank's items stream in plan
    # order (WINDOW reads in flight, each into memory of its own, which the
    # tensor keeps), and each is sent as soon as the exchange reaches it,
    # while the rank's later reads (and every other rank's) go on.
    stats = {
        "bytes_read": 0,
        "bytes_sent": 0,
        "bytes_received": 0,
        "tensors_read": 0,
        "rank": rank,
        "world": world,
        "node": nodes[rank],
        "drives_owned": sorted(owned[rank]),
    }
    my_items = [(n, None if key is None else [tuple(x) for x in key]) for n, key, _, reader, _ in plan if reader == rank]
    failure = None
    landed = stream = pump = None
    if my_items:
        try:
            stream = _native.Stream(
                path,
                dirs=_paths(dirs),
                mirrors=_paths(mirrors),
                route=route,
                direct=direct,
                window=WINDOW,
                items=my_items,
                env=env,
                inherit=inherit,
            )
            landed, pump = _pump(stream)
        except Exception as e:  # noqa: BLE001 - sent to the others, raised at the end
            failure = ("own", f"rank {rank}: opening {path}: {e}")
    from ._convert import to_torch

    status = torch.zeros(1, dtype=torch.int64, device=wire)

    def moved(t):
        return t if device.type == "cpu" else t.to(device)

    for n, key, ranks, reader, nbytes in plan:
        if rank not in ranks:
            continue
        dtype, shape, _, file, _ = info[n]
        block = shape if key is None else [b - a for a, b in key] + shape[len(key) :]
        others = [r for r in ranks if r != rank]
        if rank == reader:
            t = None
            if failure is None:
                try:
                    kind, got = landed.get()
                    if kind == "error":
                        raise got
                    name, dt, shp, payload = got
                    if name != n:
                        raise RuntimeError(f"the read stream handed {name} where {n} was due (a bug in weightstream)")
                    t = to_torch(payload, dt, shp)
                    stats["tensors_read"] += 1
                    stats["bytes_read"] += nbytes
                except Exception as e:  # noqa: BLE001 - sent to the others, raised at the end
                    failure = ("own", f"rank {rank}: reading {n} from {file}: {e}")
            if others and nbytes:
                stats["bytes_sent"] += _send(t, others, ranks, world, rank, group, dist, torch, wire, status)
            if t is not None:
                yield n, moved(t)
        elif nbytes == 0:
            yield n, moved(torch.empty(_torch_shape(dtype, block, n), dtype=_torch_dtype(dtype)))
        else:
            t = _receive(reader, ranks, world, group, dist, torch, wire, status, dtype, block, nbytes)
            if t is None:
                failure = failure or ("heard", f"rank {reader}: reading {n} from {file} failed")
            else:
                stats["bytes_received"] += nbytes
                yield n, moved(t)
    if pump is not None:
        # Every item was taken; the thread's last call (its StopIteration)
        # may still be running: the engine's counters wait for it.
        pump.join()
        try:
            stats["bytes_by_drive"] = _bytes_by_drive(stream)
        except Exception as e:  # noqa: BLE001 - a report field, never the load's failure
            stats["bytes_by_drive_error"] = str(e)
    fails = [None] * world
    dist.all_gather_object(fails, failure, group=group)
    if any(fails):
        # The failing rank's own message (with its cause) where there is one.
        kind, msg = next((f for f in fails if f and f[0] == "own"), next(f for f in fails if f))
        raise DistributedLoadError(msg)
    stats["seconds"] = time.perf_counter() - t0
    if report is not None:
        report.update(stats)


# The keys of a gathered needs dict that carry a rank's error instead, and
# the node it runs on (neither can be a tensor name: safetensors names are
# JSON strings, and these begin with a NUL that no caller's name does).
_ERROR = "\0error"
_NODE = "\0node"


def _node_key():
    """The machine this rank runs on: ranks with the same key share a node,
    and so its drives. The host name and the kernel's boot id, or the
    ``WEIGHTSTREAM_NODE`` environment variable where set (a simulation of
    nodes on one machine gives each rank its own)."""
    import os
    import socket

    forced = os.environ.get("WEIGHTSTREAM_NODE")
    if forced:
        return forced
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _assign(sized, world, nodes):
    """Who reads what: ``sized`` is ``[(item, ranks needing it, bytes,
    drives of its copies)]``, ``nodes`` each rank's node key. Returns
    ``{item: reader}`` and each rank's owned drives (a set of ``st_dev``).

    By bytes: largest first, each item to the least-loaded rank that needs
    it, ties by item order then rank, so no rank reads more than its share
    plus one item (where every rank needs every item).

    By drive, where ranks share a node: the node's drives are split among
    its ranks (largest first, each drive to the rank owning the fewest
    bytes; with fewer drives than ranks, several ranks share one), and an
    item goes to the least-loaded rank that needs it and owns a drive of
    one of its copies, as long as that rank stays within the bound above
    (its share plus the largest item); otherwise to the least-loaded rank
    that needs it. So ranks on one node read from different drives instead
    of all of them contending for each, without reading more than the
    bound: on a node whose drives hold equal bytes, each rank reads from
    its own drives only."""
    by_node = {}
    for r in range(world):
        by_node.setdefault(nodes[r], []).append(r)
    owned = [set() for _ in range(world)]
    for ranks in by_node.values():
        drive_bytes = {}
        for _, needing, nbytes, drives in sized:
            if drives and any(r in ranks for r in needing):
                for d in drives:
                    drive_bytes[d] = drive_bytes.get(d, 0) + nbytes / len(drives)
        if len(ranks) < 2 or len(drive_bytes) < 2:
            continue  # one rank, or one drive: nothing to split
        by_size = sorted(drive_bytes, key=lambda d: (-drive_bytes[d], d))
        if len(by_size) >= len(ranks):
            held = {r: 0.0 for r in ranks}
            for d in by_size:
                r = min(ranks, key=lambda r: (held[r], r))
                owned[r].add(d)
                held[r] += drive_bytes[d]
        else:
            for j, r in enumerate(ranks):
                owned[r].add(by_size[j % len(by_size)])
    total = sum(nbytes for _, _, nbytes, _ in sized)
    largest = max((nbytes for _, _, nbytes, _ in sized), default=0)
    bound = total / world + largest
    load = [0] * world
    readers = {}
    for i, needing, nbytes, drives in sorted(sized, key=lambda x: (-x[2], x[0])):
        least = min(needing, key=lambda r: (load[r], r))
        homed = [r for r in needing if owned[r] & set(drives) and load[r] + nbytes <= bound]
        reader = min(homed, key=lambda r: (load[r], r)) if homed else least
        load[reader] += nbytes
        readers[i] = reader
    return readers, owned


def _bytes_by_drive(stream):
    """The payload bytes a stream's engine read, per drive (``st_dev`` of
    its mount, as the catalog names drives)."""
    import json
    import os

    out = {}
    for d in json.loads(stream.stats_json()).get("drives", []):
        try:
            dev = os.stat(d["mount"]).st_dev
        except (OSError, KeyError):
            continue
        if d.get("bytes"):
            out[dev] = out.get(dev, 0) + d["bytes"]
    return out


def _needs(order, info, shard):
    """This rank's needs: {name: None (whole) or a range per dimension up
    to the one its rule slices}."""
    rule = _shard_rule(shard) if shard is not None else None
    mine = {}
    for n in order:
        spec = rule(n, info[n][1]) if rule else None
        if spec is None:
            mine[n] = None
            continue
        b = shard_bounds(n, info[n][1], spec)
        if b[-1][0] == b[-1][1]:
            raise ValueError(f"tensor {n}: rank {spec[1]} of {spec[2]} gets nothing of dimension {len(b) - 1}")
        mine[n] = None if all(x == (0, m) for x, m in zip(b, info[n][1])) else [tuple(x) for x in b]
    return mine


def _block_bytes(entry, key):
    """Bytes of the block ``key`` keeps of a tensor (its elements times the
    tensor's bytes per element, exact for sub-byte dtypes too: a slice's
    runs are whole bytes, or the slice was refused)."""
    dtype, shape, nbytes, _, _ = entry
    if key is None:
        return nbytes
    elems = 1
    for n in shape:
        elems *= n
    b = 1
    for (a, z), n in zip(key, shape):
        b *= z - a
    for n in shape[len(key) :]:
        b *= n
    return b * nbytes // elems if elems else 0


def _pump(stream):
    """A queue of the stream's items as they land, filled by a thread of
    its own, and that thread: the reads go on back to back (the stream
    refills its window at each item) while the caller is busy exchanging.
    A failed read is an ("error", exception) item in its place. The thread
    ends with the stream (it holds no lock the caller needs; waits release
    the GIL)."""
    import queue
    import threading

    q = queue.Queue()

    def run():
        while True:
            try:
                item = next(stream)
            except StopIteration:
                return
            except BaseException as e:  # noqa: BLE001 - handed to the caller in turn
                q.put(("error", e))
                continue
            q.put(("ok", item))

    thread = threading.Thread(target=run, name="ws-dist-reads", daemon=True)
    thread.start()
    return q, thread


def _send(t, others, ranks, world, rank, group, dist, torch, wire, status):
    """The reader's side of one item: a status (0: the bytes follow; 1: the
    read failed, nothing follows), then the bytes, to every other rank that
    needs it (a broadcast when every rank does). Returns the bytes sent."""
    me = dist.get_global_rank(group, rank) if group is not None else rank
    status.fill_(0 if t is not None else 1)
    raw = None if t is None else t.contiguous().reshape(-1).view(torch.uint8).to(wire)
    if len(ranks) == world:
        dist.broadcast(status, src=me, group=group)
        if raw is not None:
            dist.broadcast(raw, src=me, group=group)
    else:
        for r in others:
            dst = dist.get_global_rank(group, r) if group is not None else r
            dist.send(status, dst=dst, group=group)
            if raw is not None:
                dist.send(raw, dst=dst, group=group)
    return 0 if raw is None else raw.numel() * len(others)


def _receive(reader, ranks, world, group, dist, torch, wire, status, dtype, block, nbytes):
    """A receiver's side of one item: the status, then the bytes, into
    memory of its own (its final tensor), viewed as the tensor; None when
    the reader's read failed."""
    src = dist.get_global_rank(group, reader) if group is not None else reader
    if len(ranks) == world:
        dist.broadcast(status, src=src, group=group)
    else:
        dist.recv(status, src=src, group=group)
    if int(status.item()) != 0:
        return None
    raw = torch.empty(nbytes, dtype=torch.uint8, device=wire)
    if len(ranks) == world:
        dist.broadcast(raw, src=src, group=group)
    else:
        dist.recv(raw, src=src, group=group)
    return raw.view(_torch_dtype(dtype)).reshape(_torch_shape(dtype, block))
