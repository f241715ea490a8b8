"""Whole-model loads: layouts, filters, ownership, the GIL, Ctrl-C."""

import gc
import json
import os
import shutil
import subprocess
import threading

import numpy as np
import pytest
from conftest import run_python, torch_or_skip, weightstream_bin, write_layered_model

import weightstream


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """Three shards and their index, written by safetensors.numpy; layer i
    of 6 in shard i mod 3."""
    from safetensors.numpy import save_file

    d = tmp_path_factory.mktemp("sharded")
    rng = np.random.default_rng(7)
    return d, write_layered_model(d, lambda _p, shape: rng.standard_normal(shape).astype(np.float32), save_file)


def check(got, want):
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape and np.array_equal(got[k], want[k]), k


def test_a_directory_its_index_and_one_file(sharded):
    d, want = sharded
    check(weightstream.load(d, framework="np"), want)
    check(weightstream.load(d / "model.safetensors.index.json", framework="np"), want)
    one = weightstream.load(d / "model-00002-of-00003.safetensors", framework="np")
    assert sorted(one) == sorted(k for k in want if int(k.split(".")[2]) % 3 == 1)
    check(one, {k: want[k] for k in one})


def test_names_filter(sharded):
    d, want = sharded
    got = weightstream.load(d, framework="np", names=["layers.2.", "norm"])
    assert sorted(got) == sorted(k for k in want if "layers.2." in k or "norm" in k)
    with pytest.raises(ValueError, match="no_such_part"):
        weightstream.load(d, framework="np", names=["no_such_part"])


