"""Loads shared across the ranks of a gloo group (load_distributed): each
rank its own process; every rank's tensors equal the reference reader's;
each rank reads about 1/N of the bytes; a failed read raises on every rank,
naming the rank and the file; a dead rank makes the others raise."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import require, write_layered_model

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_child.py")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Three shards and their index (safetensors.torch): bf16 q [256, 96],
    f32 k [64, 96], a norm, an empty tensor, a scalar; 6 layers."""
    torch = require("torch")
    from safetensors.torch import save_file

    d = tmp_path_factory.mktemp("dist")
    g = torch.Generator().manual_seed(11)
    dtypes = {"q": torch.bfloat16, "k": torch.float32, "norm": torch.float16}
    extra = [(0, "extra.empty", torch.zeros((0, 4))), (1, "extra.scalar", torch.tensor(3.5, dtype=torch.float64))]
    everything = write_layered_model(d, lambda p, shape: torch.randn(shape, generator=g).to(dtypes[p]), save_file, extra)
    return d, everything


def digest(t):
    torch = require("torch")
    return [str(t.dtype), list(t.shape), hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()]


def run(model_dir, world, mode, tmp_path):
    init = tmp_path / f"init-{mode}-{world}"
    procs, outs = [], []
    for r in range(world):
        out = tmp_path / f"out-{mode}-{world}-{r}.json"
        outs.append(out)
        procs.append(subprocess.Popen([sys.executable, CHILD, str(model_dir), str(init), str(r), str(world), str(out), mode]))
    for p in procs:
        p.wait(timeout=300)
    return [json.loads(o.read_text()) if o.exists() else None for o in outs]


@pytest.mark.parametrize("world", [2, 4])
def test_every_rank_gets_every_tensor_reading_1_over_n(model, tmp_path, world):
    d, want = model
    results = run(d, world, "all", tmp_path)
    expect = {n: digest(t) for n, t in want.items()}
    total = sum(t.numel() * t.element_size() for t in want.values())
    largest = max(t.numel() * t.element_size() for t in want.values())
    read = 0
    for r, res in enumerate(results):
        assert res and "error" not in res, (r, res)
        assert res["tensors"] == expect, r
        rep = res["report"]
        assert rep["bytes_read"] <= total / world + largest, (r, rep)
        read += rep["bytes_read"]
    assert read == total, "every byte read once, by one rank"


