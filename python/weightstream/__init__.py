"""weightstream: model weights from NVMe into memory at the drive's speed.

A drop-in for safetensors' readers (``safe_open``, ``weightstream.torch.load_file``,
``weightstream.numpy.load_file``) and whole-model loads (``load``). Every
tensor or array returned owns the memory it views: nothing this module hands
out is ever reused or written by a later read.
"""

import json as _json
import operator as _operator

from . import _native
from . import _index
from ._convert import convert as _convert

try:
    # The same class as safetensors' own, where safetensors is installed:
    # code written to catch safetensors' errors catches these, and the
    # other way round.
    from safetensors import SafetensorError
except ImportError:  # pragma: no cover - safetensors is not a dependency

    class SafetensorError(Exception):
        """A file refused (its header, its index, a missing tensor), an
        index refused, a closed file: as safetensors' own SafetensorError."""


_native._set_error_type(SafetensorError)

__version__ = _native.version()
__all__ = ["safe_open", "load", "stream", "shard_bounds", "Engine", "ExpertCache", "SafetensorError", "__version__"]

# safetensors' framework names, and the ones weightstream reads into.
_FRAMEWORKS = {
    "pt": "pytorch",
    "torch": "pytorch",
    "pytorch": "pytorch",
    "np": "numpy",
    "numpy": "numpy",
    "tf": "tensorflow",
    "tensorflow": "tensorflow",
    "jax": "flax",
    "flax": "flax",
    "mlx": "mlx",
    "paddle": "paddle",
}
_DEVICE_KINDS = ("cuda", "musa", "mps", "npu", "xpu", "xla", "mlu", "hpu")
_BACKENDS = ("mmap", "pread")


def _framework(framework):
    """safetensors' framework names: 'pytorch' or 'numpy' (the ones read
    here), SafetensorError for a name safetensors does not know."""
    fw = _FRAMEWORKS.get(framework) if isinstance(framework, str) else None
    if fw is None:
        raise SafetensorError(f"framework {framework} is invalid")
    if fw not in ("pytorch", "numpy"):
        raise ValueError(f"framework {framework!r}: weightstream reads into 'pt' (torch) or 'np' (numpy)")
    return fw


def _device(device, fw):
    """safetensors' device grammar: "cpu", an accelerator ("cuda", "cuda:1",
    "mps", "npu:0", ...) or an index (torch's default accelerator), as
    safetensors parses it; SafetensorError for anything else, and for a
    device other than the CPU with numpy. Returns what torch's ``to`` takes
    (None for the CPU)."""
    if hasattr(device, "type") and hasattr(device, "index"):  # a torch.device
        device = str(device)
    if isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise SafetensorError(f"device {device} is invalid")
        parsed, shown = device, str(device)
    elif isinstance(device, str):
        kind, sep, idx = device.partition(":")
        if device == "cpu":
            return None
        if device in _DEVICE_KINDS:
            parsed = shown = "mps" if device == "mps" else f"{device}:0"
        elif kind in _DEVICE_KINDS and sep:
            if ":" in idx:
                raise SafetensorError(f"device {device} is invalid")
            n = _device_index(idx)
            if kind == "mps":
                if n != 0:
                    raise SafetensorError(f"device {device} is invalid: only mps or mps:0 is supported")
                parsed = shown = "mps"
            else:
                parsed = shown = f"{kind}:{n}"
        else:
            raise SafetensorError(f"device {device} is invalid")
    else:
        raise SafetensorError(f"device {device!r} is invalid")
    if fw != "pytorch":
        raise SafetensorError(f"Device {shown} is not supported for framework {fw}")
    return parsed


def _device_index(text):
    """A device index as safetensors parses one (Rust's usize): ValueError
    with its messages."""
    digits = text[1:] if text.startswith("+") else text
    if not text:
        raise ValueError("cannot parse integer from empty string")
    if not digits or not digits.isascii() or not digits.isdigit():
        raise ValueError("invalid digit found in string")
    n = int(digits)
    if n >= 1 << 64:
        raise ValueError("number too large to fit in target type")
    return n


