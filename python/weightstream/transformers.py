"""transformers through weightstream.

``patch()`` makes transformers' own ``from_pretrained`` read every
checkpoint through weightstream's drop-in ``safe_open`` (O_DIRECT, every
drive, mirrors and split folders as the ``WEIGHTSTREAM_*`` variables say),
each module's binding included: transformers imports ``safe_open`` by name
into several of its modules (``modeling_utils``, ``modeling_layers``,
``integrations.accelerate``, ``quantizers.quantizer_torchao`` in 5.x), so
changing the import in one place does nothing. A plain call patches until
``undo()``; as a context manager, until the block ends::

    import weightstream.transformers as wtf

    with wtf.patch():
        model = AutoModelForCausalLM.from_pretrained(path)

``from_pretrained(path)`` builds a transformers model from its config
without initializing its weights and fills it with ``load_into``: one
allocation of the model, its bytes read O_DIRECT in place.

torch and transformers are imported only when a function here is called.
"""

import collections
import importlib
import sys
import threading

# Modules of transformers that bind safe_open by name (5.x); patch()
# imports them first, so that none binds the original after the patch.
_MODULES = (
    "transformers.modeling_utils",
    "transformers.modeling_layers",
    "transformers.integrations.accelerate",
    "transformers.quantizers.quantizer_torchao",
)

_lock = threading.Lock()
# The patches in force, outermost first: undo restores what each found.
_active = []


class Patch:
    """transformers' ``safe_open`` bindings swapped for weightstream's (see
    ``patch``). ``bindings``: the ``(module, attribute)`` pairs it
    replaced; ``opened``: the files opened through it so far."""

    def __init__(self):
        self.bindings = []
        self.opened = []
        self._saved = []
        self._done = False

    def _open(self, *args, **kwargs):
        from . import safe_open

        f = safe_open(*args, **kwargs)
        self.opened.append(str(args[0] if args else kwargs.get("filename")))
        return f

    def undo(self):
        """Puts every binding back as it was (idempotent). Patches undone
        out of order are refused: the later one's bindings would be lost."""
        with _lock:
            if self._done:
                return
            if _active and _active[-1] is not self:
                raise RuntimeError("weightstream.transformers: undo the innermost patch first")
            for module, attr, old in reversed(self._saved):
                setattr(module, attr, old)
            self._done = True
            _active.pop()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()
        return False

    def __repr__(self):
        state = "undone" if self._done else "active"
        return f"<weightstream.transformers.Patch {state}: {len(self.bindings)} bindings, {len(self.opened)} files opened>"


def patch():
    """Makes transformers read checkpoints through weightstream: every
    binding of safetensors' ``safe_open`` in transformers' loaded modules
    is replaced by weightstream's drop-in (same calls, same tensors, bit
    for bit). Returns a ``Patch``: a context manager, or call ``undo()``.
    Raises ``ImportError`` naming the package when transformers is not
    installed."""
    try:
        import safetensors
        import transformers  # noqa: F401 - the modules below are its
    except ImportError as e:
        raise ImportError(f"weightstream.transformers.patch needs transformers and safetensors installed: {e}") from e
    for name in _MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - a module this transformers lacks (or cannot import here): nothing to bind
            pass
    original = safetensors.safe_open
    p = Patch()
    with _lock:
        # What a patch in force put there (a Patch's bound _open) counts
        # as the original too: nested patches stack.
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "transformers" or name.startswith("transformers.")):
                continue
            for attr in ("safe_open",):
                got = getattr(module, attr, None)
                if got is not None and (got is original or _is_bound_open(got)):
                    p._saved.append((module, attr, got))
                    setattr(module, attr, p._open)
                    p.bindings.append((name, attr))
        _active.append(p)
    return p


def _is_bound_open(obj):
    """A patch's ``_open`` (a bound method of a Patch)."""
    return getattr(obj, "__func__", None) is Patch._open


