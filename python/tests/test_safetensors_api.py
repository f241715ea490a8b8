"""The drop-in's surface against safetensors 0.8's, call for call: every
dtype it reads (FP4 and E8M0 included), its whole slice grammar (results
and error messages), any file name, the backend and device arguments,
get_tensors and offset_keys, closed readers."""

import json
import re
import struct
import tempfile

import numpy as np
import pytest
from conftest import torch_or_skip

import weightstream
import weightstream.numpy
from weightstream import safe_open


def write_raw(path, tensors, metadata=None):
    """A safetensors file of raw tensors {name: (dtype, shape, bytes)}."""
    header, data = {}, b""
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def raw_bytes(t):
    torch = torch_or_skip()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


@pytest.fixture(scope="module")
def fp4_model(tmp_path_factory):
    """An FP4 + FP8-E8M0 checkpoint (MXFP4's blocks and scales) written by
    safetensors' own torch writer."""
    torch = torch_or_skip()
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("torch before 2.8 has no float4_e2m1fn_x2")
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (64, 32), dtype=torch.uint8, generator=g)
    t = {
        "w.blocks": blocks.view(torch.float4_e2m1fn_x2),
        "w.scales": torch.randint(0, 256, (64, 2), dtype=torch.uint8, generator=g).view(torch.float8_e8m0fnu),
        "w.empty": torch.empty((3, 0), dtype=torch.float4_e2m1fn_x2),
        "bias": torch.randn(64, generator=g),
    }
    d = tmp_path_factory.mktemp("fp4")
    save_file(t, str(d / "model.safetensors"))
    return d / "model.safetensors", t


def test_fp4_and_e8m0_load_as_safetensors_gives_them(fp4_model):
    """The same torch dtypes, shapes and bytes as safetensors, through
    safe_open, load_file and weightstream.load."""
    from safetensors import safe_open as st_open
    from safetensors.torch import load_file as st_load_file

    import weightstream.torch as wt

    path, _ = fp4_model
    theirs = st_load_file(str(path))
    with st_open(str(path), framework="pt") as g:
        assert sorted(g.keys()) == sorted(theirs)
    with safe_open(path, framework="pt") as f:
        via_open = {k: f.get_tensor(k) for k in f.keys()}
        all_at_once = f.get_tensors()
    for ours in (via_open, all_at_once, wt.load_file(path), weightstream.load(path)):
        assert sorted(ours) == sorted(theirs)
        for k, t in theirs.items():
            assert ours[k].dtype == t.dtype and ours[k].shape == t.shape, (k, ours[k].dtype, ours[k].shape, t.dtype, t.shape)
            assert raw_bytes(ours[k]) == raw_bytes(t), k
    # FP4 slices: whole bytes only (rows, or even column bounds), as
    # safetensors' grammar allows; a cut through a byte is its error.
    with safe_open(path, framework="pt") as f:
        s = f.get_slice("w.blocks")
        assert s.get_shape() == [64, 64] and s.get_dtype() == "F4"
        rows = s[8:16]
        assert rows.dtype == theirs["w.blocks"].dtype and rows.shape == (8, 32)
        assert raw_bytes(rows) == raw_bytes(theirs["w.blocks"][8:16])
        # torch indexes its own tensor, two elements a byte (as safetensors
        # gives it to torch): columns 10:20 of [64, 32] are bytes 10 to 20.
        cols = s[:, 10:20]
        assert cols.shape == (64, 10) and raw_bytes(cols) == raw_bytes(theirs["w.blocks"][:, 10:20])
        # (safetensors' own get_slice fails on F4: it reshapes the bytes
        # to the header's shape; the whole tensor indexed by torch is the
        # answer it means.)
        whole = theirs["w.blocks"].view(torch_or_skip().uint8)
        for index in (np.s_[3], np.s_[::3, 1:31:4], np.s_[..., -1]):
            assert raw_bytes(s[index]) == raw_bytes(whole[index].contiguous()), index


def test_a_dtype_torch_lacks_is_a_clear_error(tmp_path):
    """F6 has no torch type: TypeError naming the dtype and this torch."""
    torch = torch_or_skip()
    p = tmp_path / "f6.safetensors"
    write_raw(p, {"a": ("F6_E2M3", [4], bytes(3)), "b": ("F32", [1], bytes(4))})
    with safe_open(p, framework="pt") as f:
        with pytest.raises(TypeError, match=re.escape(f"dtype F6_E2M3 has no torch type in this torch ({torch.__version__})")):
            f.get_tensor("a")
        assert f.get_tensor("b").tolist() == [0.0]


def test_numpy_gets_what_safetensors_numpy_reader_gives(tmp_path):
    """Complex64 is an array; types numpy lacks (bf16, fp8) are errors, as
    in safetensors' numpy reader (ours a TypeError naming the dtype)."""
    torch = torch_or_skip()
    from safetensors.torch import save_file

    p = tmp_path / "mixed.safetensors"
    save_file({"c": torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64), "h": torch.ones(3, dtype=torch.bfloat16)}, str(p))
    from safetensors import safe_open as st_open

    with safe_open(p, framework="np") as f, st_open(str(p), framework="np") as g:
        c, want = f.get_tensor("c"), g.get_tensor("c")
        assert c.dtype == want.dtype == np.complex64 and np.array_equal(c, want)
        with pytest.raises(TypeError, match="BF16"):
            f.get_tensor("h")


