"""``safetensors.numpy``'s reader: ``load_file``."""

from . import load as _load


def load_file(filename):
    """``safetensors.numpy.load_file``: ``{name: numpy.ndarray}`` of one file."""
    return _load(filename, framework="np")
