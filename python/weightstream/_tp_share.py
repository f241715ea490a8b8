"""Reads shared by the ranks of a tensor-parallel group on one host, for
the checkpoint tensors a rank cannot read its part of alone.

A row-parallel weight (``o_proj``, ``down_proj``, an expert's ``w2``)
gives each rank a range of columns: in the file, a short run of every
row. When a rank's run or the run between is under a few blocks, reading
the rank's part alone moves the whole tensor (every O_DIRECT block holds
bytes of both ranks: a Llama-shaped ``o_proj`` of hidden size 2048 in
BF16 has 2 KiB half-rows). Such a tensor is read once by the group
instead: each rank reads a contiguous share of its bytes (1/W, split at
block boundaries) in place into one buffer the ranks map together (a
memfd), the group waits for every share, and each rank copies its own
boxes out of it. Each rank then moves 1/W of the tensor from the drives
where it moved all of it; the copy out of the buffer is the one the
staged read made anyway.

Which tensors: those whose planned writes on this rank are all into CPU
memory and would move more than ``SHARE_ABOVE`` times the rank's share
of the tensor read alone (``Reader._slice_read_bytes``: the engine's own
slice plan), on every rank of the group (an all-gather agrees on them).
Ranks on more than one host, or a buffer that cannot be made or opened,
read alone as before, the reason said in the report and vLLM's log.

Memory: two halves of at most ``BATCH_BYTES`` (and a block) each; a
batch is read into one half while the last one's is copied out. A
tensor larger than that is read in pieces of whole rows, when every
destination it lands in is contiguous (its rows of a box are then a run
of the destination); one that cannot be cut so is read alone, named in
the report (``too_large``). A rank reuses a half only after the group's
gather that follows every rank's copies out of it, so nothing is
overwritten while a rank reads it.

Errors: every collective carries each rank's error, so a rank that fails
(a read, a copy, the trace before any of it) makes every rank raise with
its message instead of leaving the others waiting in a collective.
"""

import hashlib
import mmap
import os
import socket
import time

import torch

# A tensor is read through the group when reading this rank's boxes of it
# alone moves more than this times the rank's share of it (1/W of it).
SHARE_ABOVE = 1.25
# Tensor bytes of one batch: one half of the shared buffer.
BATCH_BYTES = 64 << 20
# The smallest half tried when memory for the buffer is short.
MIN_BATCH_BYTES = 4 << 20

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class GroupError(RuntimeError):
    """A rank of the group failed; raised on every rank."""


def _gather(group, obj):
    import torch.distributed as dist

    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _raise_any(results, what):
    """Raises GroupError naming each rank's error in ``results`` (a list,
    by rank, of (error or None, ...))."""
    bad = [(r, res[0]) for r, res in enumerate(results) if res[0] is not None]
    if bad:
        raise GroupError(f"{what}: " + "; ".join(f"rank {r}: {e}" for r, e in bad))


def abandon(group, error):
    """Joins the group's agreement with ``error`` (this rank failed before
    its shared reads), so that the other ranks raise instead of waiting.
    Never raises itself: the caller raises its own error."""
    try:
        _gather(group, (f"{type(error).__name__}: {error}", None, None))
    except Exception:  # noqa: BLE001 - the group itself is gone: nothing to tell
        pass


def _host():
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return socket.gethostname(), boot


class Shared:
    """The writes of a plan the group reads together, and what it did.
    ``report`` (a dict) says which tensors, bytes read for the group and
    copied out, batches, seconds, or why nothing was shared."""

    def __init__(self, group, rank, world, writes, regions, report):
        self.group, self.rank, self.world = group, rank, world
        self.writes = writes  # key -> [Write]
        # [(key, name, nbytes, file offset, dtype, shape, cuttable in rows)] in file order
        self.regions = regions
        self.report = report


