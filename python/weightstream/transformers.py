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
