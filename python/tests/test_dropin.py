"""weightstream's readers against safetensors' own, call for call."""

import os
import textwrap

import numpy as np
import pytest
from conftest import run_python, torch_or_skip

import weightstream
from weightstream import safe_open
from weightstream.numpy import load_file as np_load_file


def test_numpy_load_file_equals_safetensors(np_model):
    from safetensors.numpy import load_file

    path, _ = np_model
    ours, ref = np_load_file(path), load_file(path)
    assert sorted(ours) == sorted(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype, k
        assert ours[k].shape == ref[k].shape, k
        assert ours[k].tobytes() == ref[k].tobytes(), k
        assert ours[k].flags.writeable, k


def test_safe_open_numpy_keys_metadata_tensors(np_model):
    from safetensors import safe_open as st_open

    path, _ = np_model
    with safe_open(path, framework="np") as f, st_open(path, framework="np") as g:
        assert f.keys() == sorted(g.keys())
        assert f.metadata() == g.metadata() == {"format": "np", "who": "test"}
        for k in g.keys():
            a, b = f.get_tensor(k), g.get_tensor(k)
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), k


SLICES = [
    np.s_[:],
    np.s_[0:1],
    np.s_[3:17],
    np.s_[999:1000],
    np.s_[5],
    np.s_[:, 0:1],
    np.s_[:, 7:300],
    np.s_[10:20, 690:700],
    np.s_[0:0],
    np.s_[..., 3:4],
    np.s_[2, 5:9],
    np.s_[-1],
    np.s_[100:900, 350:700],
    np.s_[..., 0],
]

# Steps past the first dimension, negative starts, ints mixed in: checked
# against the whole array sliced by numpy (safetensors' slices take neither
# steps nor negative starts).
STEPPED = [np.s_[:, -3:], np.s_[-5:, -400:-100], np.s_[:, ::2], np.s_[3:50, 1:600:7], np.s_[7, ::3], np.s_[..., 5:6:4], np.s_[0:0, ::2]]


@pytest.mark.parametrize("sl", SLICES, ids=[str(s) for s in SLICES])
def test_get_slice_equals_safetensors(np_model, sl):
    from safetensors import safe_open as st_open

    path, _ = np_model
    with safe_open(path, framework="np") as f, st_open(path, framework="np") as g:
        a, b = f.get_slice("big"), g.get_slice("big")
        assert a.get_shape() == list(b.get_shape()) and a.get_dtype() == b.get_dtype()
        x, y = a[sl], b[sl]
        assert x.shape == y.shape and x.dtype == y.dtype and np.array_equal(x, y)
        assert x.flags.c_contiguous


@pytest.mark.parametrize("sl", STEPPED, ids=[str(s) for s in STEPPED])
def test_stepped_slices_equal_numpys(np_model, sl):
    path, arrays = np_model
    with safe_open(path, framework="np") as f:
        x = f.get_slice("big")[sl]
    y = arrays["big"][sl]
    assert x.shape == y.shape and np.array_equal(x, y)


def test_bad_indexes_are_safetensors_errors_with_its_messages(np_model):
    from safetensors import safe_open as st_open

    path, _ = np_model
    with safe_open(path, framework="np") as f, st_open(path, framework="np") as g:
        for name, bad in [
            ("big", np.s_[::-2]),
            ("big", np.s_[:, ::-1]),
            ("big", np.s_[1000]),
            ("big", np.s_[:, 700]),
            ("big", np.s_[0, 0, 0]),
            ("big", np.s_[..., ...]),
            ("big", np.s_["a"]),
            ("big", np.s_[:1001]),
            ("big", np.s_[5, :701]),
            ("big", np.s_[[1, 2]]),
            ("big", np.s_[:, None]),
            ("big", np.s_[1000:1000]),
            ("empty", np.s_[:]),
            ("scalar", np.s_[0]),
        ]:
            with pytest.raises(weightstream.SafetensorError) as ours:
                f.get_slice(name)[bad]
            with pytest.raises(weightstream.SafetensorError) as theirs:
                g.get_slice(name)[bad]
            assert str(ours.value) == str(theirs.value), (name, bad)