def split(plan, readers, group, block):
    """Agrees with the group which of ``plan``'s keys it reads together.
    Returns ``(own, shared)``: ``own`` the plan's writes this rank reads
    alone (a Plan with ``writes`` only), ``shared`` a Shared (run it with
    ``run``). ``readers`` maps a key's first element to its Reader;
    ``block`` is the O_DIRECT block. Every rank of ``group`` must call it."""
    import torch.distributed as dist

    from ._weight_plan import Plan

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    by_key = {}
    for w in plan.writes:
        by_key.setdefault(w.key, []).append(w)
    mine, infos, err, too_large, on_device = {}, {}, None, [], []
    try:
        for key, ws in by_key.items():
            i, name = key
            _dtype, _shape, nbytes, offset = readers[i].info(name)
            if nbytes == 0:
                continue
            alone = sum(readers[i]._slice_read_bytes(name, [tuple(b) for b in w.box])[1] for w in ws)
            if alone <= SHARE_ABOVE * nbytes / world:
                continue
            if any(w.dest.device.type != "cpu" for w in ws):
                # The buffer is host memory the copies out of it would
                # reach a device from one at a time: read alone, said.
                on_device.append(name)
                continue
            if nbytes > BATCH_BYTES and not _cuttable(_shape, nbytes, ws):
                # It would need a buffer of its size: read alone, said.
                too_large.append(name)
                continue
            mine[key] = (int(offset), int(nbytes), alone)
            infos[key] = (name, ws[0].dest.dtype)
    except Exception as e:  # noqa: BLE001 - said to every rank below, then raised
        err = f"{type(e).__name__}: {e}"
    got = _gather(group, (err, _host(), {k: v[:2] for k, v in mine.items()}))
    _raise_any(got, "the tensor-parallel ranks' shared reads (choosing them)")
    report = {
        "ranks": world,
        "tensors": 0,
        "bytes": 0,
        "read_bytes": 0,
        "copied_bytes": 0,
        "alone_bytes": 0,
        "batches": 0,
        "seconds": 0.0,
        "buffer_bytes": 0,
        "batch_bytes": 0,
        "too_large": too_large,
        "on_device": on_device,
        "why_not": None,
    }
    own = Plan()
    if len({h for _e, h, _c in got}) > 1:
        report["why_not"] = "the ranks are on more than one host (each reads its parts alone)"
        own.writes = list(plan.writes)
        return own, Shared(group, rank, world, {}, [], report)
    common = set(mine)
    for _e, _h, cands in got:
        common &= {k for k, v in cands.items() if mine[k][:2] == v} if cands is not None else set()
    regions = []
    # In one order on every rank (the buffer's layout follows it): by
    # source, file offset, then name (tensors of two files may share an
    # offset; a set's order is not the same in two processes).
    for key in sorted(common, key=lambda k: (str(k[0]), mine[k][0], k[1])):
        offset, nbytes, alone = mine[key]
        name, dtype = infos[key]
        _d, shape, _n, _o = readers[key[0]].info(name)
        regions.append((key, name, nbytes, offset, dtype, shape, _cuttable(shape, nbytes, by_key[key])))
        report["tensors"] += 1
        report["bytes"] += nbytes
        report["alone_bytes"] += alone
    own.writes = [w for w in plan.writes if w.key not in common]
    if not common:
        report["why_not"] = "no tensor whose part a rank cannot read alone"
    return own, Shared(group, rank, world, {k: by_key[k] for k in common}, regions, report)


def _cuttable(shape, nbytes, writes):
    """Whether a tensor can be read in pieces of whole rows (dimension 0)
    of at most MIN_BATCH_BYTES each: every write's box names each
    dimension and lands in contiguous memory (a piece's rows of the box
    are then a run of the destination)."""
    rows = shape[0] if shape else 0
    if rows == 0 or nbytes % rows or nbytes // rows > MIN_BATCH_BYTES:
        return False
    return all(len(w.box) == len(shape) and w.dest.is_contiguous() for w in writes)