class Loaded:
    """What ``from_pretrained`` did, as ``model.weightstream``: ``report``
    (``load_into``'s: tensors, bytes, seconds, in place and staged, casts,
    tied), ``build_seconds`` (the model built from its config, its weights
    not initialized), ``load_seconds``, ``ignored`` (checkpoint tensors the
    model does not take, as transformers ignores them)."""

    def __init__(self, report, build_seconds, load_seconds, ignored, streamer=None):
        self.report = report
        self.build_seconds = build_seconds
        self.load_seconds = load_seconds
        self.ignored = ignored
        self._streamer = streamer

    @property
    def expert_cache(self):
        """The ExpertCache the routed experts are served from (None
        without an expert budget)."""
        return None if self._streamer is None else self._streamer.cache

    def stats(self):
        """The load's figures as one dict; with an expert budget also
        ``experts`` (the cache's counters) and ``steps`` (per forward of
        the model, i.e. per generated token in decode: hits, misses,
        prefetched, prefetch used and wasted, seconds waited, bytes read;
        the last STEPS_KEPT of them) and ``realigned`` (expert weights
        copied out of the cache to torch's 64-byte alignment: copies,
        bytes)."""
        out = {"build_seconds": self.build_seconds, "load_seconds": self.load_seconds, "ignored": list(self.ignored), **self.report}
        if self._streamer is not None:
            out["experts"] = self._streamer.cache.stats()
            out["steps"] = list(self._streamer.steps)
            out["realigned"] = dict(self._streamer.realigned)
        return out

    def __repr__(self):
        r = self.report
        return f"<weightstream.transformers.Loaded: {r.get('tensors')} tensors, {r.get('bytes', 0) / 1e9:.3f} GB in {self.load_seconds:.3f} s>"


def _resolve_dtype(dtype, config, path):
    import torch

    if dtype is None:
        dtype = "auto"  # transformers 5's default
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        got = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if got is not None:
            return getattr(torch, got) if isinstance(got, str) else got
        # The checkpoint's first floating tensor's dtype, as transformers.
        from . import _native
        from ._convert import torch_dtype

        for _name, dt, _shape, _nbytes, _file, _off, _drives in _native.catalog(path, env=True):
            t = torch_dtype(dt)
            if t.is_floating_point:
                return t
        return torch.get_default_dtype()
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ValueError(f"weightstream.transformers.from_pretrained: dtype {dtype!r}: a torch.dtype, its name, 'auto' or None")