def test_tensor_parallel_slices_go_only_to_the_ranks_that_need_them(model, tmp_path):
    d, want = model
    results = run(d, 4, "tp2", tmp_path)
    for r, res in enumerate(results):
        assert res and "error" not in res, (r, res)
        tp = r % 2
        expect = {}
        for n, t in want.items():
            if n.endswith("q.weight"):
                t = t[t.shape[0] * tp // 2 : t.shape[0] * (tp + 1) // 2]
            elif n.endswith("k.weight"):
                t = t[:, t.shape[1] * tp // 2 : t.shape[1] * (tp + 1) // 2]
            expect[n] = digest(t)
        assert res["tensors"] == expect, r
    # A slice read by one of its two ranks and sent only to the other: the
    # bytes the TP ranks read add up to the model's whole tensors once and
    # each slice once.
    sliced = sum(t.numel() * t.element_size() for n, t in want.items() if n.endswith(("q.weight", "k.weight")))
    whole = sum(t.numel() * t.element_size() for n, t in want.items() if not n.endswith(("q.weight", "k.weight")))
    assert sum(res["report"]["bytes_read"] for res in results) == whole + sliced
    sent = sum(res["report"]["bytes_sent"] for res in results)
    received = sum(res["report"]["bytes_received"] for res in results)
    assert sent == received == 3 * whole + sliced


def test_a_failed_read_raises_on_every_rank_naming_the_rank_and_the_file(model, tmp_path):
    d, _ = model
    results = run(d, 3, "fail1", tmp_path)
    for r, res in enumerate(results):
        assert res and "error" in res, (r, res)
        e = res["error"]
        assert e.startswith("DistributedLoadError: rank 1: reading "), e
        assert str(d) in e and ".safetensors" in e and "Input/output error" in e, e
    # Every rank raises the failing rank's own message.
    assert len({res["error"] for res in results}) == 1


def test_a_bad_rule_on_one_rank_raises_on_every_rank(model, tmp_path):
    d, _ = model
    results = run(d, 2, "badrule", tmp_path)
    for r, res in enumerate(results):
        assert res and "error" in res, (r, res)
        assert "DistributedLoadError: rank 1: tensor model.layers." in res["error"], res["error"]
        assert "shard dim 5" in res["error"], res["error"]


def test_a_dead_rank_makes_the_others_raise_not_hang(model, tmp_path):
    d, _ = model
    results = run(d, 2, "die1", tmp_path)
    assert results[1] is None
    assert results[0] and "error" in results[0], results[0]


# Who reads what (pure: no group, no drives).


def assign(sized, world, nodes):
    from weightstream.torch import _assign

    return _assign(sized, world, nodes)


def loads(sized, readers, world):
    out = [0] * world
    for i, _, nbytes, _ in sized:
        out[readers[i]] += nbytes
    return out


def test_ranks_on_one_node_read_from_drives_of_their_own():
    # Two drives holding equal bytes, 2 and 4 ranks on one node: each rank
    # reads only from the drive it owns, and within its share plus one item.
    sized = [(i, list(range(4)), 1000 + 10 * (i % 5), (100 + i % 2,)) for i in range(40)]
    for world in (2, 4):
        s = [(i, list(range(world)), b, d) for i, _, b, d in sized]
        readers, owned = assign(s, world, ["n"] * world)
        assert all(len(owned[r]) == 1 for r in range(world)), owned
        # Several ranks share a drive only when there are fewer drives.
        assert len({min(o) for o in owned}) == 2
        for i, _, _, drives in s:
            assert owned[readers[i]] == set(drives), (world, i)
        total, largest = sum(b for _, _, b, _ in s), max(b for _, _, b, _ in s)
        assert max(loads(s, readers, world)) <= total / world + largest


def test_ranks_on_different_nodes_split_by_bytes_alone():
    sized = [(i, [0, 1], 1000 + i, (100 + i % 2,)) for i in range(10)]
    readers, owned = assign(sized, 2, ["a", "b"])
    assert owned == [set(), set()]
    # Largest first, each to the least loaded: the ranks alternate.
    assert [readers[i] for i in range(9, -1, -1)] == [0, 1, 1, 0, 0, 1, 1, 0, 0, 1]


def test_uneven_drives_never_push_a_rank_past_the_bound():
    import random

    rng = random.Random(5)
    for case in range(300):
        world = rng.choice([2, 3, 4, 8])
        drives = rng.randint(1, 5)
        nodes = [f"n{r % rng.choice([1, 2])}" for r in range(world)]
        sized = []
        for i in range(rng.randint(1, 60)):
            copies = tuple(sorted(rng.sample(range(drives), rng.randint(1, min(2, drives)))))
            sized.append((i, list(range(world)), rng.choice([0, 1, 7, 4096, 10**6, rng.randint(1, 10**7)]), copies))
        readers, owned = assign(sized, world, nodes)
        assert sorted(readers) == [i for i, *_ in sized]
        total, largest = sum(b for _, _, b, _ in sized), max(b for _, _, b, _ in sized)
        assert max(loads(sized, readers, world)) <= total / world + largest, case
        for r in range(world):
            same = [q for q in range(world) if nodes[q] == nodes[r]]
            assert not owned[r] or len(same) > 1, "a rank alone on its node owns nothing"


def test_an_item_goes_only_to_a_rank_that_needs_it():
    sized = [(i, [i % 3, 3], 100 * (i + 1), (7 + i % 2,)) for i in range(12)]
    readers, _ = assign(sized, 4, ["n"] * 4)
    for i, needing, _, _ in sized:
        assert readers[i] in needing


def test_ranks_sharing_a_node_read_their_own_drive(model, tmp_path):
    """A split model over two file systems (the test's folder and /dev/shm),
    2 ranks on one node: the rank owning the larger drive reads only from
    it, the other reads every byte of the smaller one, and every rank's
    tensors are right."""
    d, want = model
    a = tmp_path / "a"
    a.mkdir()
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(a).st_dev:
        pytest.skip("/dev/shm is not a file system of its own here")
    import shutil
    import tempfile

    b = tempfile.mkdtemp(prefix="ws-dist-", dir=shm)
    try:
        shutil.copy(d / "model.safetensors.index.json", a)
        shutil.copy(d / "model-00001-of-00003.safetensors", a)
        shutil.copy(d / "model-00003-of-00003.safetensors", a)
        shutil.copy(d / "model-00002-of-00003.safetensors", b)
        os.environ["WS_TEST_SPLIT_DIR"] = b
        try:
            results = run(a, 2, "split", tmp_path)
        finally:
            del os.environ["WS_TEST_SPLIT_DIR"]
        expect = {n: digest(t) for n, t in want.items()}
        dev_a, dev_b = os.stat(a).st_dev, os.stat(b).st_dev
        for r, res in enumerate(results):
            assert res and "error" not in res, (r, res)
            assert res["tensors"] == expect, r
        reps = [res["report"] for res in results]
        assert [rep["drives_owned"] for rep in reps] == [[dev_a], [dev_b]], reps
        by = [{int(k): v for k, v in rep["bytes_by_drive"].items()} for rep in reps]
        assert set(by[0]) == {dev_a}, by
        assert dev_b in by[1] and dev_b not in by[0], by
        in_b = sum(t.numel() * t.element_size() for n, t in want.items() if n.startswith("model.") and int(n.split(".")[2]) % 3 == 1) + 8
        assert by[1][dev_b] >= in_b, (by, in_b)
    finally:
        shutil.rmtree(b, ignore_errors=True)


def write_raw(path, tensors):
    """A safetensors file of raw tensors: {name: (dtype, shape, bytes)}
    (dtypes torch cannot write, such as F6)."""
    import struct

    header, data = {}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


@pytest.mark.parametrize("odd", ["F6_E2M3", "empty F6_E3M2"])
def test_a_dtype_torch_lacks_raises_on_every_rank_naming_the_tensor(tmp_path, odd):
    """A tensor whose dtype the installed torch has no type for (F6, or an
    empty one of it) is said by every rank before the exchange, naming the
    tensor and its file; no receiver raises TypeError mid-exchange while
    the reader waits out the group's timeout."""
    require("torch")
    d = tmp_path / "odd"
    d.mkdir()
    dtype = odd.split()[-1]
    shape, raw = ([0, 4], b"") if odd.startswith("empty") else ([4, 4], bytes(range(12)))
    write_raw(
        d / "model.safetensors",
        {"a.weight": ("F32", [8], bytes(32)), "b.mx": (dtype, shape, raw), "c.fp4": ("F4", [2, 8], bytes(range(8)))},
    )
    results = run(d, 2, "all", tmp_path)
    for r, res in enumerate(results):
        assert res and "error" in res, (r, res)
        e = res["error"]
        assert e.startswith("DistributedLoadError: rank ") and "tensor b.mx" in e and dtype in e, e
        assert "model.safetensors" in e, e


def test_fp4_travels_as_torch_float4(tmp_path):
    """F4 (two elements a byte) is torch's float4_e2m1fn_x2 with the last
    dimension halved, on the rank that read it and on the ones that
    received it, byte for byte."""
    torch = require("torch")
    if not hasattr(torch, "float4_e2m1fn_x2"):
        pytest.skip("this torch has no float4_e2m1fn_x2")
    d = tmp_path / "fp4"
    d.mkdir()
    raws = {f"l{i}.fp4": bytes((7 * i + k) % 256 for k in range(64)) for i in range(4)}
    write_raw(d / "model.safetensors", {n: ("F4", [8, 16], raw) for n, raw in raws.items()} | {"s": ("F8_E8M0", [3], b"\x01\x02\x03")})
    results = run(d, 2, "all", tmp_path)
    for r, res in enumerate(results):
        assert res and "error" not in res, (r, res)
        for n, raw in raws.items():
            assert res["tensors"][n] == ["torch.float4_e2m1fn_x2", [8, 8], hashlib.sha256(raw).hexdigest()], (r, n)