def _batches(regions, block, budget):
    """``regions`` as batches of pieces of at most ``budget`` bytes of
    buffer each: ``[[(region, a, z, at)]]``, rows ``a..z`` of the region's
    tensor (all of it, ``0..rows``, unless the tensor is larger than the
    budget and the region says it can be cut: then pieces of whole rows,
    each within the budget; ``split`` keeps only such tensors or ones of
    at most BATCH_BYTES) at ``at``,
    the piece's block-aligned place in its half; and the largest batch's
    bytes. The layout is a function of its arguments: every rank that
    calls it with the same regions and budget lays the buffer out alike."""
    out, cur, used, largest = [], [], 0, 0

    def room(nbytes, offset):
        return -(-(offset % block + nbytes) // block) * block

    for reg in regions:
        _key, _name, nbytes, offset, _dt, shape, cuttable = reg
        rows = shape[0] if shape else 1
        if nbytes <= budget or not cuttable:
            pieces = [(0, rows)]
        else:
            # Rows per piece: what fits with a block of phase to spare.
            per = max(1, (budget - block) // (nbytes // rows))
            pieces = [(a, min(a + per, rows)) for a in range(0, rows, per)]
        for a, z in pieces:
            rb = nbytes // rows if shape else nbytes
            size = room((z - a) * rb, offset + a * rb)
            if cur and used + size > budget:
                out.append(cur)
                largest = max(largest, used)
                cur, used = [], 0
            cur.append((reg, a, z, used))
            used += size
    if cur:
        out.append(cur)
        largest = max(largest, used)
    return out, largest


def _parts(nbytes, offset, world, block):
    """The payload bytes ``[a, z)`` each rank reads of a tensor of
    ``nbytes`` at file ``offset``: W contiguous shares split at block
    boundaries of the file (so each rank's read is whole blocks but for
    the tensor's two ends)."""
    cuts = [0]
    for j in range(1, world):
        at = (offset + j * nbytes // world) // block * block - offset
        cuts.append(min(max(at, cuts[-1]), nbytes))
    cuts.append(nbytes)
    return [(cuts[j], cuts[j + 1]) for j in range(world)]


def _copy_box(src, box, dest):
    """``src[box]`` into ``dest`` (a view holding the box's elements in
    row-major order), on integer views of the same element size (every
    dtype copies the same way; float8 kernels need not exist)."""
    es = src.element_size()
    s = src.view(_INT[es]) if es in _INT else src
    d = dest.view(_INT[es]) if es in _INT and dest.element_size() == es else dest
    for dim, (a, z) in enumerate(box):
        s = s.narrow(dim, a, z - a)
    squeezed = [n for n in s.shape if n != 1]
    if squeezed == [n for n in d.shape if n != 1]:
        d.copy_(s.view(d.shape))
    else:
        d.copy_(s.reshape(d.shape))


def _copy_piece(src, a, z, w, whole):
    """Write ``w``'s part of rows ``a..z`` of its tensor (``src``, those
    rows) into its destination; returns the bytes copied. A whole tensor
    copies ``w``'s box into ``w.dest`` (any view); a piece copies the
    rows of the box it holds into the run of the destination that holds
    them (``_cuttable``: the destination is contiguous)."""
    if whole:
        _copy_box(src, w.box, w.dest)
        return w.dest.numel() * w.dest.element_size()
    r0, r1 = w.box[0]
    s, e = max(r0, a), min(r1, z)
    if s >= e:
        return 0
    inner = [hi - lo for lo, hi in w.box[1:]]
    n = 1
    for x in inner:
        n *= x
    part = w.dest.view(-1)[(s - r0) * n : (e - r0) * n].view([e - s, *inner])
    _copy_box(src, [(s - a, e - a), *w.box[1:]], part)
    return part.numel() * part.element_size()


def run(shared, readers, block):
    """Reads ``shared``'s tensors with the group and copies this rank's
    boxes out of them. Every rank of the group calls it with its own
    ``Shared`` (the agreement made their regions equal). Returns True
    when done, False when the group could not make its buffer (then no
    byte was read and the caller reads ``shared.writes`` alone: the same
    answer on every rank). Raises GroupError on every rank when any rank
    failed a read or a copy."""
    rep = shared.report
    if not shared.regions:
        return True
    t0 = time.perf_counter()
    m = _open_buffer(shared, block)
    if m is None:
        return False
    batches, largest = _batches(shared.regions, block, rep["batch_bytes"])
    rep["buffer_bytes"] = 2 * largest
    try:
        _read_and_copy(shared, readers, block, m, batches, largest)
    finally:
        # No read is in flight (each _fill returned): the mapping goes
        # with the last view of it.
        del m
    rep["seconds"] = time.perf_counter() - t0
    return True


def _open_buffer(shared, block):
    """The group's buffer, mapped here, or None (every rank alike, the
    reason in the report). Rank 0 makes it: a memfd (no name left behind,
    not bound by /dev/shm's size), its pages' place reserved (a write into
    a tmpfs page it cannot hold is SIGBUS, not an error), halving the
    batch down to MIN_BATCH_BYTES while memory is short; the others open
    it through /proc."""
    group, rank = shared.group, shared.rank
    rep = shared.report
    fd, where, err = None, None, None
    if rank == 0:
        budget = BATCH_BYTES
        while True:
            _b, largest = _batches(shared.regions, block, budget)
            try:
                fd = os.memfd_create("weightstream-tp-share", os.MFD_CLOEXEC)
                os.posix_fallocate(fd, 0, 2 * largest)
                where = (os.getpid(), fd, budget, largest)
                break
            except OSError as e:
                if fd is not None:
                    os.close(fd)
                    fd = None
                if budget <= MIN_BATCH_BYTES:
                    err = f"a shared buffer of {2 * largest} bytes: {e}"
                    break
                budget //= 2
    said = _gather(group, (where, err))
    where, err = said[0]
    m, opened = None, None
    if err is None:
        pid, rfd, budget, largest = where
        rep["batch_bytes"] = budget
        try:
            if _batches(shared.regions, block, budget)[1] != largest:
                raise OSError("the ranks do not agree on the buffer's size")
            if rank != 0:
                fd = os.open(f"/proc/{pid}/fd/{rfd}", os.O_RDWR | os.O_CLOEXEC)
            m = mmap.mmap(fd, 2 * largest, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            opened = f"open rank 0's shared buffer: {e}"
    # Every rank has it mapped (or one could not), and lays it out the
    # same (checked: a rank that placed a tensor elsewhere would read into
    # another's bytes).
    layout = hashlib.sha256(repr([(k, n, off, list(sh)) for k, _name, n, off, _d, sh, _c in shared.regions]).encode()).hexdigest()
    said = _gather(group, (opened, layout))
    if fd is not None:
        os.close(fd)
    fails = [f"rank {r}: {o}" for r, (o, _l) in enumerate(said) if o is not None]
    if not fails and len({lay for _o, lay in said}) != 1:
        fails = ["the ranks lay the buffer out differently"]
    if err is not None or fails:
        rep["why_not"] = "no shared buffer (" + (err or "; ".join(fails)) + "): each rank read its parts alone"
        return None
    return m


def _read_and_copy(shared, readers, block, m, batches, largest):
    """The batches: this rank's share of each into one half of ``m``, a
    gather, then this rank's boxes copied out of it. A half is read into
    again two batches later, after a gather every rank joined only once
    it had copied out of it. Each gather carries every rank's error (of
    this batch's reads, of the last batch's copies); a last one carries
    the last copies'."""
    group, rank, world = shared.group, shared.rank, shared.world
    rep = shared.report
    base = torch.frombuffer(m, dtype=torch.uint8)
    addr = base.data_ptr()
    pending = None
    for k, batch in enumerate(batches):
        half = (k % 2) * largest
        err = pending
        if err is None:
            try:
                by_reader = {}
                for (key, name, nbytes, offset, _dt, shape, _c), a, z, at in batch:
                    rb = nbytes // shape[0] if shape else nbytes
                    start, size = a * rb, (z - a) * rb
                    pa, pz = _parts(size, offset + start, world, block)[rank]
                    if pz > pa:
                        # In place: the piece sits in phase with its file.
                        dst = addr + half + at + (offset + start) % block + pa
                        by_reader.setdefault(key[0], []).append((name, None, (start + pa, start + pz), dst, pz - pa))
                        rep["read_bytes"] += pz - pa
                for i, targets in by_reader.items():
                    readers[i]._fill(targets)
            except Exception as e:  # noqa: BLE001 - said to every rank, then raised
                err = f"{type(e).__name__}: {e}"
        _raise_any(_gather(group, (err,)), "the tensor-parallel ranks' shared reads")
        try:
            with torch.no_grad():
                for (key, _name, nbytes, offset, dtype, shape, _c), a, z, at in batch:
                    rb = nbytes // shape[0] if shape else nbytes
                    at_file = offset + a * rb
                    begin = half + at + at_file % block
                    src = base[begin : begin + (z - a) * rb].view(dtype).view([z - a, *shape[1:]] if shape else [])
                    whole = a == 0 and z == (shape[0] if shape else 1)
                    for w in shared.writes[key]:
                        rep["copied_bytes"] += _copy_piece(src, a, z, w, whole)
        except Exception as e:  # noqa: BLE001 - said to every rank at the next gather
            pending = f"{type(e).__name__}: {e}"
        rep["batches"] += 1
    _raise_any(_gather(group, (pending,)), "the tensor-parallel ranks' shared copies")