def from_pretrained(
    path,
    model_class=None,
    *,
    dtype=None,
    expert_capacity=None,
    expert_budget_bytes=None,
    prefetch=True,
    config=None,
    attn_implementation=None,
    dirs=None,
    mirrors=None,
    route=None,
    direct=None,
    staging_bytes=None,
    **kwargs,
):
    """A transformers model from the checkpoint folder ``path``, read by
    weightstream: ``model_class`` (default ``AutoModelForCausalLM``; an
    Auto class or a model class) is built from the folder's config with
    its weights allocated but not initialized (transformers'
    ``no_init_weights``: each parameter's memory is allocated once and
    first written by its read), tied as the config says, then filled by
    ``weightstream.torch.load_into`` (O_DIRECT, in place, every drive and
    mirror; the model's own checkpoint conversions, experts stored one by
    one into their fused tensors). Memory: the model plus ``staging_bytes``.

    ``dtype``: as transformers 5's (None or "auto": the config's, or else
    the checkpoint's first floating dtype; a dtype or its name); a tensor of
    another dtype is converted as transformers converts it (listed in the
    report's ``cast``). ``config``: a config to use instead of the
    folder's; ``attn_implementation``; other keyword arguments update the
    config, as in transformers. ``dirs``, ``mirrors``, ``route``,
    ``direct``: as ``weightstream.load``'s.

    The model is returned in eval mode with its generation config, and
    ``model.weightstream`` (a ``Loaded``: the report, the seconds).
    Raises load_into's errors (a shape that differs, a file that is bad,
    each named), and a RuntimeError naming every parameter or persistent
    buffer the checkpoint does not fill, except those the model declares
    optional (``_keys_to_ignore_on_load_missing``): transformers would
    initialize them at random, this function never hands back a weight it
    did not read. Checkpoint tensors the model has no place for are
    ignored, as transformers ignores them, and listed in
    ``model.weightstream.ignored``.

    ``expert_capacity`` / ``expert_budget_bytes``: the routed experts of
    a transformers 5 mixture-of-experts model are not allocated; each MoE
    layer's experts are served from an ``ExpertCache`` of that size over
    the checkpoint, in the layout transformers computes in (its eager
    experts forward, unchanged: the same result to the last bit).
    ``prefetch``: how many of the next layer's router guesses per token
    to prefetch while a layer computes (True: 1, False: none). A model
    without fused experts modules raises ValueError."""
    import os
    import re
    import time

    try:
        import torch
        import transformers
        from transformers import AutoConfig
        from transformers.initialization import no_init_weights
    except ImportError as e:
        raise ImportError(f"weightstream.transformers.from_pretrained needs torch and transformers installed: {e}") from e
    from .torch import load_into

    budgeted = expert_capacity is not None or expert_budget_bytes is not None
    guesses = _prefetch_count(prefetch)  # a bad value refused before anything is built
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"weightstream.transformers.from_pretrained: {path!r} is not a folder (a model folder with its config.json and safetensors shards)")
    if config is None:
        config = AutoConfig.from_pretrained(path, **kwargs)
    else:
        for k, v in kwargs.items():
            setattr(config, k, v)
    if model_class is None:
        model_class = transformers.AutoModelForCausalLM
    dt = _resolve_dtype(dtype, config, path)
    build = {"dtype": dt}
    if attn_implementation is not None:
        build["attn_implementation"] = attn_implementation
    if budgeted:
        # The streamed experts index the fused parameters per expert, as
        # transformers' eager experts do (grouped_mm takes them whole).
        build["experts_implementation"] = "eager"
    t0 = time.perf_counter()
    with no_init_weights():
        if hasattr(model_class, "_model_mapping"):  # an Auto class
            model = model_class.from_config(config, **build)
        else:
            model = model_class._from_config(config, **build)
    if getattr(config, "tie_word_embeddings", False) or getattr(model, "_tied_weights_keys", None):
        model.tie_weights()
    t1 = time.perf_counter()
    streamer, load_rename = None, None
    if budgeted:
        streamer, load_rename = _stream_experts(model, path, dt, expert_capacity, expert_budget_bytes, guesses, dirs, mirrors, route, direct)
    else:
        from ._load_into import transformers_rename

        try:
            load_rename = transformers_rename(model)
        except ValueError:
            load_rename = None  # load_into says why, in its report and errors
    placed = _in_phase(model, path, load_rename, dirs, mirrors)
    got = load_into(
        model, path, strict=False, cast=True, rename=load_rename, dirs=dirs, mirrors=mirrors, route=route, direct=direct, staging_bytes=staging_bytes
    )
    load_rename = None
    t2 = time.perf_counter()

    def matches(patterns, name):
        return any(re.search(p, name) for p in patterns or ())

    missing = [k for k in got.missing_keys if not matches(getattr(model, "_keys_to_ignore_on_load_missing", None), k)]
    if missing:
        shown = ", ".join(missing[:20]) + (f", ... ({len(missing)} in all)" if len(missing) > 20 else "")
        raise RuntimeError(
            f"weightstream.transformers.from_pretrained: {path}: the checkpoint does not fill {len(missing)} of "
            f"{type(model).__name__}'s weights ({shown}); transformers would initialize them at random, this "
            "function does not (pass model_class for the checkpoint's architecture, or load it with transformers)"
        )
    ignored = [k for k in got.unexpected_keys if not matches(getattr(model, "_keys_to_ignore_on_load_unexpected", None), k)]
    if ignored:
        import warnings

        warnings.warn(
            f"weightstream.transformers.from_pretrained: {path}: {len(ignored)} checkpoint tensor(s) the model has no place for "
            f"were not read ({', '.join(ignored[:5])}{', ...' if len(ignored) > 5 else ''}): model.weightstream.ignored lists them",
            stacklevel=2,
        )
    model.eval()
    try:
        if model.can_generate() and os.path.isfile(os.path.join(path, "generation_config.json")):
            model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a model without generation: nothing to set
        import warnings

        warnings.warn(f"weightstream.transformers.from_pretrained: {path}: generation_config.json not applied: {e}", stacklevel=2)
    report = dict(got.report)
    report["placed"] = placed
    model.weightstream = Loaded(report, t1 - t0, t2 - t1, ignored, streamer)
    if streamer is not None:
        model.register_forward_pre_hook(lambda _m, _a: streamer.step_begin())
        model.register_forward_hook(lambda _m, _a, _o: streamer.step_end())
    return model