# What safetensors 0.8.0 returns, and so must the drop-in: an all-int index
# is a 0-d array, so is `[()]` or `[...]` of a scalar; a step in the first
# dimension keeps every n-th row.
ZERO_D_AND_ROW_STEPS = [
    ("big", np.s_[0, 0]),
    ("big", np.s_[999, 699]),
    ("big", np.s_[-1, -1]),
    ("scalar", np.s_[()]),
    ("scalar", np.s_[...]),
    ("big", np.s_[::2]),
    ("big", np.s_[1:900:7]),
    ("big", np.s_[::3, 5]),
    ("big", np.s_[10::100, 3:9:2]),
]


@pytest.mark.parametrize("name,sl", ZERO_D_AND_ROW_STEPS, ids=[f"{n}{s}" for n, s in ZERO_D_AND_ROW_STEPS])
def test_zero_d_results_and_row_steps_equal_safetensors(np_model, name, sl):
    from safetensors import safe_open as st_open

    path, arrays = np_model
    with safe_open(path, framework="np") as f, st_open(path, framework="np") as g:
        x, y = f.get_slice(name)[sl], g.get_slice(name)[sl]
    assert isinstance(x, np.ndarray) and x.shape == y.shape == arrays[name][sl].shape, (x.shape, y.shape)
    assert x.dtype == y.dtype and np.array_equal(x, y) and x.flags.c_contiguous


def test_zero_d_results_in_torch(torch_model):
    torch = torch_or_skip()
    from safetensors import safe_open as st_open

    path, _ = torch_model
    with safe_open(path, framework="pt") as f, st_open(path, framework="pt") as g:
        name = next(k for k in g.keys() if len(g.get_slice(k).get_shape()) == 2 and g.get_slice(k).get_dtype() == "F32")
        for sl in (np.s_[0, 0], np.s_[::2], np.s_[1::3, 0]):
            x, y = f.get_slice(name)[sl], g.get_slice(name)[sl]
            # Bytes, not values: random bits hold NaNs.
            assert x.shape == y.shape and x.numpy().tobytes() == y.numpy().tobytes(), (name, sl, x.shape, y.shape)


def test_a_column_slice_reads_its_columns_not_the_tensor(tmp_path):
    from safetensors.numpy import save_file

    # 2 and 4 ranks' columns of rows of 256 KiB: each rank's part of a row
    # is at least 64 KiB, and the drives move at most 1.1x the part.
    w = np.random.default_rng(5).integers(0, 2**16, size=(8, 131072), dtype=np.uint16).view(np.float16)
    path = str(tmp_path / "wide.safetensors")
    save_file({"w": w}, path)
    with safe_open(path, framework="np") as f:
        for world in (2, 4):
            n = w.shape[1] // world
            for rank in range(world):
                before = f.stats()
                x = f.get_slice("w")[:, rank * n : (rank + 1) * n]
                after = f.stats()
                assert np.array_equal(x.view(np.uint16), w[:, rank * n : (rank + 1) * n].view(np.uint16))
                wanted = after["slices"]["bytes_wanted"] - before["slices"]["bytes_wanted"]
                read = after["slices"]["bytes_read"] - before["slices"]["bytes_read"]
                assert wanted == x.nbytes and read <= 1.1 * wanted, (world, rank, read, wanted)
                assert after["bytes"] - before["bytes"] <= 1.1 * wanted


def test_a_slice_reads_only_its_rows(np_model):
    path, _ = np_model
    with safe_open(path, framework="np") as f:
        before = f.stats()["bytes"]
        f.get_slice("big")[10:20]
        read = f.stats()["bytes"] - before
        # 10 rows of 700 float32, in whole 4 KiB blocks at most two more.
        assert 10 * 700 * 4 <= read <= 10 * 700 * 4 + 2 * 4096, read


