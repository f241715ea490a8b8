"""Payloads (DLPack, one-dimensional uint8, owned) viewed as tensors and
arrays of a safetensors dtype and shape, without a copy.

The viewed tensor or array keeps the payload's memory alive through the
DLPack capsule it was made from (its deleter releases the memory when the
last view dies); the engine never reuses that memory meanwhile.
"""

# safetensors dtype -> numpy dtype name (None: numpy has no such type).
NUMPY = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
}

# Bits of an element of each safetensors dtype (sub-byte ones included).
BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "U16": 16, "I16": 16, "F16": 16, "BF16": 16,
    "U32": 32, "I32": 32, "F32": 32,
    "U64": 64, "I64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

# The first torch release with each dtype weightstream maps (said when the
# installed torch lacks it).
TORCH_SINCE = {"float8_e8m0fnu": "2.7", "float4_e2m1fn_x2": "2.8", "uint16": "2.3", "uint32": "2.3", "uint64": "2.3"}


def dtype_bits(dtype):
    """Bits of one element of `dtype` (a safetensors name)."""
    try:
        return BITS[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype}: not a safetensors dtype") from None


# safetensors dtype -> torch dtype attribute name.
TORCH = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "U16": "uint16",
    "I16": "int16",
    "U32": "uint32",
    "I32": "int32",
    "U64": "uint64",
    "I64": "int64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "C64": "complex64",
    # Two 4-bit elements per byte: a header's [..., n] is torch's [..., n / 2].
    "F4": "float4_e2m1fn_x2",
}


def torch_dtype(dtype):
    import torch

    name = TORCH.get(dtype)
    t = getattr(torch, name, None) if name else None
    if t is None:
        since = f"; torch {TORCH_SINCE[name]} and later have it as torch.{name}" if name in TORCH_SINCE else ""
        raise TypeError(f"dtype {dtype} has no torch type in this torch ({torch.__version__}){since}")
    return t


def index_torch(t, rest):
    """`t[rest]` made contiguous, for any dtype: the indexing and the copy
    run on an integer view of the same element size, so dtypes whose
    kernels torch lacks (float8, float4) index as any other."""
    if isinstance(rest, tuple) and not rest:
        return t
    import torch

    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])[rest].contiguous().view(t.dtype)


def torch_shape(dtype, shape, name=None):
    """The torch shape of a tensor of ``dtype`` whose header says ``shape``:
    the same, but for F4, whose torch type packs two elements per byte (the
    last dimension halves, as safetensors' writer doubles it)."""
    shape = list(shape)
    if dtype == "F4":
        if not shape or shape[-1] % 2:
            what = f"tensor {name}" if name else "a tensor"
            raise TypeError(
                f"{what}: F4 of shape {shape}: torch's float4_e2m1fn_x2 packs two elements per byte, so the last "
                "dimension must be even"
            )
        shape[-1] //= 2
    return shape


def numpy_dtype(dtype):
    import numpy as np

    name = NUMPY.get(dtype)
    if name is None:
        raise TypeError(f"dtype {dtype} has no numpy type (use framework='pt')")
    return np.dtype(name)


def to_torch(payload, dtype, shape):
    import torch

    t_dtype = torch_dtype(dtype)
    shape = torch_shape(dtype, shape)
    if payload.nbytes == 0:
        return torch.empty(shape, dtype=t_dtype)
    raw = torch.from_dlpack(payload)
    size = torch.empty((), dtype=t_dtype).element_size()
    if raw.data_ptr() % size:
        # A file whose offsets are not aligned for this dtype: torch's
        # kernels want aligned elements, so this one tensor is copied.
        raw = raw.clone()
    return raw.view(t_dtype).reshape(shape)


def to_numpy(payload, dtype, shape):
    import numpy as np

    n_dtype = numpy_dtype(dtype)
    if payload.nbytes == 0:
        return np.empty(shape, dtype=n_dtype)
    return np.from_dlpack(payload).view(n_dtype).reshape(shape)


def require(module, framework):
    """Imports ``module`` ("torch" or "numpy") for ``framework``, or
    raises ModuleNotFoundError saying how to get it or what to pass
    instead: called before anything is read."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        if module == "torch":
            msg = (
                f"framework={framework!r} (the default) returns torch tensors, and torch is not installed: "
                "pip install 'weightstream[torch]' (or torch itself), or pass framework=\"np\" for numpy arrays"
            )
        else:
            msg = f"framework={framework!r} returns numpy arrays, and numpy is not installed: pip install numpy"
        raise ModuleNotFoundError(msg, name=module) from None


def convert(framework):
    """The converter of a payload into ``framework``'s tensor; its module
    imported first (a missing one said, with the way out)."""
    if framework in ("pt", "torch", "pytorch"):
        require("torch", framework)
        return to_torch
    if framework in ("np", "numpy"):
        require("numpy", framework)
        return to_numpy
    raise ValueError(f"framework {framework!r}: weightstream reads into 'pt' (torch) or 'np' (numpy)")