# torch's CPU allocator's alignment: what its kernels are used to.
TORCH_ALIGN = 64


def _in_phase(model, path, rename, dirs, mirrors):
    """Moves each CPU parameter a checkpoint tensor fills into memory of
    its own in phase with the file (``address % A == offset % A``, A the
    O_DIRECT block), so that ``load_into`` reads it in place: torch's
    allocator puts it at 64 bytes, in phase by chance once in 64, and the
    rest goes through staging and a copy. Run before any byte of the
    model's parameters is written (``no_init_weights``): the old storage
    was never touched, so the move costs no memory. A parameter whose
    parts want several phases (a fused tensor of several checkpoint
    tensors) takes the one most of its bytes want; one of a storage it
    shares, strided, or with a file offset that is not a multiple of its
    element size stays (named in ``stayed``; load_into stages its reads,
    counted in its report), and so does a parameter of three dimensions
    or more (a fused experts tensor) whose phase is off 64 bytes (torch's
    grouped_mm gives other last bits for it off torch's alignment). Each new storage gets MADV_HUGEPAGE (its faults
    take 2 MiB pages). Returns ``{"parameters", "bytes", "in_phase",
    "stayed"}``."""
    import collections

    import torch

    from . import _native
    from ._convert import torch_dtype

    out = {"parameters": 0, "bytes": 0, "in_phase": 0, "stayed": []}
    align = _native.Reader(path, dirs=dirs, mirrors=mirrors, env=True)
    try:
        align_bytes = align.direct_align()
    finally:
        align.close()
    if align_bytes <= 1:
        return out
    named = dict(model.named_parameters(remove_duplicate=False))
    want = collections.defaultdict(collections.Counter)
    owner = {}
    for name, dtype, _shape, nbytes, _file, off, _drives in _native.catalog(path, dirs=dirs, mirrors=mirrors, env=True):
        r = rename(name) if rename is not None else name
        if r is None:
            continue
        target, index = r if isinstance(r, tuple) else (r, None)
        p = named.get(target)
        if p is None or p.device.type != "cpu" or p.dtype != torch_dtype(dtype):
            continue
        pos = 0
        if index is not None:
            sub = p.data[index]
            if not sub.is_contiguous():
                continue
            pos = sub.data_ptr() - p.data_ptr()
        want[id(p)][(off - pos) % align_bytes] += nbytes
        owner[id(p)] = p
    for key, phases in want.items():
        p = owner[key]
        phase, _ = phases.most_common(1)[0]
        if p.data_ptr() % align_bytes == phase:
            out["in_phase"] += 1
            continue
        es, n = p.element_size(), p.numel() * p.element_size()
        st = p.untyped_storage()
        if p.storage_offset() != 0 or not p.is_contiguous() or st.nbytes() != n or phase % es:
            out["stayed"].append(next(k for k, v in named.items() if v is p))
            continue
        if p.dim() >= 3 and phase % TORCH_ALIGN:
            # A fused experts tensor off torch's 64-byte alignment: torch's
            # grouped_mm on CPU gives other last bits there (float32
            # Qwen3-MoE logits differed by 3e-8 on an AMD EPYC host, the
            # same weights cloned into torch's memory were bit-equal; the
            # 2-D weights' kernels were not affected). Bit-equal logits
            # are the contract: it stays, staged.
            out["stayed"].append(next(k for k, v in named.items() if v is p))
            continue
        raw = torch.empty(n + align_bytes, dtype=torch.uint8)
        skip = (phase - raw.data_ptr()) % align_bytes
        new = raw[skip : skip + n].view(p.dtype).view(p.shape)
        del raw
        _native._prepare_for_writes(new.data_ptr(), n, True, False)
        p.data = new
        out["parameters"] += 1
        out["bytes"] += n
    return out


