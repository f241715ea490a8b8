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

    def __init__(self, report, build_seconds, load_seconds, ignored):
        self.report = report
        self.build_seconds = build_seconds
        self.load_seconds = load_seconds
        self.ignored = ignored

    def stats(self):
        """The load's figures as one dict."""
        return {"build_seconds": self.build_seconds, "load_seconds": self.load_seconds, "ignored": list(self.ignored), **self.report}

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

    ``expert_capacity`` / ``expert_budget_bytes`` (routed experts streamed
    from the drives through an ``ExpertCache``) are not built yet: either
    raises NotImplementedError."""
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

    if expert_capacity is not None or expert_budget_bytes is not None:
        raise NotImplementedError(
            "weightstream.transformers.from_pretrained: expert_capacity / expert_budget_bytes (experts streamed "
            "through an ExpertCache) are not built yet; load the whole model (neither argument)"
        )
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
    t0 = time.perf_counter()
    with no_init_weights():
        if hasattr(model_class, "_model_mapping"):  # an Auto class
            model = model_class.from_config(config, **build)
        else:
            model = model_class._from_config(config, **build)
    if getattr(config, "tie_word_embeddings", False) or getattr(model, "_tied_weights_keys", None):
        model.tie_weights()
    t1 = time.perf_counter()
    got = load_into(model, path, strict=False, cast=True, dirs=dirs, mirrors=mirrors, route=route, direct=direct, staging_bytes=staging_bytes)
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
    model.eval()
    try:
        if model.can_generate() and os.path.isfile(os.path.join(path, "generation_config.json")):
            model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - a model without generation: nothing to set
        import warnings

        warnings.warn(f"weightstream.transformers.from_pretrained: {path}: generation_config.json not applied: {e}", stacklevel=2)
    model.weightstream = Loaded(dict(got.report), t1 - t0, t2 - t1, ignored)
    return model