def _backend(backend):
    """safetensors' backend names. weightstream reads every tensor its own
    way (O_DIRECT into memory the tensor owns) whichever is named: both
    are accepted, anything else is refused as safetensors refuses it."""
    if backend not in _BACKENDS:
        shown = _json.dumps(backend) if isinstance(backend, str) else repr(backend)
        raise SafetensorError(f'backend {shown} is invalid (expected one of: "mmap", "pread")')


def _on(t, device):
    """A torch tensor moved to `device` (None: stays on the CPU)."""
    return t if device is None else t.to(device)


class _Slice:
    """A tensor not yet read: ``get_shape()``, ``get_dtype()``, and indexing
    that reads from the drives only the block the index covers: rows as one
    read, columns and other blocks row part by row part (see
    ``TensorSlice`` in the Rust crate), never the whole tensor; a step is
    applied in memory to the block from the first kept index to the last.

    Indexing follows safetensors 0.8, which has two grammars:
    - ``framework="pt"``: torch's own indexing, as safetensors indexes the
      tensor it maps (negative indices, clamped slices, ``None``, bools,
      lists and tensors of indices; torch's errors). Ints, slices and
      ``...`` read the block; any other index reads the whole tensor and
      lets torch index it.
    - ``framework="np"``: safetensors' slice grammar (``_index``): ints,
      slices with positive steps, ``...``, an empty list, a tuple of those;
      a refused index raises SafetensorError with safetensors' message.
      Negative slice bounds count from the end (safetensors raises
      OverflowError for them).
    """

    def __init__(self, reader, name, framework, device=None):
        self._reader = reader
        self._name = name
        self._framework = framework
        self._device = device
        self._dtype, self._shape, self._nbytes, _ = reader.info(name)

    def get_shape(self):
        return list(self._shape)

    def get_dtype(self):
        return self._dtype

    def __getitem__(self, index):
        if self._framework in ("np", "numpy"):
            return self._numpy_item(index)
        return _on(self._torch_item(index), self._device)

    def _numpy_item(self, index):
        import numpy as np

        from ._convert import dtype_bits

        shape = list(self._shape)
        indexers = _index.parse(index, shape, SafetensorError)
        bounds, rest, newshape = _index.resolve(indexers, shape, dtype_bits(self._dtype), SafetensorError)
        if bounds is None or any(n == 0 for n in newshape):
            return self._read_block(None, newshape)
        block = [b - a for a, b in bounds] + shape[len(bounds) :]
        part = self._read_block(bounds, block)
        # An all-int index gives a numpy scalar: a 0-d array, as
        # safetensors returns (np.ascontiguousarray would make it 1-d).
        out = np.asarray(part[rest] if rest else part)
        return out if out.flags.c_contiguous else out.copy(order="C")

    def _torch_item(self, index):
        import math

        import torch

        from ._convert import index_torch, torch_dtype, torch_shape

        dtype = torch_dtype(self._dtype)
        tshape = torch_shape(self._dtype, self._shape, self._name)
        plan = _index.basic(index, tshape)
        if plan is not None or not _holds_tensors(index):
            # torch's own checks and result shape, on a tensor of no bytes.
            out_shape = tuple(torch.empty(tshape, dtype=torch.uint8, device="meta")[index].shape)
            if math.prod(out_shape) == 0:
                return torch.empty(out_shape, dtype=dtype)
        if plan is None:
            whole = self._read_block([(0, n) for n in self._shape], list(self._shape))
            return index_torch(whole, index)
        bounds, rest = plan
        if self._dtype == "F4" and len(bounds) == len(tshape):
            # torch's last dimension holds two elements a byte.
            a, b = bounds[-1]
            bounds = bounds[:-1] + [(2 * a, 2 * b)]
        block = [b - a for a, b in bounds] + list(self._shape[len(bounds) :])
        return index_torch(self._read_block(bounds, block), rest)

    def _read_block(self, bounds, block):
        if bounds is None or any(n == 0 for n in block):
            payload = self._reader.read(self._name, 0, 0)
        elif all(b == (0, n) for b, n in zip(bounds, self._shape)):
            payload = self._reader.read(self._name)
        else:
            payload = self._reader.read_slice(self._name, bounds)
        return _convert(self._framework)(payload, self._dtype, block)


