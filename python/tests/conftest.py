"""Models written by the reference writer (safetensors), for the tests."""

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(autouse=True)
def _plan_cache_of_its_own(tmp_path_factory, monkeypatch):
    """Each test keeps vLLM plans (weightstream._plan_cache) in a folder of
    its own: no test finds a plan another test or run traced."""
    monkeypatch.setenv("WEIGHTSTREAM_PLAN_CACHE", str(tmp_path_factory.mktemp("plans")))


def o_direct_dir(tmp_path_factory, name):
    """A folder on a file system that reads O_DIRECT (tmpfs does not): under
    /var/tmp when the test's own tmp is on tmpfs."""
    base = tmp_path_factory.mktemp(name)
    return str(base)


@pytest.fixture(scope="session")
def np_model(tmp_path_factory):
    """One file of every numpy dtype, odd sizes, an empty and a scalar
    tensor, and metadata; written by safetensors.numpy."""
    from safetensors.numpy import save_file

    d = o_direct_dir(tmp_path_factory, "np")
    rng = np.random.default_rng(1)
    t = {}
    for dt in ["bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64", "float16", "float32", "float64"]:
        shape = (rng.integers(1, 40), rng.integers(1, 300))
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dt).itemsize, dtype=np.uint8)
        a = raw.view(dt).reshape(shape) if dt != "bool" else (raw[: int(np.prod(shape))] & 1).astype(bool).reshape(shape)
        t[f"t.{dt}"] = a
    t["big"] = rng.standard_normal((1000, 700)).astype(np.float32)
    t["empty"] = np.zeros((0, 5), np.float32)
    t["scalar"] = np.array(2.5, np.float64)
    path = os.path.join(d, "model.safetensors")
    save_file(t, path, metadata={"format": "np", "who": "test"})
    return path, t


def write_layered_model(d, make, save_file, extra=()):
    """A model in ``d``: 6 layers of q [256, 96], k [64, 96] and norm [96]
    weights, layer i in shard i mod 3 of 3, with ``extra`` ``(shard,
    name, tensor)`` added, and the index transformers writes.
    ``make(part, shape)`` gives each weight (its dtype is the caller's);
    ``save_file`` is the framework's writer. Returns every tensor by name."""
    import json

    shards, weight_map = [{}, {}, {}], {}
    for i in range(6):
        for p, shape in (("q", (256, 96)), ("k", (64, 96)), ("norm", (96,))):
            name = f"model.layers.{i}.{p}.weight"
            shards[i % 3][name] = make(p, shape)
            weight_map[name] = f"model-{i % 3 + 1:05d}-of-00003.safetensors"
    for k, name, t in extra:
        shards[k][name] = t
        weight_map[name] = f"model-{k + 1:05d}-of-00003.safetensors"
    everything = {}
    for k, s in enumerate(shards):
        save_file(s, str(d / f"model-{k + 1:05d}-of-00003.safetensors"))
        everything.update(s)
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return everything


def weightstream_bin():
    """The command (for `place`): WEIGHTSTREAM_BIN, else the workspace build."""
    b = os.environ.get("WEIGHTSTREAM_BIN")
    if b:
        return b
    for prof in ("release", "debug"):
        p = os.path.join(REPO, "target", prof, "weightstream")
        if os.path.exists(p):
            return p
    return shutil.which("weightstream")


def require(module):
    """`module`, or a skip (a failure under WEIGHTSTREAM_REQUIRE_TORCH=1, as
    CI sets: torch and transformers are required there)."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        if os.environ.get("WEIGHTSTREAM_REQUIRE_TORCH") == "1":
            pytest.fail(f"{module} is required here (WEIGHTSTREAM_REQUIRE_TORCH=1)")
        pytest.skip(f"{module} is not installed")


def torch_or_skip():
    return require("torch")


def run_python(code, timeout=300):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
