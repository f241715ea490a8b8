"""A load plan traced from a model's own weight loader: where each
checkpoint tensor's bytes end up in the model's parameters, found without
reading a byte of payload.

``trace`` runs ``load_weights`` (vLLM's ``model.load_weights``, or any
function that consumes ``(name, tensor)`` pairs) on metadata-only stand-ins
(``device="meta"``, the checkpoint's dtype and shape, from the headers)
under a ``TorchDispatchMode`` that sees every aten op the loader makes:

- views of a stand-in (narrow, slice, select, chunk, split, view, ...)
  run on the meta device, so each keeps the stand-in's storage and says
  where it is in the tensor (offset, shape, strides);
- ``copy_`` of such a view into a parameter's storage (same dtype, same
  elements) is not run but recorded: the region of the checkpoint tensor
  (a box: a range per dimension) and the destination (the parameter's
  view: offset, shape, strides);
- everything else a stand-in flows into (a cast, a concatenation, an
  arithmetic op, a transpose that is not a box) taints what it makes with
  the stand-ins it came from and the op's name; a copy of a tainted tensor
  into a parameter sends those checkpoint tensors to the fallback (the
  loader run again on the real tensors), with that reason;
- writes into parameters that no stand-in feeds (a loader zeroing a
  vocabulary's padding) run as they would, and are recorded as writes.

``check`` then proves the plan before any byte is read: every destination
storage that takes a planned write is written exactly once, byte for byte
(no two writes overlap, every byte of each of its parameters is written);
where that fails, each checkpoint tensor writing it falls back, with the
reason. A checkpoint tensor with any fallback write falls back whole.

The model is left as it was: nothing the trace does writes a parameter
except the loader's own writes that no checkpoint tensor feeds (which the
real load makes again), and a parameter the loader replaced (``param.data =
tensor``) is put back, its checkpoint tensor sent to the fallback.
"""

import collections
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ._load_into import _overlaps_itself

# Pieces one strided write may be cut into (contiguous runs) before it is
# called a layout the fill cannot write.
MAX_PIECES = 4096
# Contiguous runs a write's bytes are checked in, before the check gives up.
MAX_RUNS = 1 << 16
# Times the trace is run again without a stand-in the loader raised on.
MAX_RETRIES = 8


class StandIn:
    """A checkpoint tensor as the trace sees it: ``name`` as the loader gets
    it, ``key`` what the caller reads it by, its dtype and shape."""

    __slots__ = ("name", "key", "dtype", "shape")

    def __init__(self, name, key, dtype, shape):
        self.name, self.key, self.dtype, self.shape = name, key, dtype, tuple(shape)


class Write:
    """One planned write: ``box`` (a ``(start, end)`` per dimension) of
    checkpoint tensor ``key`` into ``dest`` (a view of a parameter's
    storage, the box's elements in row-major order)."""

    __slots__ = ("key", "box", "dest")

    def __init__(self, key, box, dest):
        self.key, self.box, self.dest = key, box, dest


class Trace:
    """What the trace found: ``writes`` (planned), ``fallback`` (key ->
    reason), ``other_writes`` ((storage key, view, keys or ()) of every
    write into a parameter that is not planned), ``unused`` (keys with no
    write at all), ``loaded`` (the loader's return value), ``seconds``,
    ``runs`` (times the loader ran)."""

    def __init__(self):
        self.writes = []
        self.fallback = collections.OrderedDict()
        self.other_writes = []
        self.unused = []
        self.loaded = None
        self.seconds = 0.0
        self.runs = 0
        self.whole_reason = None

    def fall_back(self, key, reason):
        self.fallback.setdefault(key, reason)


def _meta_key(t):
    return ("m", t.untyped_storage()._cdata)


def _real_key(t):
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def storage_key(t):
    """The identity of ``t``'s storage: meta storages by their object, real
    ones by device and address."""
    return _meta_key(t) if t.device.type == "meta" else _real_key(t)


# func -> ((index, name) of each argument its schema writes): read once
# per operator, not at every call of it (the trace sees thousands).
_WRITTEN = {}