def _prefetch_count(prefetch):
    """``from_pretrained``'s ``prefetch`` as the number of the next
    layer's router guesses prefetched per token: False or 0 none, True 1
    (measured: all of its top-k read 1.9-2.3x the bytes and ran slower
    than none; its top 1 cut the waits at batch 4 to 0.68x of none's), an
    integer that many."""
    if prefetch is True:
        return 1
    if prefetch is False or prefetch is None:
        return 0
    if isinstance(prefetch, int) and prefetch >= 0:
        return prefetch
    raise ValueError(f"weightstream.transformers.from_pretrained: prefetch {prefetch!r}: True, False or a number of guesses per token")


def _stream_experts(model, path, dtype, capacity, budget_bytes, prefetch, dirs, mirrors, route, direct):
    """Turns ``model``'s fused experts modules into ones served from an
    ExpertCache, ``prefetch`` guesses per token prefetched (see
    _ExpertStreamer): their parameters dropped before any
    page of them is touched, a ``_StreamedWeight`` in each one's place, the
    hooks set. Returns ``(streamer, rename)``: ``rename`` is load_into's
    for the rest of the model (transformers' conversions, the streamed
    experts' tensors skipped: not read)."""
    from . import ExpertCache, _native
    from ._load_into import transformers_rename

    rename = transformers_rename(model)
    mods = _expert_layout(model, rename)
    if not mods:
        raise ValueError(
            f"weightstream.transformers.from_pretrained: {type(model).__name__} has no fused experts modules "
            "(gate_up_proj and down_proj of shape [experts, ...]): expert_capacity / expert_budget_bytes apply to "
            "transformers 5's mixture-of-experts models"
        )
    names = [e[0] for e in _native.catalog(path, env=True)]
    layouts, streamed = {}, set()
    for layer, (mname, mod) in mods.items():
        layouts[layer] = {
            "sources": _sources(mname, rename, names),
            "shape": {p: tuple(mod._parameters[p].shape[1:]) for p in _STREAMED},
            "dtype": dtype,
            "experts": mod._parameters["gate_up_proj"].shape[0],
        }
        streamed |= {f"{mname}.{p}" for p in _STREAMED}
    cache = ExpertCache(path, capacity, budget_bytes=budget_bytes, dirs=dirs, mirrors=mirrors, route=route, direct=direct)
    order = sorted(mods)
    routers = {}
    for a, b in zip(order, order[1:]):
        block = model.get_submodule(mods[b][0].rsplit(".", 1)[0])
        router = getattr(block, "gate", None)
        if router is not None:
            routers[a] = (b, router)
    streamer = _ExpertStreamer(cache, layouts, routers, prefetch)
    for layer, (mname, mod) in mods.items():
        for p in _STREAMED:
            t = mod._parameters.pop(p)
            setattr(mod, p, _StreamedWeight(streamer, layer, p, t.shape, dtype))
            del t

        def pre(_m, args, layer=layer):
            streamer.before(layer, args[0], args[1])

        def post(_m, _args, _out, layer=layer):
            streamer.after(layer)

        mod.register_forward_pre_hook(pre)
        mod.register_forward_hook(post)

    def load_rename(ck):
        r = rename(ck)
        n = r[0] if isinstance(r, tuple) else r
        return None if n in streamed else r

    return streamer, load_rename


# Where an experts module's fused parameters take an expert's projections
# from, by the checkpoint's projection names (transformers' own
# conversions say which row range each lands in: see _expert_layout).
_STREAMED = ("gate_up_proj", "down_proj")


class _StreamedWeight:
    """Stands where an experts module's fused parameter (``gate_up_proj``
    ``[E, 2I, H]`` or ``down_proj`` ``[E, H, I]``) was: ``self[e]`` is
    expert ``e``'s ``[2I, H]`` or ``[H, I]`` weight, from the layer's
    entries in the ExpertCache, laid out as the parameter's row ``e`` was
    (gate and up rows where transformers' conversions put them). So the
    module's own forward (transformers' eager experts: ``linear(x,
    self.gate_up_proj[e])``) runs unchanged on the same values, in the
    same layout: the same result to the last bit."""

    def __init__(self, streamer, layer, name, shape, dtype):
        self._streamer, self._layer, self._name = streamer, layer, name
        self.shape, self.dtype = tuple(shape), dtype

    def __getitem__(self, e):
        return self._streamer.weight(self._layer, int(e), self._name)

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"<weightstream streamed {self._name} of layer {self._layer}: {list(self.shape)} {self.dtype}>"