def test_errors_are_safetensors_errors(np_model, tmp_path):
    from safetensors import safe_open as st_open

    path, _ = np_model
    missing = str(tmp_path / "nope.safetensors")
    with pytest.raises(FileNotFoundError) as ours:
        safe_open(missing, framework="np")
    with pytest.raises(FileNotFoundError) as theirs:
        st_open(missing, framework="np")
    assert str(ours.value) == str(theirs.value)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(weightstream.SafetensorError, match="bad.safetensors"):
        safe_open(str(bad), framework="np")
    with safe_open(path, framework="np") as f:
        with pytest.raises(weightstream.SafetensorError, match="^File does not contain tensor nope"):
            f.get_tensor("nope")
        with pytest.raises(weightstream.SafetensorError):
            f.get_slice("nope")
    for dev, kind in [("cuda:0", "not supported for framework numpy"), ("cuda:x", None), ("foo", "is invalid"), ("mps:1", "only mps")]:
        with pytest.raises(Exception) as ours:
            safe_open(path, framework="np", device=dev)
        with pytest.raises(Exception) as theirs:
            st_open(path, framework="np", device=dev)
        assert type(ours.value) is type(theirs.value) and str(ours.value) == str(theirs.value), dev
        assert kind is None or kind in str(ours.value)
    with pytest.raises(ValueError, match="framework"):
        safe_open(path, framework="tf")


def test_tensors_outlive_their_reader(np_model):
    import gc

    path, t = np_model
    f = safe_open(path, framework="np")
    big = f.get_tensor("big")
    sl = f.get_slice("t.int32")[0:1]
    assert f.close() is True
    del f
    gc.collect()
    assert np.array_equal(big, t["big"])
    assert np.array_equal(sl, t["t.int32"][0:1])
    big += 1  # owned and writable: no one else sees or reuses these bytes
    assert np.array_equal(big, t["big"] + np.float32(1))


# Every dtype safetensors.torch writes, through torch.
TORCH_DTYPES = [
    "bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64",
    "float16", "bfloat16", "float32", "float64", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu",
]


@pytest.fixture(scope="module")
def torch_model(tmp_path_factory):
    torch = torch_or_skip()
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(3)
    t = {}
    for name in TORCH_DTYPES:
        dt = getattr(torch, name, None)
        if dt is None:
            continue
        shape = (int(torch.randint(1, 30, (1,), generator=g)), int(torch.randint(1, 200, (1,), generator=g)))
        n = shape[0] * shape[1] * torch.empty((), dtype=dt).element_size()
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        t[f"t.{name}"] = raw.view(torch.bool if dt == torch.bool else dt).reshape(shape) if dt != torch.bool else (raw[: shape[0] * shape[1]] & 1).bool().reshape(shape)
    t["empty"] = torch.zeros((0, 3), dtype=torch.bfloat16)
    written = {}
    path = str(tmp_path_factory.mktemp("pt") / "model.safetensors")
    for k, v in list(t.items()):
        try:
            save_file({k: v}, path + ".probe")
            written[k] = v
        except Exception:  # the writer's own refusal: not a dtype it supports
            pass
    save_file(written, path, metadata={"format": "pt"})
    return path, written


def test_torch_load_file_equals_safetensors_for_every_dtype(torch_model):
    torch = torch_or_skip()
    from safetensors.torch import load_file

    import weightstream.torch as wt

    path, written = torch_model
    assert len(written) >= 12, sorted(written)
    ours, ref = wt.load_file(path), load_file(path)
    assert sorted(ours) == sorted(ref)
    for k in ref:
        assert ours[k].dtype == ref[k].dtype and ours[k].shape == ref[k].shape, k
        a, b = ours[k].contiguous().view(torch.uint8), ref[k].contiguous().view(torch.uint8)
        assert torch.equal(a, b), k