def _flat_tensors(x, out):
    """Appends the tensors in ``x`` to ``out``: an operator's arguments or
    results, which are tensors, scalars, dtypes, devices and lists or
    tuples of them (torch's pytree does the same for any container, at
    several times the cost: the trace calls this thousands of times)."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, (list, tuple)):
        for y in x:
            _flat_tensors(y, out)
    elif isinstance(x, dict):
        for y in x.values():
            _flat_tensors(y, out)
    return out


def _written_args(func, args, kwargs):
    """The tensors ``func`` writes (its schema's mutable arguments)."""
    where = _WRITTEN.get(func)
    if where is None:
        where = tuple(
            (i, a.name) for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write
        )
        _WRITTEN[func] = where
    out = []
    for i, name in where:
        v = args[i] if i < len(args) else kwargs.get(name)
        _flat_tensors(v, out)
    return out


def _op_reason(func):
    name = func.__name__ if hasattr(func, "__name__") else str(func)
    base = name.split(".")[0]
    if base in ("cat", "stack", "concat", "hstack", "vstack"):
        return "a concatenation (aten.%s)" % base
    if base in ("_to_copy", "to", "_to_dtype"):
        return "a cast (aten.%s)" % base
    if base in ("t", "transpose", "permute", "movedim", "swapaxes"):
        return "a transpose (aten.%s), not a box of the tensor" % base
    return "a loader that computes on values (aten.%s)" % base


class _Tracer(TorchDispatchMode):
    def __init__(self, trace, stand_ins, dest_storages):
        super().__init__()
        self.trace = trace
        # Meta storage key -> (stand-in, its storage object, kept alive so
        # that the key is never reused while the trace runs).
        self.sources = {}
        for s, t in stand_ins:
            self.sources[_meta_key(t)] = (s, t)
        # Storage key -> (set of keys, reason, kept object) for tensors a
        # stand-in flowed into by something that is not a view.
        self.taint = {}
        # Destination storages: key -> a tensor of it (for the check).
        self.dests = dest_storages

    def _tensors(self, args, kwargs):
        return _flat_tensors(kwargs, _flat_tensors(args, []))

    def _origin(self, t):
        """(keys, reason) of what ``t`` carries from the checkpoint: its
        stand-in's key (reason None: a view of it) or its taint."""
        k = storage_key(t)
        if k in self.sources:
            return {self.sources[k][0].key}, None
        if k in self.taint:
            keys, reason, _ = self.taint[k]
            return set(keys), reason
        return set(), None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = self._tensors(args, kwargs)
        written = _written_args(func, args, kwargs)
        keys, reasons = set(), []
        for t in tensors:
            k, r = self._origin(t)
            keys |= k
            if r is not None:
                reasons.append(r)
        has_meta = any(t.device.type == "meta" for t in tensors)

        if written:
            return self._mutation(func, args, kwargs, written, keys, reasons, has_meta)

        if not has_meta and not keys:
            return func(*args, **kwargs)
        if func in (torch.ops.aten._to_copy.default,) and has_meta:
            src = args[0]
            dtype = kwargs.get("dtype")
            if src.device.type == "meta" and (dtype is None or dtype == src.dtype):
                # A move to a device (`.to(param.device)`): the same
                # elements, so the same stand-in (an alias keeps its
                # storage).
                return torch.ops.aten.alias.default(src)
        if has_meta:
            # Real tensors beside a stand-in (a scalar, a mask) go to the
            # meta device too: the result is metadata.
            args, kwargs = tree_map(
                lambda x: x.to("meta") if isinstance(x, torch.Tensor) and x.device.type != "meta" else x, (args, kwargs)
            )
            kwargs = {k: (torch.device("meta") if k == "device" else v) for k, v in kwargs.items()}
        out = func(*args, **kwargs)
        if keys:
            reason = reasons[0] if reasons else _op_reason(func)
            in_keys = {storage_key(t) for t in tensors}
            for o in _flat_tensors(out, []):
                ok = storage_key(o)
                if ok in in_keys:
                    continue  # a view: it keeps its input's origin
                self.taint[ok] = (keys, reason, o.untyped_storage())
        return out

    def _mutation(self, func, args, kwargs, written, keys, reasons, has_meta):
        tr = self.trace
        for w in written:
            wk = storage_key(w)
            if wk in self.sources:
                # The loader changes a stand-in itself (`mul_`): what it
                # holds is no longer the checkpoint's.
                s = self.sources[wk][0]
                self.taint[wk] = ({s.key} | keys, _op_reason(func) + " in place", w.untyped_storage())
                del self.sources[wk]
                continue
            if wk in self.dests:
                if func is torch.ops.aten.copy_.default and w is args[0]:
                    self._copy_into_dest(w, args[1], keys, reasons)
                elif keys:
                    for k in keys:
                        tr.fall_back(k, reasons[0] if reasons else _op_reason(func) + " into a parameter")
                    tr.other_writes.append((wk, w, tuple(keys)))
                else:
                    # A write no stand-in feeds (padding zeroed): run it, as
                    # the real load would, and count its bytes as written.
                    tr.other_writes.append((wk, w, ()))
                    return func(*args, **kwargs)
                continue
            if keys or has_meta:
                # A temporary the loader fills from a stand-in: tainted.
                self.taint[wk] = (keys, reasons[0] if reasons else _op_reason(func), w.untyped_storage())
                continue
            return func(*args, **kwargs)
        # Not run: the first written argument, as an in-place op returns.
        return written[0] if func._schema.returns else None

    def _copy_into_dest(self, dest, src, keys, reasons):
        tr = self.trace
        wk = storage_key(dest)
        sk = storage_key(src) if isinstance(src, torch.Tensor) else None
        if sk is None or sk not in self.sources:
            if keys:
                for k in keys:
                    tr.fall_back(k, reasons[0] if reasons else "a copy of a computed tensor")
            tr.other_writes.append((wk, dest, tuple(keys)))
            if not keys and isinstance(src, torch.Tensor) and src.device.type != "meta":
                # A copy from real memory no stand-in feeds: run it.
                dest.copy_(src)
            return
        s, _base = self.sources[sk]
        if src.numel() == 0:
            return  # nothing to write
        why = None
        if src.dtype != dest.dtype:
            why = f"a cast ({src.dtype} to {dest.dtype})"
        elif src.numel() != dest.numel() or _squeezed(src.shape) != _squeezed(dest.shape):
            why = f"a broadcast ({tuple(src.shape)} into {tuple(dest.shape)})"
        elif dest.device.type not in ("cpu", "cuda"):
            why = f"a destination on {dest.device}"
        box = None if why else _box(s.shape, src)
        if why is None and box is None:
            why = f"a view that is not a box of the tensor (shape {tuple(src.shape)}, strides {tuple(src.stride())})"
        if why is None and _overlaps_itself(dest):
            why = "a destination whose elements overlap"
        if why is None and not dest.is_contiguous() and (
            _pieces(dest) is None or [z - a for a, z in box if z - a != 1] != _squeezed(dest.shape)
        ):
            why = f"a destination the fill cannot write (shape {tuple(dest.shape)}, strides {tuple(dest.stride())})"
        if why is not None:
            tr.fall_back(s.key, why)
            tr.other_writes.append((wk, dest, (s.key,)))
            return
        tr.writes.append(Write(s.key, box, dest))


def _squeezed(shape):
    return [n for n in shape if n != 1]


def _canonical(offset, shape, strides):
    """``(offset, shape, strides)`` with size-1 dimensions dropped and
    neighbours that are one run merged: two views with the same canonical
    form hold the same elements in the same order."""
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if any(n == 0 for n in shape):
        return (0, (0,), (1,))
    out = []
    for n, s in dims:
        if out and out[-1][1] == n * s:
            pn, _ = out[-1]
            out[-1] = (pn * n, s)
        else:
            out.append((n, s))
    return (offset, tuple(n for n, _ in out), tuple(s for _, s in out))


def _contiguous_strides(shape):
    st, acc = [], 1
    for n in reversed(shape):
        st.append(acc)
        acc *= n
    return list(reversed(st))


def _box(shape, view):
    """The box (a ``(start, end)`` per dimension of ``shape``) of a
    contiguous tensor of ``shape`` whose elements, in row-major order, are
    exactly ``view``'s (a view of it: offset, shape, strides in elements),
    or None when ``view`` is not one (a transpose, a step, a gather)."""
    shape = list(shape)
    if not shape:
        return [] if view.numel() == 1 and view.storage_offset() == 0 else None
    cst = _contiguous_strides(shape)
    off = view.storage_offset()
    starts = [(off // cst[d]) % shape[d] if shape[d] else 0 for d in range(len(shape))]
    if sum(a * s for a, s in zip(starts, cst)) != off:
        return None
    ext = [1] * len(shape)
    d = len(shape) - 1
    # The view's dimensions, innermost first, onto the tensor's.
    for n, s in reversed([(n, s) for n, s in zip(view.shape, view.stride()) if n != 1]):
        while d >= 0 and (shape[d] == 1 or cst[d] < s):
            d -= 1
        if d < 0 or cst[d] != s:
            return None
        # A dimension of the view may span several of the tensor's (a
        # `view` over whole rows): all but its outermost whole.
        while n > shape[d] - starts[d]:
            if starts[d] != 0 or n % shape[d] != 0 or d == 0:
                return None
            ext[d] = shape[d]
            n //= shape[d]
            d -= 1
            while d >= 0 and shape[d] == 1:
                d -= 1
            if d < 0:
                return None
        ext[d] = n
        d -= 1
    box = [(a, a + e) for a, e in zip(starts, ext)]
    # Proof: the box's canonical form is the view's.
    want = _canonical(off, [z - a for a, z in box], cst)
    got = _canonical(off, list(view.shape), list(view.stride()))
    return box if want == got else None


def _pieces(dest):
    """``dest`` as contiguous pieces: ``[(index prefix, view)]`` (the
    prefix fixes the outer dimensions; each view is contiguous), or None
    when that takes more than MAX_PIECES or its innermost elements are
    not adjacent."""
    if dest.is_contiguous():
        return [((), dest)]
    shape, st = list(dest.shape), list(dest.stride())
    k = len(shape)
    acc = 1
    while k > 0 and (shape[k - 1] == 1 or st[k - 1] == acc):
        acc *= shape[k - 1]
        k -= 1
    if k == len(shape):
        return None  # the innermost elements are not adjacent
    count = 1
    for n in shape[:k]:
        count *= n
    if count > MAX_PIECES:
        return None
    out = []
    for idx in _grid(shape[:k]):
        out.append((idx, dest[idx]))
    return out


def _grid(shape):
    if not shape:
        yield ()
        return
    for i in range(shape[0]):
        for rest in _grid(shape[1:]):
            yield (i,) + rest


def _runs(t):
    """The byte ranges ``t`` covers in its storage, as contiguous runs
    (``[(start, end)]``), or None past MAX_RUNS."""
    es = t.element_size()
    if t.numel() == 0:
        return []
    off, shape, st = _canonical(t.storage_offset(), list(t.shape), list(t.stride()))
    inner = shape[-1] if st[-1] == 1 else 1
    outer_shape, outer_st = (shape[:-1], st[:-1]) if st[-1] == 1 else (shape, st)
    count = 1
    for n in outer_shape:
        count *= n
    if count > MAX_RUNS:
        return None
    out = []
    for idx in _grid(list(outer_shape)):
        a = off + sum(i * s for i, s in zip(idx, outer_st))
        out.append((a * es, (a + inner) * es))
    return out


def _snapshot(model):
    """Every parameter and buffer of ``model``: (module, name, object, its
    data) to put back what a loader replaced during the trace."""
    out = []
    for mod in model.modules():
        for table in (mod._parameters, mod._buffers):
            for name, t in table.items():
                if t is not None:
                    out.append((mod, table, name, t, t.data))
    return out


def destinations(model):
    """Storage key -> [(name, tensor)] of every parameter and buffer of
    ``model`` with real storage."""
    out = collections.OrderedDict()
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        if t.device.type == "meta" or isinstance(t, torch.nn.parameter.UninitializedParameter):
            continue
        try:
            k = storage_key(t)
        except (RuntimeError, NotImplementedError):
            continue
        out.setdefault(k, []).append((name, t))
    return out


def trace(load_weights, model, stand_ins):
    """Runs ``load_weights(iterator of (name, meta tensor))`` on
    ``stand_ins`` (StandIn) under the tracer; returns a Trace. A stand-in
    the loader raises on falls back (named, with the error) and the trace
    runs again without it, up to MAX_RETRIES times; then, or when the
    loader raises after its last tensor, everything falls back."""
    t0 = time.perf_counter()
    for _name, p in model.named_parameters():
        if isinstance(p, torch.nn.parameter.UninitializedParameter):
            tr = Trace()
            tr.whole_reason = "the model has parameters not yet materialized (lazy)"
            return tr
    excluded = collections.OrderedDict()
    while True:
        tr = Trace()
        tr.runs = len(excluded) + 1
        for k, why in excluded.items():
            tr.fall_back(k, why)
        dests = destinations(model)
        live = [s for s in stand_ins if s.key not in excluded]
        metas = [(s, torch.empty(s.shape, dtype=s.dtype, device="meta")) for s in live]
        snap = _snapshot(model)
        last = [None]

        def feed():
            for s, t in metas:
                last[0] = s
                yield s.name, t
            last[0] = None

        tracer = _Tracer(tr, metas, dests)
        error = None
        try:
            with torch.no_grad(), tracer:
                tr.loaded = load_weights(feed())
        except Exception as e:  # noqa: BLE001 - the loader's own error, attributed below
            error = e
        replaced = _restore(snap, tracer)
        if error is not None:
            s = last[0]
            if s is None or len(excluded) >= MAX_RETRIES:
                tr.whole_reason = f"the loader raised on the stand-ins: {type(error).__name__}: {error}"
                tr.seconds = time.perf_counter() - t0
                return tr
            excluded[s.key] = f"the loader raised on it ({type(error).__name__}: {str(error)[:200]})"
            continue
        for keys, name in replaced:
            if not keys:
                tr.whole_reason = f"the loader replaced {name} with a tensor of its own"
            for k in keys:
                tr.fall_back(k, f"the loader keeps the checkpoint's tensor as {name} (param.data = ...)")
        written = {w.key for w in tr.writes} | {k for _, _, ks in tr.other_writes for k in ks} | set(tr.fallback)
        tr.unused = [s.key for s in live if s.key not in written]
        tr.seconds = time.perf_counter() - t0
        return tr


def _restore(snap, tracer):
    """Puts back every parameter and buffer a loader replaced; returns
    [(keys of the stand-ins it held, name)] for each."""
    replaced = []
    for mod, table, name, obj, data in snap:
        now = table.get(name)
        changed = now is not obj
        if not changed and obj.data is not data:
            try:
                changed = storage_key(obj.data) != storage_key(data) or obj.data.shape != data.shape
            except (RuntimeError, NotImplementedError):
                changed = True
        if changed:
            held = now.data if isinstance(now, torch.Tensor) else None
            keys = tracer._origin(held)[0] if held is not None else set()
            if now is not obj:
                table[name] = obj
            obj.data = data
            replaced.append((keys, f"{type(mod).__name__}.{name}"))
    return replaced


class Plan:
    """The checked plan: ``writes`` (Write) of the planned keys, ``planned``
    and ``fallback`` (key -> reason) and ``unused`` keys."""

    def __init__(self):
        self.writes = []
        self.planned = []
        self.fallback = collections.OrderedDict()
        self.unused = []


def check(tr, model, stand_ins):
    """Proves ``tr`` against ``model``: each destination storage with a
    planned write is written exactly once, every byte of each of its
    parameters (``destinations``) included; else its keys fall back. Then
    a key with any fallback write falls back whole."""
    plan = Plan()
    keys = [s.key for s in stand_ins]
    if tr.whole_reason is not None:
        for k in keys:
            plan.fallback[k] = tr.whole_reason
        return plan
    fallback = collections.OrderedDict(tr.fallback)
    dests = destinations(model)
    by_storage = collections.OrderedDict()
    for w in tr.writes:
        if w.key not in fallback:
            by_storage.setdefault(storage_key(w.dest), []).append(("plan", w.dest, (w.key,)))
    for sk, view, ks in tr.other_writes:
        if sk in by_storage:
            by_storage[sk].append(("other", view, ks))
    # Fallback writes of keys that fell back only after their writes were
    # listed as planned (a key with planned and fallback writes).
    for w in tr.writes:
        sk = storage_key(w.dest)
        if w.key in fallback and sk in by_storage:
            by_storage[sk].append(("other", w.dest, (w.key,)))
    for sk, writes in by_storage.items():
        why = _exactly_once(writes, dests.get(sk, []))
        if why is not None:
            for kind, _v, ks in writes:
                if kind == "plan":
                    for k in ks:
                        fallback.setdefault(k, why)
    for w in tr.writes:
        if w.key not in fallback:
            plan.writes.append(w)
    planned = {w.key for w in plan.writes}
    plan.planned = [k for k in keys if k in planned]
    plan.fallback = collections.OrderedDict((k, fallback[k]) for k in keys if k in fallback)
    plan.unused = [k for k in tr.unused if k not in fallback and k not in planned]
    return plan


def _exactly_once(writes, params):
    """None when ``writes`` (into one storage) cover each of ``params``'
    bytes exactly once, else why not."""
    runs = []
    for _kind, view, _ks in writes:
        r = _runs(view)
        if r is None:
            return "a write too scattered to check"
        runs.extend(r)
    runs.sort()
    for (a0, z0), (a1, z1) in zip(runs, runs[1:]):
        if a1 < z0:
            names = ", ".join(n for n, _ in params) or "a parameter"
            return f"writes overlap in {names} (bytes {a1}-{min(z0, z1)})"
    # Merge, then each parameter's bytes must lie inside the runs.
    merged = []
    for a, z in runs:
        if merged and merged[-1][1] == a:
            merged[-1] = (merged[-1][0], z)
        else:
            merged.append((a, z))
    for name, p in params:
        pr = _runs(p)
        if pr is None:
            return f"{name}: too scattered to check"
        for a, z in pr:
            if not any(ma <= a and z <= mz for ma, mz in merged):
                covered = sum(max(0, min(z, mz) - max(a, ma)) for ma, mz in merged)
                return f"{name}: {z - a - covered} of its bytes {a}-{z} are not written by the loader"
    return None


def fill_targets(plan, info):
    """The plan as fill targets: ``(cpu, device)`` where ``cpu`` is
    ``[(key, bounds or None, None, address, nbytes)]`` (``Reader._fill``'s
    targets; bounds None for a whole tensor) and ``device`` is ``[(key,
    bounds or None, view)]`` (``load_into``'s pipeline items) for
    destinations on a device. ``info(key)`` gives the tensor's shape."""
    cpu, device = [], []
    for w in plan.writes:
        shape = info(w.key)
        for idx, view in _pieces(w.dest):
            box = list(w.box)
            # The prefix fixes the outer dimensions of the destination,
            # which are the outer dimensions of the box that are not 1.
            if idx:
                box = _narrow_box(box, list(w.dest.shape), idx)
            bounds = None if all(a == 0 and z == n for (a, z), n in zip(box, shape)) else box
            n = view.numel() * view.element_size()
            if view.device.type == "cpu":
                cpu.append((w.key, bounds, None, view.data_ptr(), n))
            else:
                device.append((w.key, bounds, view))
    return cpu, device


def fill(plan, readers, pipeline=False):
    """Reads ``plan``'s writes into their destinations: ``readers`` maps a
    key's first element to the ``_native.Reader`` of its checkpoint (the
    second is the tensor's name). CPU destinations through one
    ``Engine::fill`` per reader (in place where phase allows, else staged
    and copied); destinations on a device through ``load_into``'s pipeline
    (pinned staging, copies on a side stream, batched). ``pipeline`` sends
    CPU destinations through the pipeline too (tests of the device path on
    a machine without one). Returns the bytes by way: ``in_place_bytes``,
    ``staged_bytes``, ``device_bytes``, ``bytes``."""
    import json

    from . import _load_into as li

    out = {"bytes": 0, "in_place_bytes": 0, "staged_bytes": 0, "device_bytes": 0}

    def add(got, device=False):
        for k in ("bytes", "in_place_bytes", "staged_bytes"):
            out[k] += got[k]
        if device:
            out["device_bytes"] += got["bytes"]

    by_reader = collections.OrderedDict()
    for w in plan.writes:
        by_reader.setdefault(w.key[0], []).append(w)
    for i, writes in by_reader.items():
        r = readers[i]
        sub = Plan()
        sub.writes = writes
        shapes = {}
        cpu, device = fill_targets(sub, lambda k: shapes.setdefault(k, r.info(k[1])[1]))
        cpu = [(k[1], b, rng, addr, n) for k, b, rng, addr, n in cpu]
        device = [(k[1], b, view) for k, b, view in device]
        if pipeline and cpu:
            device += [(name, b, _cpu_bytes(addr, n)) for name, b, _rng, addr, n in cpu]
            cpu = []
        with torch.no_grad():
            if cpu:
                add(json.loads(r._fill(cpu)))
            by_device = collections.OrderedDict()
            for item in device:
                by_device.setdefault(item[2].device, []).append(item)
            for dev, items in by_device.items():
                copier = li._CudaCopier(dev) if dev.type == "cuda" else li._HostCopier()
                add(li._Pipeline(r, copier, li.DEVICE_STAGING).run(items), device=True)
    return out


def rehome(plan, model, readers, others=()):
    """Moves CPU parameters into memory of their own in phase with the
    files their planned writes read (``address % A == offset % A``, A the
    reader's O_DIRECT block), so that the fill reads them in place, with no
    staging and no copy: torch's allocator hands out memory at 64 bytes,
    in phase by chance once in 64. A storage's writes may each want
    another phase; it takes the phase most of its bytes want (a fused qkv
    whose q, k and v lie in a row in one file: all of them). Only a
    parameter that alone holds its storage, whole, moves (no other
    parameter, buffer or view: the storage's use count); ``param.data``
    is replaced, the Parameter object kept (vLLM's attributes on it, ties,
    the module's tables unchanged), the old storage freed. ``others`` is
    the trace's ``other_writes``: a write the trace ran into a storage that
    moves (padding zeroed) is copied to the new storage, the list's view
    taken there; a write of a key that fell back (vLLM's loader writes it
    again, into the parameter, later) and an empty one only follow the
    storage. Returns
    ``{"parameters", "bytes"}`` moved, ``in_phase`` (already were) and
    ``stayed``: ``{reason: [parameter names]}`` for those left where they
    are (said in the loader's log)."""
    out = {"parameters": 0, "bytes": 0, "in_phase": 0, "stayed": {}}

    def stay(reason, names):
        out["stayed"].setdefault(reason, []).extend(names)

    count = getattr(torch._C, "_storage_Use_Count", None)
    if count is None:
        return out
    by_storage = collections.OrderedDict()
    for w in plan.writes:
        by_storage.setdefault(storage_key(w.dest), []).append(w)
    other_at = collections.defaultdict(list)
    for i, other in enumerate(others):
        if other[0] in by_storage:
            other_at[other[0]].append(i)
    other = None  # holds a view: it would count as a holder below
    dests = destinations(model)
    for sk, writes in by_storage.items():
        owners = dests.get(sk, [])
        if writes[0].dest.device.type != "cpu":
            continue
        if len(owners) != 1:
            stay("several parameters on one storage", [n for n, _ in owners] or ["(no parameter)"])
            continue
        name, p = owners[0]
        if not isinstance(p, torch.nn.Parameter) or not p.is_leaf:
            stay("not a parameter of its own (a computed tensor)", [name])
            continue
        st = p.untyped_storage()
        nbytes = p.numel() * p.element_size()
        if p.storage_offset() != 0 or not p.is_contiguous() or st.nbytes() != nbytes:
            stay("a part of its storage, or strided", [name])
            continue
        base = p.data_ptr()
        # The phase each write wants, by its bytes: a box that is one run of
        # its file (leading rows, the rest whole) into a contiguous view.
        want = collections.Counter()
        align = None
        for w in writes:
            r = readers[w.key[0]]
            align = align or r.direct_align()
            _dtype, shape, tbytes, off = r.info(w.key[1])
            start = _run_start(shape, w.box, tbytes)
            if start is None or not w.dest.is_contiguous():
                continue
            at = w.dest.data_ptr() - base
            want[(off + start - at) % align] += w.dest.numel() * w.dest.element_size()
        if not want:
            stay("no write is one run of its file", [name])
            continue
        phase, _ = want.most_common(1)[0]
        if base % align == phase:
            out["in_phase"] += 1
            continue
        # Holders of the storage: the parameter, `st`, and the plan's
        # destinations, each made a plain tensor on the storage (a view's
        # base, a `param.data` alias of the trace, would hold it too and
        # hide a holder that is not ours): anything more (a module's view
        # of the parameter, another tensor) and the parameter stays.
        def plain(d):
            return torch.empty(0, dtype=d.dtype).set_(st, d.storage_offset(), d.shape, d.stride())

        for w in writes:
            w.dest = plain(w.dest)
        for i in other_at[sk]:
            osk, view, ks = others[i]
            others[i] = (osk, plain(view), ks)
            del view
        if count(st._cdata) > 2 + len(writes) + len(other_at[sk]):
            stay("held by another tensor", [name])
            continue
        es = p.element_size()
        if phase % es:
            stay("file offset not a multiple of the element size", [name])
            continue
        new = _mapped_bytes(nbytes, phase).view(p.dtype).view(p.shape)

        def moved(d):
            # The same view of the new storage (offsets from its start).
            return new.as_strided(d.shape, d.stride(), new.storage_offset() + d.storage_offset())

        for w in writes:
            w.dest = moved(w.dest)
        for i in other_at[sk]:
            osk, view, ks = others[i]
            nv = moved(view)
            if not ks and view.numel():
                nv.copy_(view)  # ran in the trace (padding): its bytes go along
            others[i] = (storage_key(nv), nv, ks)
            del view, nv
        del st
        p.data = new
        out["parameters"] += 1
        out["bytes"] += nbytes
    return out


_HUGE = 2 << 20


def _mapped_bytes(nbytes, phase):
    """``nbytes`` of fresh anonymous memory at an address ``phase`` bytes
    past a 2 MiB boundary (``phase`` < a page), as a uint8 tensor whose
    storage is those bytes alone and which keeps its mapping alive, unmapped
    when the storage is freed.

    Not the allocator's: glibc raises its mmap threshold to the size of
    each large block freed (up to 32 MiB), so once ``rehome`` has freed the
    parameters' first storages the next ones of that size come from its
    heap, and when vLLM's CPU weight processing later frees them (oneDNN
    packs a linear's weight and drops it) the heap keeps the pages: 18
    fused qkv weights of 10.5 MB left 20 MB resident, measured. A mapping
    of its own gives them back when the parameter goes.

    At a 2 MiB boundary: the huge-page advice the loader gives the storage
    (``_Prepare``) then covers whole huge pages from its first byte; the
    storage ends where the parameter does, so no huge page reaches past it
    (the last partial 2 MiB is small pages). The mapping is 2 MiB longer than
    that; the slack before and after is never touched (no resident page)."""
    import mmap

    # Private: the process's own pages (counted as its anonymous memory,
    # copied on write at a fork), as malloc's are; Python's default for an
    # anonymous map is shared memory.
    m = mmap.mmap(-1, nbytes + phase + _HUGE, flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(m, dtype=torch.uint8)
    start = (-whole.data_ptr()) % _HUGE + phase
    del whole
    return torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=start)


def _run_start(shape, box, tbytes):
    """The byte offset in its tensor's payload where ``box`` starts when
    the box is one run of the payload (single elements in its outer
    dimensions, a range in one, the inner dimensions whole), else None."""
    elems = 1
    for n in shape:
        elems *= n
    if elems == 0:
        return None
    k = 0
    while k < len(shape) and box[k][1] - box[k][0] == 1 and shape[k] != 1:
        k += 1
    if any(box[d] != (0, shape[d]) for d in range(k + 1, len(shape))):
        return None
    flat = 0
    for d, n in enumerate(shape):
        flat = flat * n + box[d][0]
    return flat * tbytes // elems


def _cpu_bytes(address, nbytes):
    """``nbytes`` of CPU memory at ``address`` (a parameter's, which keeps
    it alive) as a uint8 tensor."""
    import ctypes

    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)


def _narrow_box(box, dshape, idx):
    """``box`` with the destination's first ``len(idx)`` dimensions fixed
    at ``idx``: the destination's dimensions map, in order, onto the box's
    dimensions of more than one element (a strided destination's pieces
    are taken only where that holds: see ``_pieces``)."""
    dims = [d for d, (a, z) in enumerate(box) if z - a != 1]
    ddims = [d for d, n in enumerate(dshape) if n != 1]
    out = list(box)
    for j, i in enumerate(idx):
        if dshape[j] == 1:
            continue
        d = dims[ddims.index(j)]
        a = box[d][0] + i
        out[d] = (a, a + 1)
    return out