# How the ExpertCache's "every entry in use" error starts (the crate's
# CacheError::Full, a RuntimeError in Python): the one error a step
# retries, once, after the reads in flight land.
_CACHE_FULL = "expert cache full"

# Per-forward steps an _ExpertStreamer keeps (the latest).
STEPS_KEPT = 4096


class _ExpertStreamer:
    """The routed experts of a model served from an ``ExpertCache``: each
    MoE layer's experts module gets its hit experts (``get_many``: every
    miss read at once) before its forward and lets them go after; with
    ``prefetch``, while a layer computes, the next layer's router is
    applied to the current hidden state and its top-k experts are
    prefetched (never waited for; the cache never evicts an expert a
    layer holds). ``steps``: per forward of the model, the cache's
    counters' change (hits, misses, prefetch used and wasted, seconds
    waited, bytes read)."""

    def __init__(self, cache, layouts, routers, prefetch):
        self.cache = cache
        self.layouts = layouts  # layer -> {param name: [(projection, rows slice or None)], "shape": {...}}
        self.routers = routers  # layer -> the next MoE layer's (index, router module) or None
        self.prefetch = prefetch
        self.held = {}  # layer -> {expert: {projection: tensor}}
        self.scratch = {}
        # Expert weights copied out of the cache to torch's alignment.
        self.realigned = {"copies": 0, "bytes": 0}
        # The last STEPS_KEPT forwards (a long generation must not grow it
        # without bound); the cache's own counters hold the totals.
        self.steps = collections.deque(maxlen=STEPS_KEPT)
        self._step0 = None
        self.prefetch_calls = 0

    # The experts module's hooks.
    def before(self, layer, hidden, top_k_index):
        experts = sorted({int(e) for e in top_k_index.reshape(-1).tolist() if 0 <= int(e) < self.layouts[layer]["experts"]})
        if len(experts) <= self.cache.capacity:
            got = self._get(lambda: self.cache.get_many(layer, experts))
            self.held[layer] = dict(zip(experts, got))
        else:
            # More experts than the cache holds at once (a large batch):
            # one at a time, as the module's loop takes them.
            self.held[layer] = {}
        nxt = self.routers.get(layer)
        if self.prefetch and nxt is not None:
            import torch

            lnext, router = nxt
            with torch.no_grad():
                out = router(hidden)
            idx = out[-1] if isinstance(out, tuple) else out
            if idx.dim() == 2:
                # The router's best guesses per token (its top-k comes
                # sorted by score): each guess that misses costs a read
                # and an entry that would have hit.
                idx = idx[:, : self.prefetch]
            want = sorted({int(e) for e in idx.reshape(-1).tolist()})
            self.cache.prefetch([(lnext, e) for e in want])
            self.prefetch_calls += 1

    def _get(self, fetch):
        """``fetch()``; when every entry is taken by reads in flight (the
        next layer's prefetches), once more after they land: a prefetch
        never makes a step fail."""
        try:
            return fetch()
        except RuntimeError as e:
            if _CACHE_FULL not in str(e):
                raise
        self.cache.wait_idle()
        return fetch()

    def after(self, layer):
        self.held.pop(layer, None)

    def weight(self, layer, e, name):
        import torch

        held = self.held.setdefault(layer, {})
        parts = held.get(e)
        if parts is None:
            held.clear()  # one at a time: the loop is done with the others
            parts = held[e] = self._get(lambda: self.cache.get(layer, e))
        lay = self.layouts[layer]
        shape, dtype = lay["shape"][name], lay["dtype"]
        srcs = lay["sources"][name]
        if len(srcs) == 1 and srcs[0][1] is None:
            t = parts[srcs[0][0]]
            if t.dim() == len(shape) + 1 and t.shape[0] == 1:
                t = t[0]  # the expert's rows of a fused checkpoint tensor
            if tuple(t.shape) != shape:
                raise ValueError(f"weightstream.transformers: layer {layer} expert {e}: {srcs[0][0]} is {list(t.shape)}, the model's {name} row takes {list(shape)}")
            if t.dtype != dtype:
                return t.to(dtype)
            if t.data_ptr() % TORCH_ALIGN == 0:
                return t
            # In the cache in phase with its file, off torch's 64-byte
            # alignment: torch's matmul on CPU can give other last bits
            # there (float32 Qwen3-MoE logits on an AMD EPYC host), and the
            # logits are to equal the whole model's. Copied into a buffer
            # of torch's, reused; counted.
            key = (name, shape, dtype, "aligned")
            buf = self.scratch.get(key)
            if buf is None:
                buf = self.scratch[key] = torch.empty(shape, dtype=dtype)
            buf.copy_(t)
            self.realigned["copies"] += 1
            self.realigned["bytes"] += buf.numel() * buf.element_size()
            return buf
        # Built from its projections in the parameter's layout, in a
        # buffer reused for each expert (the module's loop consumes it
        # before it asks for the next).
        key = (name, shape, dtype)
        buf = self.scratch.get(key)
        if buf is None:
            buf = self.scratch[key] = torch.empty(shape, dtype=dtype)
        for proj, rows in srcs:
            t = parts[proj]
            dst = buf[rows]
            if tuple(t.shape) != tuple(dst.shape):
                raise ValueError(f"weightstream.transformers: layer {layer} expert {e}: {proj} is {list(t.shape)}, the model's {name} rows {rows.start}-{rows.stop} take {list(dst.shape)}")
            dst.copy_(t)
        return buf

    # The model's hooks: one step per forward.
    def step_begin(self):
        self._step0 = self.cache.stats()

    def step_end(self):
        if self._step0 is None:
            return
        now = self.cache.stats()
        keys = ("hits", "misses", "prefetched", "prefetch_used", "prefetch_wasted", "wait_seconds", "bytes_read", "evictions")
        self.steps.append({k: now[k] - self._step0[k] for k in keys if k in now})
        self._step0 = None


