"""Traced load plans kept on disk, so that a model loaded again skips the
trace (``_weight_plan.trace``: the model's own loaders run on metadata
stand-ins, 7-10% of a load on a fast drive).

A plan is found by a digest of everything the trace depends on: the
versions of weightstream, vLLM and torch, the model's class, its config,
the rank in each parallel group, every parameter and buffer (name, dtype,
shape, strides, offset) and every stand-in (name as the loader gets it,
dtype, shape): a checkpoint whose headers differ, a model built
otherwise or another rank never finds another's plan.

What is kept is the trace's result: each planned write (checkpoint tensor,
box, destination as parameter, dtype, byte offset, shape, strides), each
fallback and its reason, the unused tensors, the loader's return value. A
trace is kept only when replaying it is the whole of what the loader did:

- no write into a parameter that no checkpoint tensor feeds (a vocabulary's
  padding zeroed: the trace ran it, a replay would not);
- no attribute of a module or parameter set or resized by the loader (a
  flag a later step reads);
- the loader did not fail on the stand-ins.

A plan read back is untrusted input, as a header is: its checksum, every
key, box, parameter, dtype and extent are checked against the model and
the stand-ins, and ``_weight_plan.check`` then proves it as it proves a
fresh trace (every byte of each planned parameter written exactly once);
anything else and the trace runs, the reason said in the report.
"""

import hashlib
import json
import os
import tempfile
import time

import torch

from . import _weight_plan as wp

# Bumped when what is kept, or what it means, changes.
FORMAT = 1


def default_dir():
    """``$WEIGHTSTREAM_PLAN_CACHE``, else ``$XDG_CACHE_HOME/weightstream/
    vllm-plans`` (``~/.cache`` without it)."""
    d = os.environ.get("WEIGHTSTREAM_PLAN_CACHE", "").strip()
    if d:
        return d
    base = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "weightstream", "vllm-plans")


def _layout(model):
    out = []
    for kind, items in (("p", model.named_parameters(remove_duplicate=False)), ("b", model.named_buffers(remove_duplicate=False))):
        for name, t in items:
            if t is None:
                continue
            try:
                off = t.storage_offset()
                stride = list(t.stride())
            except (RuntimeError, NotImplementedError):
                off, stride = None, None
            out.append([kind, name, str(t.dtype), list(t.shape), stride, off, t.device.type])
    return out