def _holds_tensors(index):
    """Whether `index` holds lists, arrays or tensors of indices (advanced
    indexing: torch indexes the whole tensor itself, with no dry run on a
    meta tensor, where masks have no shape)."""
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(it, list) or (hasattr(it, "shape") and getattr(it, "ndim", 0) != 0) for it in items)


class safe_open:
    """``safetensors.safe_open``: ``with safe_open(path, framework="pt") as f:``
    then ``f.keys()``, ``f.offset_keys()``, ``f.metadata()``,
    ``f.get_tensor(name)``, ``f.get_tensors()``, ``f.get_slice(name)``. The
    arguments as safetensors' (``device``, ``backend``), and ``path`` may
    also be a model directory (its index, every shard), with ``dirs``
    (split directories) and ``mirrors``.

    ``framework``: "pt" (torch) or "np" (numpy), under any of safetensors'
    names for them. ``device``: safetensors' devices; a tensor for another
    device than the CPU is read into CPU memory, then moved there.
    ``backend``: "mmap" or "pread", accepted and read the same fast way
    (O_DIRECT into memory the tensor owns); anything else is refused.
    Each ``get_tensor`` reads the payload into memory of its own, which the
    returned tensor keeps alive.
    """

    def __init__(self, filename, framework="pt", device="cpu", *, backend="mmap", dirs=None, mirrors=None, route=None, direct=None):
        fw = _framework(framework)
        self._device = _device(device, fw)
        _backend(backend)
        self._framework = framework
        self._reader = _native.Reader(
            _fspath(filename),
            dirs=_paths(dirs),
            mirrors=_paths(mirrors),
            route=route,
            direct=direct,
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self, timeout=10.0):
        """Stops the engine; tensors already returned stay valid."""
        return self._reader.close(timeout)

    def keys(self):
        """Every tensor name, sorted."""
        return self._reader.keys()

    def offset_keys(self):
        """Every tensor name, in the order of their bytes in the file."""
        keys = self._reader.keys()
        return sorted(keys, key=lambda k: self._reader.info(k)[3])

    def metadata(self):
        return self._reader.metadata()

    def get_tensor(self, name):
        dtype, shape, _, _ = self._reader.info(name)
        t = _convert(self._framework)(self._reader.read(name), dtype, shape)
        return t if self._device is None else _on(t, self._device)

    def get_tensors(self):
        """Every tensor, ``{name: tensor}`` in name order."""
        return {k: self.get_tensor(k) for k in self.keys()}

    def get_slice(self, name):
        return _Slice(self._reader, name, self._framework, self._device)

    def stats(self):
        """The engine's counters (per drive, fallbacks by cause, warnings)."""
        return _json.loads(self._reader.stats_json())


def _fspath(filename):
    """A path as text (str, bytes or os.PathLike, as safetensors takes)."""
    import os

    p = os.fspath(filename)
    return os.fsdecode(p) if isinstance(p, bytes) else p


def _paths(v):
    if v is None:
        return None
    if isinstance(v, (str, bytes)) or hasattr(v, "__fspath__"):
        return [str(v)]
    return [str(p) for p in v]


def _model_path(path):
    """A model directory, an index json (its directory), or one file."""
    import os

    path = os.fspath(path)
    if os.path.basename(path).endswith(".index.json"):
        return os.path.dirname(path) or "."
    return path