# The slice grammars (numpy: safetensors' own; torch: torch's indexing of
# the tensor safetensors maps): (shape, index). Results compared with
# safetensors' (shape, dtype, bytes); refusals by class and message.
GRAMMAR = [
    ((10, 5), ()),
    ((10, 5), []),
    ((10, 5), np.s_[:]),
    ((10, 5), np.s_[...]),
    ((10, 5), np.s_[3]),
    ((10, 5), np.s_[-1]),
    ((10, 5), np.s_[-10]),
    ((10, 5), np.s_[2:7]),
    ((10, 5), np.s_[2:7:2]),
    ((10, 5), np.s_[::3]),
    ((10, 5), np.s_[:, 1]),
    ((10, 5), np.s_[:, -5]),
    ((10, 5), np.s_[1, 2]),
    ((10, 5), np.s_[..., 2]),
    ((10, 5), np.s_[1, ...]),
    ((10, 5), np.s_[1, ..., 2]),
    ((10, 5), np.s_[..., 1:4:2]),
    ((10, 5), np.s_[0:0]),
    ((10, 5), np.s_[3:3, 1:2]),
    ((10, 5), np.s_[True]),
    ((10, 5), np.s_[np.int64(4), np.int32(1)]),
    ((4, 3, 6), np.s_[1:3, :, 2:5]),
    ((4, 3, 6), np.s_[:, 1]),
    ((4, 3, 6), np.s_[::2, ::2, ::2]),
    ((4, 3, 6), np.s_[..., ::5]),
    ((4, 3, 6), np.s_[3, 2, 5]),
    ((), ()),
    ((), np.s_[...]),
    ((0, 5), ()),
    # Refused by safetensors, with these messages.
    ((10, 5), np.s_[10]),
    ((10, 5), np.s_[-11]),
    ((10, 5), np.s_[:11]),
    ((10, 5), np.s_[:, 5]),
    ((10, 5), np.s_[10:10]),
    ((10, 5), np.s_[1, 2, 3]),
    ((10, 5), np.s_[..., ...]),
    ((10, 5), np.s_[::0]),
    ((10, 5), np.s_[::-1]),
    ((10, 5), np.s_[[0]]),
    ((10, 5), np.s_[:, []]),
    ((10, 5), np.s_[None]),
    ((10, 5), np.s_[1.0]),
    ((10, 5), np.s_["x"]),
    ((), np.s_[0]),
    ((0, 5), np.s_[:]),
    ((0, 5), np.s_[...]),
]


@pytest.fixture(scope="module")
def grammar_file(tmp_path_factory):
    from safetensors.numpy import save_file

    shapes = sorted({s for s, _ in GRAMMAR})
    rng = np.random.default_rng(35)
    arrays = {f"t{i}": rng.integers(0, 1 << 30, size=s, dtype=np.int32) for i, s in enumerate(shapes)}
    path = tmp_path_factory.mktemp("grammar") / "g.safetensors"
    save_file(arrays, str(path))
    return path, {a.shape: n for n, a in arrays.items()}


EXTRA_TORCH = [
    ((10, 5), np.s_[:, None, 1]),
    ((10, 5), np.s_[[0, 3, 3]]),
    ((10, 5), np.s_[-3:, :-1]),
    ((10, 5), np.s_[:100]),
    ((10, 5), np.s_[7:2]),
    ((4, 3, 6), np.s_[[True, False, True, True]]),
]


def _outcome(call):
    try:
        return call(), None
    except Exception as e:  # noqa: BLE001 - compared by class and message
        return None, e


@pytest.mark.parametrize("framework", ["np", "pt"])
@pytest.mark.parametrize("shape,index", GRAMMAR + EXTRA_TORCH, ids=[f"{s}{i!r}" for s, i in GRAMMAR + EXTRA_TORCH])
def test_every_index_form_as_safetensors(grammar_file, framework, shape, index):
    if framework == "pt":
        torch_or_skip()
    elif any(shape == s and index is i for s, i in EXTRA_TORCH):
        pytest.skip("torch's grammar only")
    from safetensors import safe_open as st_open

    path, names = grammar_file
    name = names[shape]
    with st_open(str(path), framework=framework) as g:
        want, err = _outcome(lambda: g.get_slice(name)[index])
    with safe_open(path, framework=framework) as f:
        got, ours = _outcome(lambda: f.get_slice(name)[index])
    if err is not None:
        assert ours is not None, f"safetensors raised {err!r}; the drop-in returned {got!r}"
        assert type(ours) is type(err) and str(ours) == str(err)
        return
    assert ours is None, ours
    assert tuple(got.shape) == tuple(want.shape) and got.dtype == want.dtype, (got.shape, want.shape)
    if framework == "np":
        assert isinstance(got, np.ndarray) and got.flags.c_contiguous and np.array_equal(got, want)
    else:
        assert got.is_contiguous() and raw_bytes(got) == raw_bytes(want.contiguous())