def digest(model, stand_ins, context):
    """The plan's key: a hex digest of ``context`` (a JSON-able dict: the
    versions, the config, the ranks), the model's class and layout and the
    stand-ins."""
    cls = type(model)
    material = {
        "format": FORMAT,
        "context": context,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "layout": _layout(model),
        "stand_ins": [[s.name, _key_json(s.key), str(s.dtype), list(s.shape)] for s in stand_ins],
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


def _key_json(key):
    return list(key) if isinstance(key, tuple) else key


def attributes(model):
    """What of ``model`` a loader could change besides its tensors' bytes:
    each module's and parameter's attributes (identity, and the length of a
    container), for ``changed``."""
    out = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for k, v in vars(mod).items():
            if k in ("_parameters", "_buffers", "_modules"):
                continue
            out[("m", mname, k)] = _summary(v)
        for table in (mod._parameters, mod._buffers):
            for pname, t in table.items():
                if t is not None:
                    for k, v in vars(t).items():
                        out[("p", mname, pname, k)] = _summary(v)
    return out


def _summary(v):
    try:
        n = len(v) if isinstance(v, (list, dict, set, tuple)) else None
    except TypeError:
        n = None
    return (id(v), n)


def changed(before, model):
    """The first attribute the loader set, dropped or resized since
    ``before`` (``attributes``), named; None when none."""
    after = attributes(model)
    for k in sorted(set(before) | set(after), key=str):
        if before.get(k) != after.get(k):
            return ".".join(str(p) for p in k[1:] if p)
    return None


def _dest_record(dest, owner_of):
    """A planned destination as the cache keeps it, or None when it is not
    a view of a known parameter's or buffer's storage."""
    name = owner_of.get(wp.storage_key(dest))
    if name is None:
        return None
    es = dest.element_size()
    return [name, str(dest.dtype), dest.storage_offset() * es, list(dest.shape), list(dest.stride())]


def store(directory, key, tr, model, before):
    """Keeps ``tr`` (a fresh trace of ``model``) under ``key`` in
    ``directory``; ``before`` is ``attributes(model)`` taken before the
    trace. Returns None when kept, else why not (said in the report). The
    file is written whole or not at all (a temporary file, renamed)."""
    if tr.whole_reason is not None:
        return f"not kept: {tr.whole_reason}"
    if any(not ks and v.numel() for _sk, v, ks in tr.other_writes):
        return "not kept: the loader writes parameters from no checkpoint tensor (a replay would not)"
    what = changed(before, model)
    if what is not None:
        return f"not kept: the loader changes the model's attribute {what} (a replay would not)"
    owner_of = {}
    for sk, owners in wp.destinations(model).items():
        owner_of[sk] = owners[0][0]
    writes = []
    for w in tr.writes:
        d = _dest_record(w.dest, owner_of)
        if d is None:
            return "not kept: a write into a tensor that is not the model's parameter or buffer"
        writes.append([_key_json(w.key), [list(b) for b in w.box], d])
    others = []
    for _sk, view, ks in tr.other_writes:
        if not ks:
            continue  # empty (above): nothing to replay
        d = _dest_record(view, owner_of)
        if d is None:
            return "not kept: a write into a tensor that is not the model's parameter or buffer"
        others.append([d, [_key_json(k) for k in ks]])
    body = {
        "writes": writes,
        "other_writes": others,
        "fallback": [[_key_json(k), why] for k, why in tr.fallback.items()],
        "unused": [_key_json(k) for k in tr.unused],
        "loaded": None if tr.loaded is None else sorted(tr.loaded),
        "runs": tr.runs,
    }
    text = json.dumps(body, sort_keys=True)
    doc = json.dumps({"format": FORMAT, "key": key, "sha256": hashlib.sha256(text.encode()).hexdigest(), "plan": body})
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".plan-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(doc)
            os.replace(tmp, os.path.join(directory, key + ".json"))
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    except OSError as e:
        return f"not kept: {directory}: {e}"
    return None


class Refused(Exception):
    """A kept plan that does not fit the model or the stand-ins."""


def load(directory, key, model, stand_ins):
    """The trace kept under ``key``, rebuilt on ``model``: ``(Trace, None)``,
    ``(None, None)`` when there is none, or ``(None, why)`` when the file
    is there but refused (corrupt, or not this model's)."""
    t0 = time.perf_counter()
    path = os.path.join(directory, key + ".json")
    try:
        with open(path) as f:
            doc = json.load(f)
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"{path}: unreadable ({e})"
    try:
        tr = _rebuild(doc, key, model, stand_ins)
    except Refused as e:
        return None, f"{path}: {e}"
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as e:
        return None, f"{path}: malformed ({type(e).__name__}: {e})"
    tr.seconds = time.perf_counter() - t0
    return tr, None


def _rebuild(doc, key, model, stand_ins):
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("key") != key:
        raise Refused("another format or key")
    body = doc["plan"]
    if hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest() != doc.get("sha256"):
        raise Refused("its checksum does not match (a damaged file)")
    by_key = {s.key: s for s in stand_ins}

    def key_of(j):
        k = tuple(j) if isinstance(j, list) else j
        if k not in by_key:
            raise Refused(f"names a tensor the checkpoint does not have ({j!r})")
        return k

    tensors = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        tensors.setdefault(name, t)

    def dest_of(rec):
        name, dtype, off, shape, stride = rec
        t = tensors.get(name)
        if t is None or t.device.type == "meta":
            raise Refused(f"names a parameter the model does not have ({name!r})")
        dt = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(dt, torch.dtype):
            raise Refused(f"names no dtype ({dtype!r})")
        es = torch.empty(0, dtype=dt).element_size()
        if not (isinstance(off, int) and off >= 0 and off % es == 0 and len(shape) == len(stride)):
            raise Refused(f"a destination in {name} out of shape")
        if any(not isinstance(n, int) or n < 0 for n in shape) or any(not isinstance(s, int) or s < 0 for s in stride):
            raise Refused(f"a destination in {name} out of shape")
        st = t.untyped_storage()
        extent = 0 if 0 in shape else (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * es
        if off + extent > st.nbytes():
            raise Refused(f"a destination past the end of {name}")
        return torch.empty(0, dtype=dt, device=t.device).set_(st, off // es, shape, stride)

    tr = wp.Trace()
    tr.runs = int(body["runs"])
    for kj, box, rec in body["writes"]:
        k = key_of(kj)
        s = by_key[k]
        box = [tuple(b) for b in box]
        if len(box) != len(s.shape) or any(not (0 <= a < z <= n) for (a, z), n in zip(box, s.shape)):
            raise Refused(f"a box outside {s.name}")
        dest = dest_of(rec)
        n = 1
        for a, z in box:
            n *= z - a
        if dest.numel() != n or dest.dtype != s.dtype:
            raise Refused(f"a destination that does not hold its box of {s.name}")
        tr.writes.append(wp.Write(k, box, dest))
    for rec, kjs in body["other_writes"]:
        ks = tuple(key_of(kj) for kj in kjs)
        if not ks:
            raise Refused("a write from no checkpoint tensor")
        v = dest_of(rec)
        tr.other_writes.append((wp.storage_key(v), v, ks))
    for kj, why in body["fallback"]:
        tr.fall_back(key_of(kj), str(why))
    tr.unused = [key_of(kj) for kj in body["unused"]]
    tr.loaded = None if body["loaded"] is None else set(map(str, body["loaded"]))
    return tr