def _names(names):
    """A name filter: one string or several; None for every tensor."""
    if isinstance(names, str):
        return [names]
    return list(names) if names else None


def load(path, framework="pt", *, dirs=None, mirrors=None, route=None, direct=None, names=None, shard=None, report=None):
    """Every tensor of a model (a directory, its ``model.safetensors.index.json``,
    or one ``.safetensors`` file) as ``{name: tensor}``, read O_DIRECT by
    every drive at once into one mapping that the tensors keep alive.
    ``names``: only tensors whose name contains one of these strings.
    ``shard``: this rank's part of tensor-parallel layers, read alone (the
    other ranks' bytes are not read): a table ``{pattern: (dim, rank,
    world_size)}`` (shell-style patterns over tensor names, the first that
    matches wins; ``None`` as the value keeps a tensor whole), or a function
    ``(name, shape) -> (dim, rank, world_size) or None``. A rank's part of
    a dimension of size n is ``[n * rank // world_size, n * (rank + 1) //
    world_size)``; tensors no rule names are read whole.
    ``report``: a dict, filled with ``tensors``, ``bytes``, ``seconds``,
    ``gbps``, ``slices``, and what the slices cost: ``slice_bytes_wanted``
    and ``slice_bytes_read`` (whole blocks: a narrow column of a wide
    tensor reads a block per row).
    Ctrl-C raises ``KeyboardInterrupt`` within 50 ms."""
    path, names = _model_path(path), _names(names)
    # The framework's module first: a missing torch is said before a byte
    # is read.
    conv = _convert(framework)
    parts = None
    if shard is not None:
        parts = _shard_parts(path, shard, names, dirs, mirrors)
    tensors, report_json = _native.load(
        path,
        dirs=_paths(dirs),
        mirrors=_paths(mirrors),
        route=route,
        direct=direct,
        names=names,
        parts=parts,
    )
    if report is not None:
        report.update(_json.loads(report_json))
    return {name: conv(payload, dtype, shape) for name, dtype, shape, payload in tensors}


def _shard_rule(shard):
    """A ``shard=`` argument as a function ``(name, shape) -> spec or None``."""
    if callable(shard):
        return shard
    import fnmatch

    items = list(shard.items()) if isinstance(shard, dict) else list(shard)

    def rule(name, shape):
        for pattern, spec in items:
            if fnmatch.fnmatchcase(name, pattern):
                return spec
        return None

    return rule


