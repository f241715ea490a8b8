"""safetensors 0.8's slice grammar, for ``get_slice(name)[index]``: what an
index may be, the errors it raises (same class, same message), and the
block to read for it.

An index is an int, a slice, ``...``, an empty list, or a tuple of the
first three. Parsing and the checks follow safetensors' own
(``parse_indexers`` and ``slice_byte_ranges``), dimension by dimension from
the last, so the error a bad index raises is the one safetensors raises.
Where safetensors answers only by accident (a start past the stop made it
raise SystemError, a negative slice bound OverflowError), this answers as
Python does: an empty block, a bound counted from the end."""

import math
import operator


class Select:
    """One index of a dimension (the dimension is dropped)."""

    __slots__ = ("n",)

    def __init__(self, n):
        self.n = n

    def __str__(self):
        return str(self.n)


class Narrow:
    """``start:stop:step`` of a dimension (``None``: from the start, to the end)."""

    __slots__ = ("start", "stop", "step")

    def __init__(self, start, stop, step):
        self.start, self.stop, self.step = start, stop, step

    def __str__(self):
        a = "" if self.start is None else str(self.start)
        b = "" if self.stop is None else str(self.stop)
        return f"{a}:{b}" if self.step == 1 else f"{a}:{b}:{self.step}"


def parse(index, shape, error):
    """The indexers of `index` for a tensor of `shape`; `error` is the
    class raised (SafetensorError) with safetensors' messages."""
    if isinstance(index, tuple):
        items = list(index)
    elif isinstance(index, list):
        if not index:
            # An empty list selects nothing of the first dimension.
            return [Narrow(0, 0, 1)]
        raise error("Non empty lists are not implemented")
    else:
        items = [index]
    ellipses = sum(1 for it in items if it is Ellipsis)
    if ellipses > 1:
        raise error("Only one ellipsis (...) is allowed in slice index")
    expansion = max(len(shape) - (len(items) - ellipses), 0)
    out = []
    for it in items:
        dim = len(out)
        size = shape[dim] if dim < len(shape) else 0
        if it is Ellipsis:
            out.extend(Narrow(None, None, 1) for _ in range(expansion))
        elif isinstance(it, slice):
            step = 1 if it.step is None else operator.index(it.step)
            if step < 1:
                raise error(f"Slice step must be a positive integer, got {step}")
            out.append(Narrow(_bound(it.start, dim, size, error), _bound(it.stop, dim, size, error), step))
        else:
            try:
                n = operator.index(it)
            except TypeError:
                raise error(f"Unsupported slice index at position {dim}: expected slice, int, or ellipsis") from None
            if n < 0:
                if size + n < 0:
                    raise error(f"Invalid index {n} for dimension {dim} of size {size}")
                n += size
            out.append(Select(n))
    return out


def _bound(b, dim, size, error):
    """A slice bound: None, or an int (negative: counted from the end)."""
    if b is None:
        return None
    b = operator.index(b)
    if b < 0:
        if size + b < 0:
            raise error(f"Invalid index {b} for dimension {dim} of size {size}")
        b += size
    return b


MISALIGNED = (
    "The slice is slicing for subbytes dtypes, and the slice does not end up at a byte boundary, this is invalid."
)


def resolve(indexers, shape, bits, error):
    """Checks `indexers` against a tensor of `shape` whose elements have
    `bits` bits, as safetensors does, and returns the block to read and
    what to apply to it in memory: ``(bounds, rest, newshape)``, bounds a
    ``(start, stop)`` per indexed dimension (step 1: from the first kept
    index to the last), ``rest`` a tuple of slices (steps) and 0s (dropped
    dimensions), ``newshape`` the result's shape. A block of no element
    has ``bounds`` None."""

    def fail(why):
        shown = "[" + ", ".join(str(i) for i in indexers) + "]"
        raise error(f"Error during slicing {shown} with shape {list(shape)}: {why}")

    if len(indexers) > len(shape):
        fail("more slicing indexes than dimensions in tensor")
    span = bits
    sliced = False
    spans = [0] * len(indexers)
    for i in range(len(shape) - 1, -1, -1):
        dim = shape[i]
        if i >= len(indexers):
            span *= dim
            continue
        ix = indexers[i]
        if isinstance(ix, Select):
            start, stop, step = ix.n, ix.n + 1, 1
        else:
            start = 0 if ix.start is None else ix.start
            stop = dim if ix.stop is None else ix.stop
            step = ix.step
        if start >= dim or stop > dim:
            fail(f"index {start if start >= dim else max(stop - 1, 0)} out of bounds for tensor dimension #{i} of size {dim}")
        kept = len(range(start, stop, step))
        if not sliced:
            if step == 1 and start == 0 and stop == dim:
                pass
            elif step == 1:
                if start * span % 8 or stop * span % 8:
                    fail(MISALIGNED)
                sliced = True
            else:
                # Each kept element a run of its own: whole bytes only if
                # an element is.
                if kept and span % 8:
                    fail(MISALIGNED)
                sliced = kept > 0
        else:
            if kept and span % 8:
                m = 8 // math.gcd(span, 8)
                if start % m or (kept > 1 and step % m):
                    fail(MISALIGNED)
            sliced = kept > 0
        spans[i] = (start, stop, step, kept)
        span *= dim
    if not sliced and span % 8:
        fail(MISALIGNED)
    bounds, rest, newshape = [], [], []
    empty = False
    for i, ix in enumerate(indexers):
        start, stop, step, kept = spans[i]
        if kept == 0:
            empty = True
            bounds.append((start, start))
        else:
            bounds.append((start, start + (kept - 1) * step + 1))
        if isinstance(ix, Select):
            rest.append(0)
        else:
            rest.append(slice(None, None, step) if step > 1 else slice(None))
            newshape.append(kept)
    newshape += list(shape[len(indexers) :])
    return (None if empty else bounds), tuple(rest), newshape


def basic(index, shape):
    """torch's basic indexing (ints, slices with a positive step, ``...``,
    a tuple of those) of a tensor of `shape` as the block to read and what
    to apply to it: ``(bounds, rest)`` in the same units as `shape`, or
    None for anything else (None, bools, lists, tensors: the caller reads
    the whole tensor and lets torch index it). The index must already have
    passed torch's own checks (the caller indexes a meta tensor first)."""
    items = list(index) if isinstance(index, tuple) else [index]
    for it in items:
        if it is Ellipsis or isinstance(it, slice):
            continue
        if isinstance(it, bool) or not hasattr(type(it), "__index__"):
            return None
        if hasattr(it, "shape") and getattr(it, "ndim", 0) != 0:
            return None  # an array or tensor of indices: advanced indexing
    if sum(1 for it in items if it is Ellipsis) > 1:
        return None
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (len(shape) - (len(items) - 1)) + items[k + 1 :]
    if len(items) > len(shape):
        return None
    bounds, rest = [], []
    for it, n in zip(items, shape):
        if isinstance(it, slice):
            start, stop, step = it.indices(n)
            if step < 1:
                return None
            kept = len(range(start, stop, step))
            if kept == 0:
                return None
            bounds.append((start, start + (kept - 1) * step + 1))
            rest.append(slice(None, None, step) if step > 1 else slice(None))
        else:
            i = operator.index(it)
            i = i + n if i < 0 else i
            bounds.append((i, i + 1))
            rest.append(0)
    return bounds, tuple(rest)