def test_torch_safe_open_and_slices(torch_model):
    torch = torch_or_skip()
    from safetensors import safe_open as st_open

    path, _ = torch_model
    with safe_open(path, framework="pt") as f, st_open(path, framework="pt") as g:
        assert f.keys() == sorted(g.keys()) and f.metadata() == g.metadata()
        for k in g.keys():
            a, b = f.get_tensor(k), g.get_tensor(k)
            assert a.dtype == b.dtype and a.shape == b.shape, k
            assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b), k
            if len(b.shape) == 2 and b.shape[0] > 2 and b.shape[1] > 2:
                x, y = f.get_slice(k)[1:3, 1:2], g.get_slice(k)[1:3, 1:2]
                assert x.shape == y.shape and torch.equal(x.view(torch.uint8), y.view(torch.uint8)), k


def test_kept_tensors_never_share_memory(np_model):
    path, t = np_model
    with safe_open(path, framework="np") as f:
        first = {k: f.get_tensor(k) for k in f.keys()}
        # The file's arena is full of kept tensors now: these read into
        # memory of their own, never into the first ones'.
        second = {k: f.get_tensor(k) for k in f.keys()}
    addr = lambda a: a.__array_interface__["data"][0]  # noqa: E731
    for k in t:
        # Bytes, not values: the random bits hold NaNs.
        assert first[k].tobytes() == t[k].tobytes() and second[k].tobytes() == t[k].tobytes(), k
        if t[k].nbytes:
            assert addr(first[k]) != addr(second[k]), k
    first["big"][:] = 0
    assert np.array_equal(second["big"], t["big"])
    # A tensor dropped gives its slot back; a new read may land there, and
    # the live ones are untouched.
    del first
    again = safe_open(path, framework="np").get_tensor("big")
    assert np.array_equal(again, t["big"]) and np.array_equal(second["big"], t["big"])


def test_read_ahead_in_any_order_and_closed_with_reads_pending(np_model):
    import random

    path, t = np_model
    keys = sorted(t)
    for order in (keys, keys[::-1], random.Random(5).sample(keys, len(keys))):
        with safe_open(path, framework="np") as f:
            got = {k: f.get_tensor(k) for k in order}
        for k in keys:
            assert got[k].tobytes() == t[k].tobytes(), (order[:3], k)
    # One tensor asked for, the rest read ahead and never asked for: closing
    # drops those reads; the one kept is whole.
    f = safe_open(path, framework="np")
    first = f.get_tensor(keys[0])
    assert f.close() is True
    assert first.tobytes() == t[keys[0]].tobytes()


def test_a_tensor_by_tensor_loop_keeps_resident_only_the_live_tensors(tmp_path):
    """transformers' way of reading a checkpoint: get_tensor, copy, drop,
    over every tensor of a file. The reader's anonymous resident memory
    tracks the tensors alive plus its read-ahead window (64 MiB), not the
    file: over 384 MiB it grows by well under 160 MiB. Before: every
    tensor read stayed resident until close (the reader's arena was carved
    forward and its freed pages kept), +390 MiB here. Run in a fresh
    interpreter so nothing else moves its RSS."""
    from safetensors.numpy import save_file

    n, elems = 48, 2 << 20  # 48 tensors of 8 MiB
    save_file({f"t{i:02d}": np.full(elems, i, dtype=np.float32) for i in range(n)}, str(tmp_path / "m.safetensors"))
    code = textwrap.dedent(
        f"""
        import numpy as np, weightstream

        def anon():
            with open("/proc/self/status") as f:
                return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

        with weightstream.safe_open({str(tmp_path / "m.safetensors")!r}, framework="np") as f:
            keep = np.empty({elems}, dtype=np.float32)  # the caller's own copy, reused
            keep[:] = 0
            base = anon()
            peak = 0
            for i, k in enumerate(sorted(f.keys())):
                a = f.get_tensor(k)
                keep[:] = a
                assert keep[0] == i and keep[-1] == i, k
                del a
                peak = max(peak, anon() - base)
        print(peak)
        """
    )
    out = run_python(code)
    assert out.returncode == 0, out.stderr[-3000:]
    peak = int(out.stdout.strip().splitlines()[-1])
    assert peak < 160 << 20, f"anonymous RSS grew by {peak / 2**20:.0f} MiB over a 384 MiB file"