def test_shard_reads_each_ranks_part_alone(sharded):
    d, want = sharded
    # Column-parallel q (rows), row-parallel k (columns), norm whole: as a
    # vLLM-style loader declares its layers.
    for world in (2, 4):
        for rank in range(world):
            table = {"*.q.weight": (0, rank, world), "*.k.weight": (1, rank, world), "*.norm.*": None}

            def part(name, a):
                if name.endswith("q.weight"):
                    n = a.shape[0]
                    return a[n * rank // world : n * (rank + 1) // world]
                if name.endswith("k.weight"):
                    n = a.shape[1]
                    return a[:, n * rank // world : n * (rank + 1) // world]
                return a

            expect = {k: part(k, v) for k, v in want.items()}
            check(weightstream.load(d, framework="np", shard=table), expect)
            # The same rule as a function, with a names filter.
            rule = lambda name, shape: table["*.q.weight"] if name.endswith("q.weight") else None  # noqa: E731
            got = weightstream.load(d, framework="np", shard=rule, names=["layers.1."])
            check(got, {k: (part(k, v) if k.endswith("q.weight") else v) for k, v in want.items() if "layers.1." in k})
    # Every tensor sliced: nothing is read whole.
    got = weightstream.load(d, framework="np", shard={"*": (0, 1, 2)})
    check(got, {k: v[v.shape[0] // 2 :] for k, v in want.items()})
    assert weightstream.shard_bounds("x", [10, 6], (1, 1, 4)) == [(0, 10), (1, 3)]
    assert weightstream.shard_bounds("x", [10, 6], (-1, 3, 4)) == [(0, 10), (4, 6)]
    for bad in ((2, 0, 2), (0, 2, 2), (0, 0, 0), "x"):
        with pytest.raises(ValueError, match="model.layers"):
            weightstream.load(d, framework="np", shard={"*": bad})
    with pytest.raises(ValueError, match="gets nothing"):
        weightstream.load(d, framework="np", shard={"*.norm.weight": (0, 0, 200)}, names=["norm"])


def test_names_with_shard_when_every_named_tensor_is_sliced(sharded):
    """Every tensor the names keep is sliced by the rule: the load reads
    the slices alone. Before: "no tensor selected" (the check for whole
    tensors left ignored the names)."""
    d, want = sharded
    report = {}
    got = weightstream.load(d, framework="np", names="q.weight", shard={"*.q.weight": (0, 1, 2)}, report=report)
    assert sorted(got) == sorted(k for k in want if "q.weight" in k)
    assert report["slices"] == 6 and report["slice_bytes_wanted"] == 6 * 128 * 96 * 4, report
    assert report["slice_bytes_wanted"] <= report["slice_bytes_read"] <= report["slice_bytes_wanted"] + 6 * 2 * 4096, report
    for k, a in got.items():
        assert np.array_equal(a, want[k][128:]), k
    # Names keeping sliced and whole tensors: both.
    got = weightstream.load(d, framework="np", names=["layers.0."], shard={"*.q.weight": (1, 0, 2)})
    assert sorted(got) == sorted(k for k in want if "layers.0." in k)
    assert np.array_equal(got["model.layers.0.q.weight"], want["model.layers.0.q.weight"][:, :48])
    assert np.array_equal(got["model.layers.0.k.weight"], want["model.layers.0.k.weight"])


def split_and_mirror(d, tmp_path):
    """The model of ``d`` split over two folders (a: the index and the
    first shard, b: the rest) and mirrored whole in a third (m)."""
    a, b, m = tmp_path / "a", tmp_path / "b", tmp_path / "m"
    for x in (a, b, m):
        x.mkdir()
    shutil.copy(d / "model.safetensors.index.json", a)
    shutil.copy(d / "model-00001-of-00003.safetensors", a)
    for k in (2, 3):
        shutil.copy(d / f"model-0000{k}-of-00003.safetensors", b)
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            shutil.copy(d / f, m)
    return a, b, m


def test_split_and_mirror(sharded, tmp_path):
    d, want = sharded
    a, b, m = split_and_mirror(d, tmp_path)
    check(weightstream.load(a, framework="np", dirs=[b]), want)
    check(weightstream.load(d, framework="np", mirrors=[m], route="stripe"), want)
    with weightstream.safe_open(a, framework="np", dirs=[b], mirrors=None) as f:
        assert f.keys() == sorted(want)
        assert np.array_equal(f.get_tensor("model.layers.5.q.weight"), want["model.layers.5.q.weight"])
    with pytest.raises(weightstream.SafetensorError):
        weightstream.load(a, framework="np")  # the index names shards the folder lacks


def test_relative_split_and_mirror_folders(sharded, tmp_path, monkeypatch):
    """dirs= and mirrors= given relative to the working directory, as the
    model's own folder may be: taken against it (load, safe_open, stream,
    Engine)."""
    d, want = sharded
    _a, b, _m = split_and_mirror(d, tmp_path)
    monkeypatch.chdir(tmp_path)
    report = {}
    check(weightstream.load("a", framework="np", dirs=["b"], mirrors=["./m"], report=report), want)
    with weightstream.safe_open("a", framework="np", dirs="b", mirrors="m") as f:
        assert f.keys() == sorted(want)
        assert np.array_equal(f.get_tensor("model.layers.4.q.weight"), want["model.layers.4.q.weight"])
    check(dict(weightstream.stream("a", framework="np", dirs=["b"])), want)
    monkeypatch.chdir(b)
    check(weightstream.load("../a", framework="np", dirs=["."], mirrors=["../m"]), want)
    # A relative folder that is not there is named as typed and as taken.
    with pytest.raises(ValueError, match=r'mirror directory "nowhere" \(.*/b/nowhere\): does not exist'):
        weightstream.load("../a", framework="np", dirs=["."], mirrors=["nowhere"])


def test_without_torch_the_error_names_numpy_and_the_extra(sharded, monkeypatch):
    """framework="pt" (the default) without torch: said before a byte is
    read, with framework="np" and the torch extra named."""
    import sys

    d, want = sharded
    monkeypatch.setitem(sys.modules, "torch", None)
    for call in (lambda: weightstream.load(d), lambda: list(weightstream.stream(d))):
        with pytest.raises(ModuleNotFoundError) as e:
            call()
        msg = str(e.value)
        assert e.value.name == "torch"
        assert 'framework="np"' in msg and "weightstream[torch]" in msg and "torch is not installed" in msg, msg
    with weightstream.safe_open(d / "model-00001-of-00003.safetensors", framework="pt") as f:
        assert f.keys()
        with pytest.raises(ModuleNotFoundError, match='framework="np"'):
            f.get_tensor(f.keys()[0])
    # numpy still reads.
    check(weightstream.load(d, framework="np"), want)


def test_placed_model(sharded, tmp_path):
    d, want = sharded
    ws = weightstream_bin()
    if ws is None:
        pytest.fail("the weightstream command is needed to place a model (WEIGHTSTREAM_BIN, or build the workspace)")
    import tempfile

    # Two volumes: /dev/shm (a tmpfs) and the source's own (allowed).
    shm = tempfile.mkdtemp(dir="/dev/shm")
    r1, r2 = os.path.join(shm, "r1"), tmp_path / "r2"
    os.mkdir(r1)
    r2.mkdir()
    out = subprocess.run(
        [ws, "place", str(d), "--to", f"{r1};{r2}", "--layout", "split", "--allow-source-volume", "--json"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    try:
        primary = json.loads(out.stdout)["primary"]
        check(weightstream.load(primary, framework="np"), want)
        with weightstream.safe_open(primary, framework="np") as f:
            assert f.keys() == sorted(want)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_tensors_keep_their_memory_after_the_load(sharded):
    d, want = sharded
    got = weightstream.load(d, framework="np")
    one = got["model.layers.3.k.weight"]
    del got
    gc.collect()
    assert np.array_equal(one, want["model.layers.3.k.weight"])


def test_torch_load_and_bf16(sharded, tmp_path):
    torch = torch_or_skip()
    from safetensors.torch import load_file, save_file

    d, want = sharded
    got = weightstream.load(d)  # framework="pt" by default
    for k, v in want.items():
        assert torch.equal(got[k], torch.from_numpy(v)), k
    p = str(tmp_path / "bf16.safetensors")
    save_file({"w": torch.randn(300, 77).to(torch.bfloat16)}, p)
    import weightstream.torch as wt

    assert torch.equal(wt.load_file(p)["w"], load_file(p)["w"])


def test_the_gil_is_released_while_a_load_runs(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    for k in range(4):
        save_file({f"w{k}": rng.standard_normal((4096, 4096)).astype(np.float32)}, str(tmp_path / f"m{k}.safetensors"))
    count = [0]
    stop = threading.Event()

    def counter():
        while not stop.is_set():
            count[0] += 1

    t = threading.Thread(target=counter)
    t.start()
    try:
        before = count[0]
        got = weightstream.load(tmp_path, framework="np")  # 268 MB
        during = count[0] - before
    finally:
        stop.set()
        t.join()
    assert len(got) == 4
    # Python bytecode ran on the other thread while the load was inside Rust.
    assert during > 0


def test_ctrl_c_during_a_load_raises_keyboard_interrupt(tmp_path):
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    for k in range(6):
        save_file({f"w{k}": rng.standard_normal((4096, 4096)).astype(np.float32)}, str(tmp_path / f"m{k}.safetensors"))
    # The signal comes while the load's own thread ("ws-py-load") is running:
    # a load that ignored signals would finish first (one load completed),
    # this one raises at once (none completed).
    code = f"""
import os, signal, threading, time, weightstream
# Python leaves SIGINT ignored when it starts with it ignored (a job a
# non-interactive shell put in the background): Ctrl-C's handler, as a
# terminal's Python has it.
signal.signal(signal.SIGINT, signal.default_int_handler)
def loading():
    for t in os.listdir("/proc/self/task"):
        try:
            if open(f"/proc/self/task/{{t}}/comm").read().strip() == "ws-py-load":
                return True
        except OSError:
            pass
    return False
def interrupt():
    while not loading():
        time.sleep(0.0005)
    os.kill(os.getpid(), signal.SIGINT)
threading.Thread(target=interrupt, daemon=True).start()
done = 0
try:
    for _ in range(50):
        weightstream.load({str(tmp_path)!r}, framework="np")
        done += 1
    print("no interrupt")
except KeyboardInterrupt:
    print("interrupted after", done)
"""
    out = run_python(code, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "interrupted after 0", (out.stdout, out.stderr)


def test_stats_and_close(sharded):
    d, _ = sharded
    f = weightstream.safe_open(d, framework="np")
    f.get_tensor("model.layers.0.q.weight")
    s = f.stats()
    assert s["bytes"] >= 256 * 96 * 4 and s["drives"] and "fallbacks" in s["drives"][0]
    assert f.close() is True
    for call in (lambda: f.get_tensor("model.layers.0.q.weight"), f.keys, f.metadata, f.stats, lambda: f.get_slice("x")):
        with pytest.raises(weightstream.SafetensorError, match="closed"):
            call()


def test_stream_yields_every_tensor_in_order_each_owned(sharded):
    d, want = sharded
    got = list(weightstream.stream(d, framework="np", window=3))
    assert [n for n, _ in got] == sorted(want)
    for n, a in got:
        assert np.array_equal(a, want[n]), n
    part = dict(weightstream.stream(d, framework="np", names="layers.4."))
    assert sorted(part) == sorted(k for k in want if "layers.4." in k)


def test_read_into_arrays_buffers_and_tensors(sharded):
    d, want = sharded
    name = "model.layers.1.q.weight"
    w = want[name]
    with weightstream.Engine(d, framework="np") as e:
        out = np.empty_like(w)
        assert e.read_into(name, out) is out and np.array_equal(out, w)
        rows = np.empty((10, 96), np.float32)
        e.read_into(name, rows, rows=(5, 15))
        assert np.array_equal(rows, w[5:15])
        buf = bytearray(100)
        e.read_into(name, buf, start=4000, end=4100)
        assert bytes(buf) == w.tobytes()[4000:4100]
        mv = memoryview(bytearray(8))
        e.read_into(name, mv, start=1, end=9)
        assert mv.tobytes() == w.tobytes()[1:9]
        # Empty ranges read nothing (before: ValueError).
        for kw in ({"rows": (7, 7)}, {"rows": (256, 256)}, {"start": 100, "end": 100}, {"start": 0, "end": 0}):
            empty = np.empty((0, 96), np.float32) if "rows" in kw else bytearray()
            assert e.read_into(name, empty, **kw) is empty
        with pytest.raises(ValueError, match="rows"):
            e.read_into(name, np.empty((0, 96), np.float32), rows=(257, 257))
        with pytest.raises(ValueError):
            e.read_into(name, bytearray(), start=w.nbytes + 1, end=w.nbytes + 1)
        for bad, what in [
            (np.empty((256, 95), np.float32), "bytes"),
            (np.empty((256, 96), np.float64), "float64"),
            (np.empty((96, 256), np.float32).T, "contiguous"),
            (b"x" * (256 * 96 * 4), "read-only"),
            (object(), "object"),
        ]:
            with pytest.raises(ValueError, match=what):
                e.read_into(name, bad)
        ro = np.empty_like(w)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="read-only"):
            e.read_into(name, ro)
        assert e.stats()["bytes"] > 0


def test_read_into_torch_tensors(sharded):
    torch = torch_or_skip()
    d, want = sharded
    name = "model.layers.2.k.weight"
    with weightstream.Engine(d) as e:
        out = torch.empty(64, 96)
        e.read_into(name, out)
        assert torch.equal(out, torch.from_numpy(want[name]))
        half = torch.empty(32, 96)
        e.read_into(name, half, rows=(32, 64))
        assert torch.equal(half, torch.from_numpy(want[name][32:]))
        with pytest.raises(ValueError, match="bfloat16"):
            e.read_into(name, torch.empty(64, 96, dtype=torch.bfloat16))
        with pytest.raises(ValueError, match="contiguous"):
            e.read_into(name, torch.empty(96, 64).t())
        with pytest.raises(ValueError, match="grad"):
            e.read_into(name, torch.empty(64, 96, requires_grad=True))
