"""``safetensors.numpy``'s reader: ``load_file``."""

from . import _backend
from . import load as _load


def load_file(filename, *, backend="mmap"):
    """``safetensors.numpy.load_file``: ``{name: numpy.ndarray}`` of one file.
    ``backend`` ("mmap" or "pread") is accepted and changes nothing; another
    value is refused as safetensors refuses it."""
    _backend(backend)
    return _load(filename, framework="np")