def _expert_layout(model, rename):
    """Each MoE layer's experts module (a module with 3-D ``gate_up_proj``
    and ``down_proj`` parameters, transformers 5's fused experts):
    ``{layer: (module name, module, {param: [(checkpoint projection, rows
    or None)]})}``, the rows from transformers' own conversions
    (``rename``): expert 0's checkpoint projections and where each lands."""
    import re

    out = {}
    for mname, mod in model.named_modules():
        params = getattr(mod, "_parameters", {})
        if not all(isinstance(params.get(p), __import__("torch").Tensor) and params[p].dim() == 3 for p in _STREAMED):
            continue
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", mname + ".")
        if m is None:
            raise ValueError(f"weightstream.transformers: experts module {mname} is not under a numbered layer (layers.N)")
        out[int(m.group(1))] = (mname, mod)
    return out


def _sources(mname, rename, checkpoint_names):
    """``{param: [(projection, rows or None)]}`` for experts module
    ``mname``: its expert 0's checkpoint tensors (``...experts.0.<proj>.
    weight``, or the fused ``...experts.<param>``) and where ``rename``
    (transformers' conversions) puts each."""
    import re

    out = {p: [] for p in _STREAMED}
    for ck in checkpoint_names:
        r = rename(ck) if rename is not None else ck
        name, index = (r if isinstance(r, tuple) else (r, None))
        if name is None or not name.startswith(mname + "."):
            continue
        param = name[len(mname) + 1 :]
        if param not in out:
            continue
        m = re.search(r"\.experts\.(\d+)\.([^.]+)\.weight$", ck)
        if m is not None:
            if int(m.group(1)) != 0:
                continue
            rows = index[1] if index is not None and len(index) > 1 else None
            out[param].append((m.group(2), rows))
        elif ck.endswith(".experts." + param):
            out[param] = [(param, None)]
    for p, srcs in out.items():
        if not srcs:
            raise ValueError(f"weightstream.transformers: no checkpoint tensor fills {mname}.{p} (expert 0)")
        srcs.sort(key=lambda s: -1 if s[1] is None else s[1].start)
        if len(srcs) == 1 and srcs[0][1] is not None:
            raise ValueError(f"weightstream.transformers: {mname}.{p} is filled by part of its rows only ({srcs[0][0]})")
    return out
