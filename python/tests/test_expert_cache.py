"""weightstream.ExpertCache: bytes equal the reference reader's for every
expert fetched, hits equal an LRU simulation, prefetch never waits, and
tensors kept after close() stay valid (their entries stay pinned)."""

import gc
import threading

import numpy as np
import pytest

import weightstream
from conftest import o_direct_dir

LAYERS, EXPERTS = 3, 6


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """A small MoE written by safetensors.numpy: per layer, per expert,
    gate/up/down weights (odd sizes) and a down bias; a router per layer."""
    from safetensors.numpy import save_file

    d = o_direct_dir(tmp_path_factory, "moe")
    rng = np.random.default_rng(5)
    shards = [{}, {}]
    for l in range(LAYERS):
        shards[l % 2][f"model.layers.{l}.mlp.gate.weight"] = rng.standard_normal((EXPERTS, 48)).astype(np.float32)
        for e in range(EXPERTS):
            p = f"model.layers.{l}.mlp.experts.{e}."
            shards[l % 2][p + "gate_proj.weight"] = rng.standard_normal((97, 48)).astype(np.float16)
            shards[l % 2][p + "up_proj.weight"] = rng.standard_normal((97, 48)).astype(np.float16)
            shards[l % 2][p + "down_proj.weight"] = rng.standard_normal((48, 97)).astype(np.float16)
            shards[l % 2][p + "down_proj.bias"] = rng.standard_normal((48,)).astype(np.float32)
    import json
    import os

    weight_map = {}
    for k, s in enumerate(shards):
        name = f"model-{k + 1:05d}-of-00002.safetensors"
        save_file(s, os.path.join(d, name))
        weight_map.update({n: name for n in s})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    everything = {}
    for s in shards:
        everything.update(s)
    return d, everything


def check(got, ref, layer, expert):
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    assert sorted(got) == ["down_proj", "down_proj.bias", "gate_proj", "up_proj"]
    for key, t in got.items():
        name = p + (key if "." in key else key + ".weight")
        np.testing.assert_array_equal(np.asarray(t), ref[name])


def lru_hits(trace, cap):
    lst, hits = [], 0
    for k in trace:
        if k in lst:
            hits += 1
            lst.remove(k)
        elif len(lst) == cap:
            lst.pop(0)
        lst.append(k)
    return hits


def test_bytes_and_lru_hits(moe):
    d, ref = moe
    rng = np.random.default_rng(9)
    trace = [(int(l), int(min(rng.zipf(1.5) - 1, EXPERTS - 1))) for _ in range(60) for l in range(LAYERS)]
    with weightstream.ExpertCache(d, capacity=5, framework="np") as c:
        for l, e in trace:
            check(c.get(l, e), ref, l, e)
        s = c.stats()
        assert s["hits"] == lru_hits(trace, 5)
        assert s["misses"] == len(trace) - s["hits"]
        assert s["entries"] <= 5 and s["failed_reads"] == 0
        many = c.get_many(1, [0, 4, 2])
        for e, got in zip([0, 4, 2], many):
            check(got, ref, 1, e)
        with pytest.raises(Exception, match="no expert 99"):
            c.get(0, 99)


def test_prefetch_never_waits_and_tensors_outlive_close(moe):
    d, ref = moe
    c = weightstream.ExpertCache(d, capacity=2, framework="np")
    a = c.get(0, 0)
    b = c.get(0, 1)
    # Both entries pinned by the arrays held here: a prefetch that waited
    # for room would never return.
    assert c.prefetch([(0, 2), (0, 3)]) == {"started": 0, "present": 0, "refused": 2}
    with pytest.raises(RuntimeError, match="expert cache full"):
        c.get(0, 4)
    del a
    gc.collect()
    r = c.prefetch([(0, 2)])
    assert r["started"] == 1
    c.wait_idle()
    s = c.stats()
    assert s["prefetched"] == 1 and s["pinned"] == 1
    c.close()
    check(b, ref, 0, 1)  # still valid after close
    with pytest.raises(ValueError, match="closed"):
        c.get(0, 0)


def test_threads_and_torch(moe):
    torch = pytest.importorskip("torch")
    d, ref = moe
    c = weightstream.ExpertCache(d, budget_bytes=1 << 20, policy="lfu")
    assert c.capacity >= 1 and c.entry_bytes > 0
    errors = []

    def worker(seed):
        rng = np.random.default_rng(seed)
        try:
            for _ in range(40):
                l, e = int(rng.integers(LAYERS)), int(rng.integers(EXPERTS))
                try:
                    got = c.get(l, e)
                except RuntimeError as err:  # full: every entry pinned right now
                    assert "full" in str(err)
                    continue
                assert isinstance(got["gate_proj"], torch.Tensor)
                check({k: v.numpy() for k, v in got.items()}, ref, l, e)
        except Exception as err:  # pragma: no cover - reported below
            errors.append(err)

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    c.close()


def test_cached_experts_are_read_only_arrays_shared_by_every_get(moe):
    """Every get of an expert hands out the same cached bytes: numpy arrays
    of them are read-only (DLPack's read-only flag), so an in-place write
    raises instead of changing what later gets return. Before: writable,
    and a write showed in the next get."""
    d, ref = moe
    with weightstream.ExpertCache(d, capacity=2, framework="np") as c:
        first = c.get(1, 2)
        for key, a in first.items():
            assert not a.flags.writeable, key
            with pytest.raises(ValueError, match="read-only"):
                a[...] = 0
        check(c.get(1, 2), ref, 1, 2)
        # A copy is the caller's own, writable.
        mine = first["gate_proj"].copy()
        mine[...] = 0
        check(c.get(1, 2), ref, 1, 2)


def test_a_capacity_above_the_routed_experts_maps_only_them(moe):
    d, _ = moe
    with weightstream.ExpertCache(d, capacity=10_000, framework="np") as c:
        s = c.stats()
        assert (s["capacity"], s["capacity_asked"]) == (LAYERS * EXPERTS, 10_000)
        assert c.capacity == LAYERS * EXPERTS


def test_a_layer_or_expert_out_of_range_is_an_index_error(moe):
    """Out of range is IndexError (as a sequence's), naming what exists;
    get, get_many and prefetch alike, and none is a SafetensorError."""
    d, _ref = moe
    with weightstream.ExpertCache(d, capacity=2, framework="np") as c:
        with pytest.raises(IndexError, match=f"layer 0 has no expert {EXPERTS}"):
            c.get(0, EXPERTS)
        with pytest.raises(IndexError, match=f"layer {LAYERS} is out of range"):
            c.get(LAYERS, 0)
        with pytest.raises(IndexError, match="no expert 99"):
            c.get_many(1, [0, 99])
        with pytest.raises(IndexError, match=f"layer {LAYERS + 5} is out of range"):
            c.prefetch([(LAYERS + 5, 0)])
        with pytest.raises(IndexError) as e:
            c.get(0, EXPERTS)
        assert not isinstance(e.value, weightstream.SafetensorError)
        # The cache is still usable after a refusal.
        assert sorted(c.get(0, 1)) == ["down_proj", "down_proj.bias", "gate_proj", "up_proj"]
