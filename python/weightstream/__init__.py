"""weightstream: model weights from NVMe into memory at the drive's speed.

A drop-in for safetensors' readers (``safe_open``, ``weightstream.torch.load_file``,
``weightstream.numpy.load_file``) and whole-model loads (``load``). Every
tensor or array returned owns the memory it views: nothing this module hands
out is ever reused or written by a later read.
"""

import json as _json

from . import _native
from ._convert import convert as _convert
from ._native import SafetensorError

__version__ = _native.version()
__all__ = ["safe_open", "load", "stream", "Engine", "SafetensorError", "__version__"]


class _Slice:
    """A tensor not yet read: ``get_shape()``, ``get_dtype()``, and indexing
    (``[a:b]``, ``[:, a:b]``, ``[i]``, ``...``) that reads only the rows the
    first index needs."""

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
            return self._read(None, None, shape)
        first = index[0] if index else slice(None)
        rows = shape[0]
        row_bytes = self._nbytes // rows if rows else 0
        if isinstance(first, slice):
            start, stop, step = first.indices(rows)
            if step != 1:
                # safetensors reads contiguous rows only; so does this.
                raise SafetensorError(f"tensor {self._name}: a step ({step}) in the first dimension is not supported")
            stop = max(stop, start)
            part = self._read(start * row_bytes, stop * row_bytes, [stop - start] + shape[1:])
            rest = (slice(None),) + tuple(index[1:])
        elif first is Ellipsis:
            part = self._read(None, None, shape)
            rest = index
        else:
            i = int(first)
            if i < -rows or i >= rows:
                raise SafetensorError(f"tensor {self._name}: index {i} is out of range for dimension 0 of size {rows}")
            i %= rows
            part = self._read(i * row_bytes, (i + 1) * row_bytes, [1] + shape[1:])
            rest = (0,) + tuple(index[1:])
        out = part[rest]
        if self._framework in ("np", "numpy"):
            import numpy as np

            return np.ascontiguousarray(out)
        return out.contiguous()

    def _read(self, start, end, shape):
        payload = self._reader.read(self._name, start, end)
        return _convert(self._framework)(payload, self._dtype, shape)


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


def load(path, framework="pt", *, dirs=None, mirrors=None, route=None, direct=None, names=None):
    """Every tensor of a model (a directory, its ``model.safetensors.index.json``,
    or one ``.safetensors`` file) as ``{name: tensor}``, read O_DIRECT by
    every drive at once into one mapping that the tensors keep alive.
    ``names``: only tensors whose name contains one of these strings.
    Ctrl-C raises ``KeyboardInterrupt`` within 50 ms."""
    path, names = _model_path(path), _names(names)
    tensors, _report = _native.load(
        path,
        dirs=_paths(dirs),
        mirrors=_paths(mirrors),
        route=route,
        direct=direct,
        names=names,
    )
    conv = _convert(framework)
    return {name: conv(payload, dtype, shape) for name, dtype, shape, payload in tensors}


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
