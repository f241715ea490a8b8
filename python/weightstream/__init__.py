"""weightstream: model weights from NVMe into memory at the drive's speed.

A drop-in for safetensors' readers (``safe_open``, ``weightstream.torch.load_file``,
``weightstream.numpy.load_file``) and whole-model loads (``load``). Every
tensor or array returned owns the memory it views: nothing this module hands
out is ever reused or written by a later read.
"""

import json as _json
import operator as _operator

from . import _native
from ._convert import convert as _convert
from ._native import SafetensorError

__version__ = _native.version()
__all__ = ["safe_open", "load", "stream", "shard_bounds", "Engine", "SafetensorError", "__version__"]


class _Slice:
    """A tensor not yet read: ``get_shape()``, ``get_dtype()``, and indexing
    (``[a:b]``, ``[:, a:b]``, ``[i]``, ``...``, positive steps in any
    dimension) that reads from the drives only the block the index covers:
    rows as one read, columns and other blocks row part by row part (see
    ``TensorSlice`` in the Rust crate), never the whole tensor. A step
    keeps every n-th index of the block from its first to its last kept
    one; the block is read, and the step applied in memory."""

    def __init__(self, reader, name, framework):
        self._reader = reader
        self._name = name
        self._framework = framework
        self._dtype, self._shape, self._nbytes, _ = reader.info(name)

    def get_shape(self):
        return list(self._shape)

    def get_dtype(self):
        return self._dtype

    def __getitem__(self, index):
        if not isinstance(index, tuple):
            index = (index,)
        shape = list(self._shape)
        if not shape:
            if index not in ((), (Ellipsis,)):
                raise SafetensorError(f"tensor {self._name}: a scalar has no dimension to index")
            return self._finish(self._read_block([], shape), ())
        if index.count(Ellipsis) > 1:
            raise SafetensorError(f"tensor {self._name}: an index can only have a single ellipsis ('...')")
        if Ellipsis in index:
            k = index.index(Ellipsis)
            fill = max(len(shape) - (len(index) - 1), 0)
            index = index[:k] + (slice(None),) * fill + index[k + 1 :]
        if len(index) > len(shape):
            raise SafetensorError(
                f"tensor {self._name}: {len(index)} indices for a tensor of {len(shape)} dimensions"
            )
        # The block to read (a range per indexed dimension, step 1), then
        # what is left to apply in memory: steps, and ints dropping a
        # dimension.
        bounds, rest = [], []
        for d, ix in enumerate(index):
            n = shape[d]
            if isinstance(ix, slice):
                start, stop, step = ix.indices(n)
                if step < 1:
                    raise SafetensorError(
                        f"tensor {self._name}: a step ({step}) in dimension {d} is not supported (steps must be positive)"
                    )
                stop = max(stop, start)
                if step > 1 and stop > start:
                    # The block ends at the last element the step keeps.
                    stop = start + (stop - 1 - start) // step * step + 1
                bounds.append((start, stop))
                rest.append(slice(None, None, step))
            else:
                try:
                    i = _operator.index(ix)
                except TypeError:
                    raise SafetensorError(
                        f"tensor {self._name}: index {ix!r} in dimension {d} is not an int, a slice or '...'"
                    ) from None
                if i < -n or i >= n:
                    raise SafetensorError(f"tensor {self._name}: index {i} is out of range for dimension {d} of size {n}")
                i %= n
                bounds.append((i, i + 1))
                rest.append(0)
        block = [b - a for a, b in bounds] + shape[len(bounds) :]
        return self._finish(self._read_block(bounds, block), tuple(rest))

    def _read_block(self, bounds, block):
        if any(n == 0 for n in block):
            payload = self._reader.read(self._name, 0, 0)
        elif all(b == (0, n) for b, n in zip(bounds, self._shape)):
            payload = self._reader.read(self._name)
        else:
            payload = self._reader.read_slice(self._name, bounds)
        return _convert(self._framework)(payload, self._dtype, block)

    def _finish(self, part, rest):
        out = part[rest] if rest else part
        if self._framework in ("np", "numpy"):
            import numpy as np

            # An all-int index gives a numpy scalar: a 0-d array, as
            # safetensors returns (np.ascontiguousarray would make it 1-d).
            out = np.asarray(out)
            return out if out.flags.c_contiguous else out.copy(order="C")
        return out.contiguous()


class safe_open:
    """``safetensors.safe_open``: ``with safe_open(path, framework="pt") as f:``
    then ``f.keys()``, ``f.metadata()``, ``f.get_tensor(name)``,
    ``f.get_slice(name)``. ``path`` may also be a model directory (its index,
    every shard), with ``dirs`` (split directories) and ``mirrors``.

    Stricter than safetensors: only ``device="cpu"``; frameworks 'pt' and
    'np'. Each ``get_tensor`` reads the payload O_DIRECT into memory of its
    own, which the returned tensor keeps alive.
    """

    def __init__(self, filename, framework="pt", device="cpu", *, dirs=None, mirrors=None, route=None, direct=None):
        if str(device) != "cpu":
            raise ValueError(f"device {device!r}: weightstream reads into CPU memory (device='cpu')")
        self._framework = framework
        _convert(framework)  # an unknown framework is refused now
        self._reader = _native.Reader(
            str(filename),
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
        return self._reader.keys()

    def offset_keys(self):
        return sorted(self._reader.keys(), key=lambda k: self._reader.info(k)[3])

    def metadata(self):
        return self._reader.metadata()

    def get_tensor(self, name):
        dtype, shape, _, _ = self._reader.info(name)
        return _convert(self._framework)(self._reader.read(name), dtype, shape)

    def get_slice(self, name):
        return _Slice(self._reader, name, self._framework)

    def stats(self):
        """The engine's counters (per drive, fallbacks by cause, warnings)."""
        return _json.loads(self._reader.stats_json())


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
    conv = _convert(framework)
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
    s = _native.Stream(
        path,
        dirs=_paths(dirs),
        mirrors=_paths(mirrors),
        route=route,
        direct=direct,
        names=names,
        window=window,
    )
    conv = _convert(framework)
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