def shard_bounds(name, shape, spec):
    """The block a ``(dim, rank, world_size)`` spec keeps of a tensor of
    ``shape``: a range per dimension up to ``dim`` (the ones before it
    whole), as ``load(shard=...)`` reads it. A bad spec raises ``ValueError``
    naming the tensor."""
    try:
        dim, rank, world = (_operator.index(v) for v in spec)
    except (TypeError, ValueError):
        raise ValueError(f"tensor {name}: shard spec {spec!r} is not (dim, rank, world_size)") from None
    if dim < 0:
        dim += len(shape)
    if not 0 <= dim < len(shape):
        raise ValueError(f"tensor {name}: shard dim {spec[0]} is not a dimension of shape {list(shape)}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"tensor {name}: shard rank {rank} is not in 0..{world} (world_size {world})")
    n = shape[dim]
    return [(0, m) for m in shape[:dim]] + [(n * rank // world, n * (rank + 1) // world)]


def _shard_parts(path, shard, names, dirs, mirrors):
    """``{name: bounds}`` for every tensor ``shard`` slices (and ``names``
    keeps); an empty part is refused."""
    rule = _shard_rule(shard)
    parts = {}
    for name, _dtype, shape, *_ in _native.catalog(path, dirs=_paths(dirs), mirrors=_paths(mirrors)):
        if names and not any(n in name for n in names):
            continue
        spec = rule(name, list(shape))
        if spec is None:
            continue
        bounds = shard_bounds(name, shape, spec)
        if bounds[-1][0] == bounds[-1][1]:
            raise ValueError(
                f"tensor {name}: rank {spec[1]} of {spec[2]} gets nothing of dimension {len(bounds) - 1} (size {shape[len(bounds) - 1]})"
            )
        if any(b != (0, m) for b, m in zip(bounds, shape)):
            parts[name] = bounds
    return parts


def stream(path, framework="pt", *, dirs=None, mirrors=None, route=None, direct=None, names=None, window=8):
    """Yields ``(name, tensor)`` in name order as each tensor lands, ``window``
    reads in flight. Each tensor is read into memory of its own: a tensor you
    keep holds nothing back, and no later read reuses its memory."""
    path, names = _model_path(path), _names(names)
    conv = _convert(framework)
    s = _native.Stream(
        path,
        dirs=_paths(dirs),
        mirrors=_paths(mirrors),
        route=route,
        direct=direct,
        names=names,
        window=window,
    )
    for name, dtype, shape, payload in s:
        yield name, conv(payload, dtype, shape)


class Engine(safe_open):
    """A model (a directory or one file) with its engine: everything
    ``safe_open`` has, plus ``read_into`` (into a tensor or array you already
    have) and ``stats()``. ``with Engine(path) as e:`` shuts it down at the
    end (bounded); tensors already returned stay valid."""

    def __init__(self, path, framework="pt", *, dirs=None, mirrors=None, route=None, direct=None):
        super().__init__(path, framework=framework, dirs=dirs, mirrors=mirrors, route=route, direct=direct)

    def read_into(self, name, out, *, start=None, end=None, rows=None):
        """Reads tensor ``name`` (or bytes ``[start, end)`` of its payload, or
        ``rows=(a, b)`` of its first dimension) into ``out``: a torch CPU
        tensor (pinned or not), a numpy array, or a writable buffer
        (``bytearray``, ``memoryview``). ``out`` must be C-contiguous,
        writable, of the tensor's dtype (any dtype for a buffer) and exactly
        the bytes read. Returns ``out``. A bad ``out`` raises ``ValueError``
        naming what is wrong; nothing is read then. ``out`` must not be
        resized or freed by another thread while the call runs (the read
        writes into its memory with the GIL released)."""
        dtype, shape, nbytes, _ = self._reader.info(name)
        if rows is not None:
            if start is not None or end is not None:
                raise ValueError("read_into: give rows or start/end, not both")
            a, b = rows
            if not shape or not (0 <= a <= b <= shape[0]):
                raise ValueError(f"read_into: rows {rows} of tensor {name} with shape {shape}")
            row = nbytes // shape[0] if shape[0] else 0
            start, end = a * row, b * row
        want = (end if end is not None else nbytes) - (start or 0)
        address, have = _writable_address(out, dtype, name)
        if have != want:
            raise ValueError(f"read_into: {name} [{start or 0}, {end if end is not None else nbytes}) is {want} bytes; out has {have}")
        self._reader._read_into_address(name, address, have, start, end)
        return out


class ExpertCache:
    """An expert cache for mixture-of-experts decode over a model's routed
    experts (``model.layers.L.<block>.experts.E.<projection>.<part>``, and
    fused ``experts.<projection>`` tensors by their rows): whole experts in
    registered memory within ``capacity`` experts or ``budget_bytes``,
    misses read O_DIRECT in place on every drive and mirror, ``prefetch``
    in the background, exact LRU (``policy="lru"``) or LFU with aging
    (``"lfu"``) over experts no tensor holds.

    ``get(layer, expert)`` returns ``{projection: weight tensor,
    "projection.part": companion}`` (``"gate_proj"``, ``"gate_proj.bias"``);
    a tensor keeps its expert pinned (never evicted, never overwritten)
    until it is freed, after ``close()`` too. Any number of threads may
    call at once; every call releases the GIL."""

    def __init__(self, path, capacity=None, *, budget_bytes=None, policy="lru", framework="pt", dirs=None, mirrors=None, route=None, direct=None):
        self._conv = _convert(framework)
        self._cache = _native.ExpertCache(
            _model_path(path),
            capacity=capacity,
            budget_bytes=budget_bytes,
            policy=policy,
            dirs=_paths(dirs),
            mirrors=_paths(mirrors),
            route=route,
            direct=direct,
        )
        self.capacity, self.entry_bytes = self._cache.budget()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _dict(self, items):
        conv = self._conv
        return {key: conv(payload, dtype, shape) for key, dtype, shape, payload in items}

    def get(self, layer, expert):
        """Expert ``expert`` of layer ``layer`` as ``{key: tensor}``; blocks
        only while its read is in flight."""
        return self._dict(self._cache.get(int(layer), int(expert)))

    def get_many(self, layer, experts):
        """A layer's top-k: every miss started at once; one dict per expert."""
        return [self._dict(items) for items in self._cache.get_many(int(layer), [int(e) for e in experts])]

    def prefetch(self, keys):
        """Starts background reads of ``[(layer, expert), ...]``; never
        waits. Returns ``{"started", "present", "refused"}`` (refused: every
        entry pinned or in flight)."""
        started, present, refused = self._cache.prefetch([(int(l), int(e)) for l, e in keys])
        return {"started": started, "present": present, "refused": refused}

    def wait_idle(self):
        """Waits until every read started so far has landed."""
        self._cache.wait_idle()

    def stats(self):
        """``hits``, ``misses``, ``prefetched``, ``prefetch_used``,
        ``prefetch_wasted``, ``prefetch_wasted_bytes``, ``prefetch_refused``,
        ``evictions``, ``failed_reads``, ``bytes_read``,
        ``bytes_read_per_drive``, ``wait_seconds``, ``entries``, ``pinned``,
        ``capacity``, ``entry_bytes``."""
        return _json.loads(self._cache.stats())

    def close(self):
        """Drops the cache and its engine; tensors already returned stay valid."""
        self._cache.close()


def _writable_address(out, dtype, name):
    """(address, bytes) of ``out``'s memory, after checking it is a CPU,
    C-contiguous, writable tensor/array of ``dtype`` (or a writable buffer)."""
    mod = type(out).__module__
    if mod.startswith("torch"):
        from ._convert import torch_dtype

        if out.device.type != "cpu":
            raise ValueError(f"read_into: out is on {out.device}; weightstream reads into CPU memory")
        if not out.is_contiguous():
            raise ValueError("read_into: out is not contiguous")
        if out.dtype != torch_dtype(dtype):
            raise ValueError(f"read_into: out is {out.dtype}; tensor {name} is {dtype}")
        if out.requires_grad:
            raise ValueError("read_into: out requires grad; read into a tensor that does not (or under torch.no_grad())")
        return out.data_ptr(), out.numel() * out.element_size()
    import numpy as np

    from ._convert import numpy_dtype

    if isinstance(out, np.ndarray):
        arr = out
        if arr.dtype != numpy_dtype(dtype):
            raise ValueError(f"read_into: out is {arr.dtype}; tensor {name} is {dtype}")
    else:
        try:
            mv = memoryview(out)
        except TypeError:
            raise ValueError(f"read_into: out is a {type(out).__name__}: give a torch tensor, a numpy array or a writable buffer") from None
        if mv.readonly:
            raise ValueError("read_into: out is read-only")
        arr = np.frombuffer(mv, dtype=np.uint8) if mv.nbytes else np.empty(0, np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("read_into: out is not C-contiguous")
    if not arr.flags.writeable:
        raise ValueError("read_into: out is read-only")
    return arr.__array_interface__["data"][0], arr.nbytes
