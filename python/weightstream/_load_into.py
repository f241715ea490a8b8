"""``weightstream.torch.load_into``: a checkpoint read straight into the
tensors a model already has, in the model's memory plus a fixed staging
budget.

CPU destinations go to ``Engine::fill`` in one call: each payload's whole
blocks O_DIRECT in place where the destination's address is in phase with
the file, everything else O_DIRECT into the engine's staging and one copy,
on copy threads, pipelined with the reads.

Device destinations (CUDA) go through ``_Pipeline``: pinned host buffers,
each filled by ``Engine::fill`` (the parts laid out in phase, so the reads
land in place), then copied to the device without blocking on a side
stream; a buffer is filled again only after its copies' event completed.
The device-specific lines are ``_CudaCopier``'s; everything else runs on
the CPU with ``_HostCopier`` (or a test's copier), which is how it is
tested here.
"""

import collections
import json as _json
import time as _time

from . import _native, _paths, _model_path, _shard_rule, shard_bounds
from ._convert import torch_dtype as _torch_dtype
from ._convert import torch_shape as _torch_shape

# Staging of the device path by default: two pinned buffers of 64 MiB.
DEVICE_STAGING = 128 << 20
DEVICE_BUFFERS = 2

# The most copy threads a fill may be asked for (the library's
# FILL_COPY_THREADS_LIMIT, as C's ws_fill): more is refused before a read.
COPY_THREADS_LIMIT = 256


class LoadIntoResult(collections.namedtuple("LoadIntoResult", ["missing_keys", "unexpected_keys", "report"])):
    """What ``load_into`` did: ``missing_keys`` and ``unexpected_keys`` as
    ``load_state_dict`` returns them (module names), and ``report``: a dict
    of what was read (``tensors``, ``bytes``, ``seconds``, ``gbps``, the
    bytes and reads ``in_place``/``staged``/``buffered``, ``staging_bytes``,
    ``copy_threads``, ``copy_cpu_seconds``, ``tied``, ``cast``,
    ``device_bytes``)."""

    __slots__ = ()


def load_into(
    module_or_state_dict,
    path,
    *,
    strict=True,
    shard=None,
    prefix=None,
    rename=None,
    cast=False,
    dirs=None,
    mirrors=None,
    route=None,
    direct=None,
    staging_bytes=None,
    copy_threads=None,
    in_place=True,
):
    """Fills the tensors of ``module_or_state_dict`` (an ``nn.Module``: its
    ``state_dict()``'s parameters and persistent buffers; or a dict of
    tensors) from the checkpoint at ``path`` (a model directory, its index,
    or one file), by name, in place: no second copy of the model is made.

    - Names: a checkpoint tensor fills the destination of the same name,
      after ``prefix`` (a string the checkpoint's names start with and the
      module's do not: stripped where present) and ``rename`` (a function
      ``checkpoint name -> module name``, or ``None`` to skip the tensor,
      or ``(module name, index)`` for a part of a fused tensor: the
      destination is ``tensor[index]``, which must be contiguous, and the
      parts must cover the tensor). ``transformers_rename(model)`` is
      that function for a transformers model whose experts are fused in
      memory but stored one by one (Mixtral, Qwen-MoE, DeepSeek, ... in
      transformers 5). Tied weights (one storage under several names) are
      read once.
    - Checks, all before any byte is read: every shape (and, with
      ``shard``, the rank's slice shape) and dtype equals the destination's;
      a mismatch raises ``RuntimeError`` listing every one, naming the
      tensor and both shapes or dtypes. ``cast=True`` instead reads a tensor
      of another dtype into a temporary and converts it into the
      destination (listed in ``report["cast"]``; never silent).
      With ``strict`` (the default), missing or unexpected keys raise the
      same way; with ``strict=False`` they are returned.
    - ``shard``: as ``weightstream.load``'s (a rule table or function over
      the checkpoint's names); a rank's slice lands straight in its
      destination, and only its bytes are read.
    - Memory: the destinations plus ``staging_bytes`` (default 32 MiB for
      CPU destinations, 128 MiB of pinned buffers for device ones).
      ``in_place=False`` sends every byte through staging.
    - A read that fails after reads began raises naming the first failure
      and how many destinations are complete; the others may be partly
      written. Ctrl-C stops the load (no read starts after it) and raises
      once no read is left in flight.

    Returns ``LoadIntoResult(missing_keys, unexpected_keys, report)``.
    """
    import torch

    if copy_threads is not None and (
        isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or not 0 <= copy_threads <= COPY_THREADS_LIMIT
    ):
        raise ValueError(f"load_into: copy_threads {copy_threads!r}: None (the default), or 0 to {COPY_THREADS_LIMIT}")
    t0 = _time.perf_counter()
    is_module = isinstance(module_or_state_dict, torch.nn.Module)
    dests = dict(module_or_state_dict.state_dict() if is_module else module_or_state_dict)
    owner = type(module_or_state_dict).__name__
    auto_rename = None
    if rename is None and is_module and _is_transformers_model(module_or_state_dict):
        # A transformers model: its own checkpoint conversions (renamings,
        # experts stored one by one and fused in memory), as from_pretrained
        # applies them. One that is not a place in memory stays unapplied,
        # said in the report and in an error that lists missing keys.
        try:
            rename = transformers_rename(module_or_state_dict)
            auto_rename = "transformers_rename (a transformers model)"
        except ValueError as e:
            auto_rename = f"not applied: {e}"
    reader = _native.Reader(
        str(_model_path(path)), dirs=_paths(dirs), mirrors=_paths(mirrors), route=route, direct=direct
    )
    try:
        plan = _plan(reader, dests, owner, strict, shard, prefix, rename, cast, auto_rename)
        report = _run(reader, plan, staging_bytes, copy_threads, in_place)
    finally:
        reader.close()
    if auto_rename is not None:
        report["rename"] = auto_rename
    report["seconds"] = _time.perf_counter() - t0
    report["gbps"] = report["bytes"] / max(report["seconds"], 1e-9) / 1e9
    return LoadIntoResult(plan.missing, plan.unexpected, report)


