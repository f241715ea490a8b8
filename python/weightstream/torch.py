"""``safetensors.torch``'s reader: ``load_file``."""

from . import load as _load


def load_file(filename, device="cpu"):
    """``safetensors.torch.load_file``: ``{name: torch.Tensor}`` of one file,
    read O_DIRECT into memory the tensors keep alive. Only ``device="cpu"``."""
    if str(device) != "cpu":
        raise ValueError(f"device {device!r}: weightstream reads into CPU memory (device='cpu')")
    return _load(filename, framework="pt")