def test_where_safetensors_fails_by_accident_the_answer_is_pythons(grammar_file):
    """A negative slice bound (safetensors: OverflowError) counts from the
    end; a start past its stop (safetensors: SystemError) is empty."""
    path, names = grammar_file
    name = names[(10, 5)]
    from safetensors.numpy import load_file

    a = load_file(str(path))[name]
    with safe_open(path, framework="np") as f:
        s = f.get_slice(name)
        for index in (np.s_[-3:], np.s_[:, -4:-1], np.s_[-9:-2:3], np.s_[5:3], np.s_[2:, 4:1]):
            got = s[index]
            assert got.shape == a[index].shape and np.array_equal(got, a[index]), index


def test_a_file_named_anything_opens_by_what_it_is():
    """safetensors' test_deserialization_metadata: a NamedTemporaryFile
    (no .safetensors suffix) in a folder holding no shard."""
    serialized = (
        b'f\x00\x00\x00\x00\x00\x00\x00{"__metadata__":{"framework":"pt"},"test1":{"dtype":"I32","shape":[2,2],"data_offsets":[0,16]}}'
        b"       " + bytes(range(16))
    )
    with tempfile.NamedTemporaryFile() as f:
        f.write(serialized)
        f.flush()
        with safe_open(f.name, framework="np") as g:
            assert g.metadata() == {"framework": "pt"}
            assert g.get_tensor("test1").tobytes() == bytes(range(16))
        assert weightstream.numpy.load_file(f.name)["test1"].shape == (2, 2)


def test_backends_are_accepted_and_others_refused_as_safetensors(np_model):
    import weightstream.numpy as wnp
    from safetensors import safe_open as st_open

    path, want = np_model
    for backend in ("mmap", "pread"):
        with safe_open(path, framework="np", backend=backend) as f:
            assert np.array_equal(f.get_tensor("big"), want["big"])
        assert np.array_equal(wnp.load_file(path, backend=backend)["big"], want["big"])
    for bad in ("not_a_backend", "MMAP", ""):
        with pytest.raises(weightstream.SafetensorError) as ours:
            safe_open(path, framework="np", backend=bad)
        with pytest.raises(weightstream.SafetensorError) as theirs:
            st_open(path, framework="np", backend=bad)
        assert str(ours.value) == str(theirs.value)
        with pytest.raises(weightstream.SafetensorError):
            wnp.load_file(path, backend=bad)


def test_torch_backends_devices_and_get_tensors(np_model):
    torch = torch_or_skip()
    import weightstream.torch as wt
    from safetensors import safe_open as st_open

    path, want = np_model
    for backend in ("mmap", "pread"):
        sd = wt.load_file(path, backend=backend)
        assert torch.equal(sd["big"], torch.from_numpy(want["big"]))
    with pytest.raises(weightstream.SafetensorError, match="is invalid"):
        wt.load_file(path, backend="x")
    for dev in ("cpu", torch.device("cpu")):
        with safe_open(path, framework="pt", device=dev) as f:
            assert f.get_tensor("big").device.type == "cpu"
    for dev in ("gpu", "cuda:0:1", -1, "cpu:0"):
        with pytest.raises(weightstream.SafetensorError) as ours:
            safe_open(path, framework="pt", device=dev)
        with pytest.raises(weightstream.SafetensorError) as theirs:
            st_open(path, framework="pt", device=dev)
        assert str(ours.value) == str(theirs.value), dev
    with safe_open(path, framework="pt") as f, st_open(path, framework="pt") as g:
        ours, theirs = f.get_tensors(), g.get_tensors()
        assert list(ours) == sorted(theirs) and f.offset_keys() == g.offset_keys()
        for k in theirs:
            assert raw_bytes(ours[k]) == raw_bytes(theirs[k]) and ours[k].shape == theirs[k].shape, k


def test_a_tensor_asked_for_a_gpu_ends_there(np_model):
    torch = torch_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device here")
    import weightstream.torch as wt

    path, want = np_model
    with safe_open(path, framework="pt", device="cuda:0") as f:
        t = f.get_tensor("big")
        s = f.get_slice("big")[2:5, 1:3]
    assert t.device == torch.device("cuda:0") and s.device == torch.device("cuda:0")
    assert torch.equal(t.cpu(), torch.from_numpy(want["big"]))
    assert torch.equal(s.cpu(), torch.from_numpy(want["big"][2:5, 1:3]))
    sd = wt.load_file(path, device=0)
    assert sd["big"].device.type == "cuda"


def test_a_closed_reader_refuses_every_call_with_safetensors_class(np_model):
    import safetensors

    path, _ = np_model
    assert weightstream.SafetensorError is safetensors.SafetensorError
    with safe_open(path, framework="np") as f:
        s = f.get_slice("big")
    for call in (f.keys, f.offset_keys, f.metadata, f.get_tensors, lambda: f.get_tensor("big"), lambda: f.get_slice("big"), lambda: s[0:1]):
        with pytest.raises(safetensors.SafetensorError, match="^File is closed"):
            call()