class _Plan:
    def __init__(self):
        # (checkpoint name, bounds or None, destination) per kind.
        self.direct = []  # CPU, contiguous, same dtype: Engine::fill
        self.device = []  # on a device: the pipeline
        self.indirect = []  # cast or not contiguous: a temporary, then copy_
        self.missing = []
        self.unexpected = []
        self.tied = {}
        self.cast = []


def _is_transformers_model(module):
    """Whether ``module`` is a transformers ``PreTrainedModel`` (found by
    its classes, so that transformers is imported only when it already is)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.") for c in type(module).__mro__)


# Keys listed in an error before "... and N more".
_KEYS_LISTED = 20


def _keys(what, keys):
    shown = ", ".join(f'"{k}"' for k in keys[:_KEYS_LISTED])
    more = f", ... and {len(keys) - _KEYS_LISTED} more ({len(keys)} in all)" if len(keys) > _KEYS_LISTED else ""
    return f"{what} key(s) in state_dict: {shown}{more}."


def _likely_fix(missing, unexpected, rename, prefix, auto_rename):
    """A line naming the likely fix for these missing and unexpected
    keys, or None: a prefix the checkpoint's names carry, or experts
    stored one by one for a model that fuses them."""
    if not missing or not unexpected:
        return None
    miss = set(missing)
    import re

    # A prefix: the checkpoint's name is the module's with something in
    # front ("model." in a checkpoint of a whole model, for its body).
    fronts = collections.Counter()
    for u in unexpected:
        for i in range(len(u)):
            if u[i] == "." and u[i + 1 :] in miss:
                fronts[u[: i + 1]] += 1
                break
    if fronts and prefix is None:
        front, n = fronts.most_common(1)[0]
        if n * 2 >= min(len(missing), len(unexpected)):
            return f"Likely fix: prefix={front!r} ({n} checkpoint name(s) are a module name with {front!r} in front)."
    one_by_one = [u for u in unexpected if re.search(r"\.experts\.\d+\.", u)]
    fused = [m for m in missing if re.search(r"\.experts\.[A-Za-z_]", m)]
    if one_by_one and fused and rename is None:
        why = f" (tried and {auto_rename})" if auto_rename and auto_rename.startswith("not applied") else ""
        return (
            "Likely fix: the checkpoint stores experts one by one and the module fuses them: "
            f"rename=weightstream.torch.transformers_rename(model) for a transformers model{why}, or a rename "
            "function returning (name, index) for each part."
        )
    return None


def _plan(reader, dests, owner, strict, shard, prefix, rename, cast, auto_rename=None):
    """Every check, before any read: names, tied groups, fused parts,
    shapes, dtypes."""
    import torch

    for name, t in dests.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"load_into: {name} is a {type(t).__name__}, not a tensor")
    # Checkpoint name -> destination name (whole), or destination name ->
    # [(checkpoint name, index)] (parts of a fused destination).
    whole, parts = {}, collections.OrderedDict()
    unexpected = []
    for ck in reader.keys():
        name = ck[len(prefix) :] if prefix and ck.startswith(prefix) else ck
        index = None
        if rename is not None:
            name = rename(name)
            if name is None:
                continue
            if isinstance(name, tuple):
                name, index = name
                index = index if isinstance(index, tuple) else (index,)
        if name not in dests:
            unexpected.append(name)
            continue
        if index is None:
            if name in whole.values() or name in parts:
                raise RuntimeError(f"load_into: more than one checkpoint tensor maps to {name} ({ck} among them)")
            whole[ck] = name
        else:
            if name in whole.values():
                raise RuntimeError(f"load_into: {ck} maps to a part of {name}, which another tensor fills whole")
            parts.setdefault(name, []).append((ck, index))
    from_dest = {v: k for k, v in whole.items()}
    plan = _Plan()
    plan.unexpected = sorted(unexpected)
    problems = []
    rule = _shard_rule(shard) if shard is not None else None

    def check(name, ck, t):
        """The item reading ``ck`` (or this rank's slice of it) into ``t``,
        or None with the problem noted."""
        dtype, shape, _nbytes, _off = reader.info(ck)
        bounds = None
        if rule is not None:
            spec = rule(ck, list(shape))
            if spec is not None:
                b = shard_bounds(ck, shape, spec)
                if b[-1][0] == b[-1][1]:
                    raise ValueError(
                        f"tensor {ck}: rank {spec[1]} of {spec[2]} gets nothing of dimension {len(b) - 1} (size {shape[len(b) - 1]})"
                    )
                if any(r != (0, m) for r, m in zip(b, shape)):
                    bounds = b
                    shape = [z - a for a, z in b] + list(shape[len(b) :])
        if t.device.type == "meta":
            problems.append(f"{name} is on the meta device: materialize the module first (to_empty)")
            return None
        if _overlaps_itself(t):
            problems.append(
                f"{name}: its elements overlap in memory (shape {tuple(t.shape)}, strides {tuple(t.stride())}: an "
                "expanded or stride-0 view), so no payload can be written into it; give the tensor it was expanded from"
            )
            return None
        try:
            want_dtype, want_shape = _torch_dtype(dtype), _torch_shape(dtype, shape, ck)
        except TypeError as e:
            problems.append(str(e))
            return None
        if list(t.shape) != list(want_shape):
            problems.append(
                f"size mismatch for {name}: copying a param with shape {tuple(want_shape)} from checkpoint "
                f"({ck}{' slice ' + str(bounds) if bounds else ''}), the shape in current model is {tuple(t.shape)}"
            )
            return None
        if t.dtype != want_dtype:
            if not cast:
                problems.append(
                    f"dtype mismatch for {name}: the checkpoint's {ck} is {dtype} ({want_dtype}), the model's is {t.dtype} "
                    "(cast=True converts it, through a temporary)"
                )
                return None
            plan.cast.append(name)
            return ("indirect", (ck, bounds, t))
        if t.device.type == "cpu":
            return ("direct" if t.is_contiguous() else "indirect", (ck, bounds, t))
        if not t.is_contiguous():
            problems.append(f"{name} on {t.device} is not contiguous")
            return None
        return ("device", (ck, bounds, t))

    def add(got):
        if got is not None:
            getattr(plan, got[0]).append(got[1])

    # Tied weights: the same memory under several names, read once.
    groups = collections.OrderedDict()
    for name, t in dests.items():
        key = (
            (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))
            if t.numel() and t.device.type != "meta"
            else ("own", name)
        )
        groups.setdefault(key, []).append(name)
    for names in groups.values():
        present = [n for n in names if n in from_dest]
        fused = [n for n in names if n in parts]
        if fused:
            # A fused destination (experts merged into one tensor): each
            # part a view of it; whole only when the parts cover it.
            name = fused[0]
            t = dests[name]
            covered = 0
            for ck, index in parts[name]:
                try:
                    view = t[index]
                except (IndexError, TypeError) as e:
                    problems.append(f"{ck}: index {index} of {name} (shape {tuple(t.shape)}): {e}")
                    continue
                if not view.is_contiguous():
                    problems.append(f"{ck}: {name}[{index}] is not contiguous")
                    continue
                covered += _nbytes(view)
                add(check(f"{name}[{index}]", ck, view))
            if covered != _nbytes(t):
                if strict:
                    problems.append(f"{name}: its parts in the checkpoint cover {covered} of its {_nbytes(t)} bytes")
                plan.missing.append(name)
            if len(names) > 1:
                plan.tied[name] = [n for n in names if n != name]
            continue
        if not present:
            plan.missing.extend(names)
            continue
        name = present[0]
        if len(names) > 1:
            plan.tied[name] = [n for n in names if n != name]
        add(check(name, from_dest[name], dests[name]))
    if strict:
        head = []
        if plan.missing:
            head.append(_keys("Missing", plan.missing))
        if plan.unexpected:
            head.append(_keys("Unexpected", plan.unexpected))
        fix = _likely_fix(plan.missing, plan.unexpected, rename, prefix, auto_rename)
        if fix:
            head.append(fix)
        problems = head + problems
    if problems:
        raise RuntimeError(f"Error(s) in loading state_dict for {owner} (load_into; nothing was read):\n\t" + "\n\t".join(problems))
    return plan


def _nbytes(t):
    return t.numel() * t.element_size()


def _overlaps_itself(t):
    """Whether two elements of ``t`` share memory: a dimension of more than
    one element with stride 0 (``expand``, ``as_strided``), what torch's own
    ``copy_`` refuses. Other strides never make elements share memory in a
    view torch hands out."""
    return any(n > 1 and st == 0 for n, st in zip(t.shape, t.stride()))


def _run(reader, plan, staging_bytes, copy_threads, in_place):
    import torch

    report = {
        "tensors": len(plan.direct) + len(plan.device) + len(plan.indirect),
        "bytes": 0,
        "bytes_read": 0,
        "in_place_bytes": 0,
        "staged_bytes": 0,
        "buffered_bytes": 0,
        "in_place_reads": 0,
        "staged_reads": 0,
        "buffered_reads": 0,
        "staging_bytes": 0,
        "copy_threads": 0,
        "copy_cpu_seconds": 0.0,
        "device_bytes": 0,
        "tied": plan.tied,
        "cast": plan.cast,
    }

    def add(r):
        for k in ("bytes", "bytes_read", "in_place_bytes", "staged_bytes", "buffered_bytes", "in_place_reads", "staged_reads", "buffered_reads"):
            report[k] += r[k]
        report["staging_bytes"] = max(report["staging_bytes"], r["staging_bytes"])
        report["copy_threads"] = max(report["copy_threads"], r["copy_threads"])
        report["copy_cpu_seconds"] += r["copy_cpu_seconds"]

    with torch.no_grad():
        if plan.direct:
            targets = [(ck, bounds, None, t.data_ptr(), _nbytes(t)) for ck, bounds, t in plan.direct]
            add(_json.loads(reader._fill(targets, staging_bytes=staging_bytes, copy_threads=copy_threads, in_place=in_place)))
        for ck, bounds, t in plan.indirect:
            # A temporary of the checkpoint's dtype and the destination's
            # shape, then torch's copy (the conversion, or the strides).
            dtype, _shape, _n, _off = reader.info(ck)
            tmp = torch.empty(t.shape, dtype=_torch_dtype(dtype))
            add(_json.loads(reader._fill([(ck, bounds, None, tmp.data_ptr(), _nbytes(tmp))], staging_bytes=staging_bytes, copy_threads=copy_threads, in_place=in_place)))
            t.copy_(tmp)
            del tmp
        if plan.device:
            by_device = collections.OrderedDict()
            for item in plan.device:
                by_device.setdefault(item[2].device, []).append(item)
            for device, items in by_device.items():
                copier = _CudaCopier(device) if device.type == "cuda" else _TorchCopier(device)
                pipe = _Pipeline(reader, copier, staging_bytes or DEVICE_STAGING, copy_threads=copy_threads, in_place=in_place)
                r = pipe.run(items)
                add(r)
                report["device_bytes"] += r["bytes"]
                report.setdefault("pinned", True)
                report["pinned"] = report["pinned"] and r["pinned"]
    return report


class _HostCopier:
    """Copies on the CPU, at once (events are always complete): the
    pipeline's logic run without a device, for tests and CPU targets."""

    pinned = False

    def pin(self, buf):
        return False

    def unpin(self, buf):
        pass

    def start(self):
        pass

    def copy(self, dest, src):
        dest.copy_(src)

    def record(self):
        return None

    def wait(self, event):
        pass

    def finish(self):
        pass


class _TorchCopier(_HostCopier):
    """A device without a side stream here (not CUDA): torch's copy, which
    returns once the bytes are on the device."""

    def __init__(self, device):
        self.device = device


class _CudaCopier:
    """The CUDA lines: staging registered with the runtime (pinned), each
    copy issued without blocking on a side stream that first waits for the
    work already queued on the device (the module's own initialisation),
    an event per buffer, and the current stream made to wait for the side
    stream at the end."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pinned = True

    def pin(self, buf):
        rc = self.torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
        ok = int(getattr(rc, "value", rc)) == 0
        self.pinned = self.pinned and ok
        return ok

    def unpin(self, buf):
        self.torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())

    def start(self):
        self.stream.wait_stream(self.torch.cuda.current_stream(self.device))

    def copy(self, dest, src):
        with self.torch.cuda.stream(self.stream):
            dest.copy_(src, non_blocking=True)

    def record(self):
        ev = self.torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait(self, event):
        event.synchronize()

    def finish(self):
        self.torch.cuda.current_stream(self.device).wait_stream(self.stream)
        self.stream.synchronize()


def _slice_start(shape, bounds, bits):
    """The byte offset in a tensor's payload of its slice's first element."""
    flat = 0
    for d, n in enumerate(shape):
        flat = flat * n + (bounds[d][0] if d < len(bounds) else 0)
    return flat * bits // 8


class _Pipeline:
    """Device destinations through ``buffers`` host buffers of
    ``staging_bytes / buffers`` each (pinned by the copier): each buffer is
    filled with the next parts (tensors, byte ranges of larger ones, row
    blocks of slices), each part placed in phase with its file offset so
    that its whole blocks are read in place; then each part is copied into
    its destination (the copier's copy, without blocking on a device), and
    the copier's event is recorded; the buffer is filled again only once
    that event has completed."""

    def __init__(self, reader, copier, staging_bytes, buffers=DEVICE_BUFFERS, copy_threads=None, in_place=True):
        self.reader = reader
        self.copier = copier
        self.align = reader.direct_align()
        self.buffers = max(1, buffers)
        self.buffer_bytes = max(staging_bytes // self.buffers, 2 * self.align) // self.align * self.align
        self.copy_threads = copy_threads
        self.in_place = in_place

    def parts(self, items):
        """(checkpoint name, bounds, byte range, destination flat uint8
        view, its bytes, file offset of the first byte) per part, in file
        order; no part larger than a buffer (less a block of phase)."""
        import torch

        cap = self.buffer_bytes - self.align
        out = []
        for ck, bounds, t in items:
            dtype, shape, nbytes, off = self.reader.info(ck)
            flat = t.view(-1).view(torch.uint8) if t.numel() else t.view(torch.uint8)
            if not _nbytes(t):
                continue
            if bounds is None:
                for a in range(0, nbytes, cap):
                    z = min(nbytes, a + cap)
                    out.append((ck, None, (a, z), flat[a:z], z - a, off + a))
                continue
            rows = bounds[0][1] - bounds[0][0]
            row_bytes = _nbytes(t) // rows
            step = max(1, cap // row_bytes)
            elems = 1
            for m in shape:
                elems *= m
            bits = nbytes * 8 // elems
            for r in range(0, rows, step):
                rb = [(bounds[0][0] + r, bounds[0][0] + min(rows, r + step))] + list(bounds[1:])
                n = (rb[0][1] - rb[0][0]) * row_bytes
                out.append((ck, rb, None, flat[r * row_bytes : r * row_bytes + n], n, off + _slice_start(shape, rb, bits)))
        out.sort(key=lambda p: p[5])
        return out

    def run(self, items):
        import torch

        parts = self.parts(items)
        biggest = max((p[4] for p in parts), default=0)
        size = max(self.buffer_bytes, biggest + self.align)
        # Page-aligned views of plain CPU tensors, then pinned by the copier.
        raw = [torch.empty(size + self.align, dtype=torch.uint8) for _ in range(self.buffers)]
        bufs = []
        for r in raw:
            skip = (-r.data_ptr()) % self.align
            bufs.append(r[skip : skip + size])
        pinned = [self.copier.pin(b) for b in bufs]
        report = {k: 0 for k in ("bytes", "bytes_read", "in_place_bytes", "staged_bytes", "buffered_bytes", "in_place_reads", "staged_reads", "buffered_reads", "staging_bytes", "copy_threads")}
        report["copy_cpu_seconds"] = 0.0
        events = [None] * len(bufs)
        try:
            self.copier.start()
            i = 0
            k = 0
            while i < len(parts):
                b = k % len(bufs)
                # The buffer's copies from its last round are done.
                self.copier.wait(events[b])
                events[b] = None
                buf = bufs[b]
                base = buf.data_ptr()
                cursor, batch = 0, []
                while i < len(parts):
                    ck, bounds, rng, dest, n, foff = parts[i]
                    at = cursor + ((foff - cursor) % self.align)
                    if at + n > size:
                        break
                    batch.append((ck, bounds, rng, base + at, n, dest, at))
                    cursor = at + n
                    i += 1
                r = _json.loads(
                    self.reader._fill(
                        [(ck, bounds, rng, addr, n) for ck, bounds, rng, addr, n, _d, _a in batch],
                        staging_bytes=min(self.buffer_bytes, 64 << 20),
                        copy_threads=self.copy_threads,
                        in_place=self.in_place,
                    )
                )
                for key in report:
                    if key in ("staging_bytes", "copy_threads"):
                        report[key] = max(report[key], r[key])
                    else:
                        report[key] += r[key]
                for _ck, _b, _r, _addr, n, dest, at in batch:
                    self.copier.copy(dest, buf[at : at + n])
                events[b] = self.copier.record()
                k += 1
            for e in events:
                self.copier.wait(e)
            self.copier.finish()
        finally:
            for e in events:
                # Never give a buffer back while a copy may read it.
                try:
                    self.copier.wait(e)
                except Exception:  # noqa: BLE001 - the first error is what the caller sees
                    pass
            for b, p in zip(bufs, pinned):
                if p:
                    self.copier.unpin(b)
        report["staging_bytes"] += size * len(bufs)
        report["pinned"] = all(pinned)
        report["buffers"] = len(bufs)
        return report


def transformers_rename(model):
    """``load_into``'s ``rename`` for a transformers (5.x) model: its own
    checkpoint conversions (``get_model_conversion_mapping``), as
    ``from_pretrained`` applies them: renamings, and experts stored one by
    one but fused in memory (``MergeModulelist(dim=0)``, then optionally
    ``Concatenate(dim=1)``: expert ``e``'s k-th source lands in
    ``target[e, k * n:(k + 1) * n]``). Any other conversion (a transpose, a
    split) raises ``ValueError`` naming it: it is not a place in memory."""
    import re

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import MergeModulelist, Concatenate, WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    sd = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    for c in converters:
        ops = [type(o) for o in c.operations]
        if ops not in ([MergeModulelist], [MergeModulelist, Concatenate]) or c.operations[0].dim != 0 or (
            len(ops) == 2 and c.operations[1].dim != 1
        ):
            raise ValueError(f"transformers_rename: conversion {c.source_patterns} -> {c.target_patterns} ({[o.__class__.__name__ for o in c.operations]}) is not a place in memory")

    def expert_of(pattern, key):
        rx = re.escape(pattern).replace(r"\*", r"(\d+)")
        m = re.search(rx, key)
        return int(m.group(1)) if m else None

    def rename(ck):
        name, pattern = rename_source_key(ck, renamings, converters, prefix, sd)
        if pattern is None:
            return name
        conv = next(c for c in converters if pattern in c.source_patterns)
        # The expert number, from the key as the renamings left it.
        renamed = ck
        for r in renamings:
            renamed, _ = r.rename_source_key(renamed)
        e = expert_of(pattern, renamed)
        if e is None or name not in sd:
            return name
        if len(conv.operations) == 1:
            return (name, (e,))
        k = conv.source_patterns.index(pattern)
        n = sd[name].shape[1] // len(conv.source_patterns)
        return (name, (e, slice(k * n, (k + 1) * n)))

    return rename
