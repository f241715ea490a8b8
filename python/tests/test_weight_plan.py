"""The load plan (weightstream._weight_plan) on toy modules whose loaders do
what vLLM's do (fused qkv rows, column shards, stacked experts, a zeroed
padding, casts, transposes, computed values, concatenations, overlapping
and missing writes, a loader that raises, a loader that replaces a
parameter): what is planned, what falls back and why, and, filled from a
real checkpoint with the fallback run on real tensors, the parameters'
bytes equal the loader's own run on the real tensors. No vLLM needed."""

import gc

import pytest

torch = pytest.importorskip("torch")
st = pytest.importorskip("safetensors.torch")

import weightstream._native as native  # noqa: E402
from weightstream import _weight_plan as wp  # noqa: E402


class Toy(torch.nn.Module):
    """Parameters shaped as vLLM's fused and sharded layers hold them, and
    a load_weights with one branch per pattern."""

    def __init__(self, dtype=torch.float32):
        super().__init__()
        z = lambda *s: torch.nn.Parameter(torch.empty(*s, dtype=dtype), requires_grad=False)  # noqa: E731
        self.qkv = z(24, 8)  # q 16 rows, k 4, v 4
        self.col = z(6, 5)  # columns 5-9 of a (6, 10) tensor: a column shard
        self.gate_up = z(2, 12, 8)  # 2 experts, gate rows 0-5 and up 6-11
        self.emb = z(10, 8)  # 8 rows from the checkpoint, 2 padding rows zeroed
        self.inter = z(4, 6)  # columns 0-2 from a, 3-5 from b: a strided destination
        self.cast = z(4, 4)
        self.tr = z(4, 3)
        self.scaled = z(4, 4)
        self.cat = z(8, 4)
        self.twice = z(4, 4)
        self.halved = z(4, 4)
        self.boom = z(2, 2)
        self.swap = z(3, 3)
        # A view of a parameter kept outside the parameter tables (as a
        # layer caching a slice of its weight): its storage must not move.
        self.expert0 = self.gate_up.data[0]
        self.loaded_names = []

    def load_weights(self, weights):
        loaded = set()
        cat_parts = []
        for name, w in weights:
            if name in ("q", "k", "v"):
                off, n = {"q": (0, 16), "k": (16, 4), "v": (20, 4)}[name]
                self.qkv.data.narrow(0, off, n).copy_(w)
                loaded.add("qkv")
            elif name == "col":
                self.col.data.copy_(w.narrow(1, 5, 5))
                loaded.add("col")
            elif name.startswith("experts."):
                _, e, which = name.split(".")
                rows = slice(0, 6) if which == "gate" else slice(6, 12)
                self.gate_up.data[int(e), rows].copy_(w)
                loaded.add("gate_up")
            elif name == "emb":
                self.emb.data[: w.shape[0]].copy_(w)
                self.emb.data[w.shape[0] :].fill_(0)
                loaded.add("emb")
            elif name in ("inter_a", "inter_b"):
                c = 0 if name == "inter_a" else 3
                self.inter.data[:, c : c + 3].copy_(w)
                loaded.add("inter")
            elif name == "cast":
                self.cast.data.copy_(w.to(torch.float32))
                loaded.add("cast")
            elif name == "tr":
                self.tr.data.copy_(w.t())
                loaded.add("tr")
            elif name == "scaled":
                self.scaled.data.copy_(w * 2)
                loaded.add("scaled")
            elif name in ("cat_a", "cat_b"):
                cat_parts.append(w)
                if len(cat_parts) == 2:
                    self.cat.data.copy_(torch.cat(cat_parts))
                    loaded.add("cat")
            elif name in ("twice_a", "twice_b"):
                self.twice.data.copy_(w)
                loaded.add("twice")
            elif name == "half":
                self.halved.data[:2].copy_(w)
                loaded.add("halved")
            elif name == "boom":
                if w.device.type == "meta":
                    raise RuntimeError("a loader that reads values (.item())")
                self.boom.data.copy_(w)
                loaded.add("boom")
            elif name == "swap":
                self.swap = torch.nn.Parameter(w, requires_grad=False)
                loaded.add("swap")
            elif name == "unused":
                pass
        return loaded


def checkpoint(path, dtype=torch.float32):
    g = torch.Generator().manual_seed(47)
    r = lambda *s, dt=dtype: torch.randn(*s, generator=g).to(dt)  # noqa: E731
    t = {
        "q": r(16, 8), "k": r(4, 8), "v": r(4, 8),
        "col": r(6, 10),
        "emb": r(8, 8),
        "inter_a": r(4, 3), "inter_b": r(4, 3),
        "cast": r(4, 4, dt=torch.float16),
        "tr": r(3, 4),
        "scaled": r(4, 4),
        "cat_a": r(4, 4), "cat_b": r(4, 4),
        "twice_a": r(4, 4), "twice_b": r(4, 4),
        "half": r(2, 4),
        "boom": r(2, 2),
        "swap": r(3, 3),
        "unused": r(5),
    }
    for e in range(2):
        t[f"experts.{e}.gate"] = r(6, 8)
        t[f"experts.{e}.up"] = r(6, 8)
    st.save_file(t, str(path))
    return t


def plan_for(model, reader, names):
    from weightstream._convert import torch_dtype

    ins = []
    for n in names:
        dtype, shape, _nbytes, _off = reader.info(n)
        ins.append(wp.StandIn(n, (0, n), torch_dtype(dtype), shape))
    tr = wp.trace(model.load_weights, model, ins)
    return tr, wp.check(tr, model, ins)


@pytest.mark.parametrize("way", ["fill", "pipeline", "rehome"])
def test_a_plan_fills_what_the_loader_would_write_and_names_each_fallback(tmp_path, way):
    """``fill``: Engine::fill into the parameters where they lie;
    ``pipeline``: load_into's device pipeline; ``rehome``: the parameters
    moved in phase with their files first (the padding the trace zeroed
    goes along; one held by a view elsewhere stays), then the fill."""
    pipeline = way == "pipeline"
    f = tmp_path / "toy.safetensors"
    tensors = checkpoint(f)
    reader = native.Reader(str(f))
    names = list(tensors)
    model = Toy()
    for p in model.parameters():
        p.data.fill_(float("nan"))  # what the plan leaves unwritten shows
    tr, plan = plan_for(model, reader, names)
    keys = lambda ks: sorted(k[1] for k in ks)  # noqa: E731
    assert keys(plan.planned) == sorted(
        ["q", "k", "v", "col", "emb", "inter_a", "inter_b"] + [f"experts.{e}.{w}" for e in range(2) for w in ("gate", "up")]
    )
    why = {k[1]: r for k, r in plan.fallback.items()}
    assert "cast" in why["cast"]
    assert "transpose" in why["tr"] or "not a box" in why["tr"]
    assert "computes on values" in why["scaled"]
    assert "concatenation" in why["cat_a"] and "concatenation" in why["cat_b"]
    assert "overlap" in why["twice_a"] and "overlap" in why["twice_b"]
    assert "raised" in why["boom"]
    assert "param.data" in why["swap"]
    assert "not written by the loader" in why["half"]
    assert keys(plan.unused) == ["unused"]
    # The parameters the trace touched are as they were (nan), but the
    # padding the loader zeroes (a write no checkpoint tensor feeds).
    assert torch.isnan(model.qkv).all() and torch.isnan(model.swap).all()
    assert (model.emb[8:] == 0).all() and torch.isnan(model.emb[:8]).all()

    if way == "rehome":
        before = {n: p.data_ptr() for n, p in model.named_parameters()}
        moved = wp.rehome(plan, model, {0: reader}, tr.other_writes)
        after = {n: p.data_ptr() for n, p in model.named_parameters()}
        assert moved["parameters"] + moved["in_phase"] == 2, moved  # qkv, emb
        assert moved["stayed"] == {
            "no write is one run of its file": ["col", "inter"],
            "held by another tensor": ["gate_up"],
        }, moved
        assert after["gate_up"] == before["gate_up"] and model.expert0.data_ptr() == before["gate_up"]
        assert moved["in_phase"] or (after["emb"] != before["emb"] and after["qkv"] != before["qkv"]), moved
        assert (model.emb[8:] == 0).all(), "the padding the trace zeroed moved with the parameter"
    got = wp.fill(plan, {0: reader}, pipeline=pipeline)
    if way == "rehome":
        # The toy's tensors are smaller than a block: all staged (the
        # in-place reads: the next test).
        assert got["in_place_bytes"] + got["staged_bytes"] == got["bytes"], got
    planned_bytes = sum(reader.info(k[1])[2] for k in plan.planned) - 6 * 5 * 4  # col: 5 of its 10 columns
    assert got["bytes"] == planned_bytes, got
    if pipeline:
        assert got["device_bytes"] == got["bytes"]
    model.load_weights((n, tensors[n]) for n in names if (0, n) in plan.fallback)

    ref = Toy()
    for p in ref.parameters():
        p.data.fill_(float("nan"))
    ref.load_weights(tensors.items())
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert a.shape == b.shape and a.dtype == b.dtype, n
        assert bytes(a.detach().contiguous().view(-1).view(torch.uint8).numpy()) == bytes(
            b.detach().contiguous().view(-1).view(torch.uint8).numpy()
        ), n


class Big(torch.nn.Module):
    """One fused parameter of two checkpoint tensors that lie in a row in
    their file (as a qkv's do), and a padded embedding."""

    def __init__(self):
        super().__init__()
        self.fused = torch.nn.Parameter(torch.empty(96, 256), requires_grad=False)
        self.emb = torch.nn.Parameter(torch.empty(40, 256), requires_grad=False)

    def load_weights(self, weights):
        for name, w in weights:
            if name == "a_part":
                self.fused.data[:64].copy_(w)
            elif name == "b_part":
                self.fused.data[64:].copy_(w)
            elif name == "c_emb":
                self.emb.data[: w.shape[0]].copy_(w)
                self.emb.data[w.shape[0] :].fill_(0)
        return {"fused", "emb"}


def test_rehome_puts_parameters_in_phase_with_their_files_so_the_fill_reads_them_in_place(tmp_path):
    """torch's allocator puts a parameter at 64 bytes, in phase with its
    file by chance; after ``rehome`` each parameter's address agrees with
    its bytes' file offset modulo the O_DIRECT block, the fill reads all
    of them in place (the file's first and last partial blocks aside),
    the padding the trace zeroed is still zero and the bytes equal the
    loader's own run."""
    f = tmp_path / "big.safetensors"
    g = torch.Generator().manual_seed(5)
    # "_": 100 bytes ahead of the others, so that their offsets are not
    # block-aligned in the file.
    tensors = {
        "_": torch.zeros(25),
        "a_part": torch.randn(64, 256, generator=g),
        "b_part": torch.randn(32, 256, generator=g),
        "c_emb": torch.randn(37, 256, generator=g),
    }
    st.save_file(tensors, str(f))
    reader = native.Reader(str(f))
    model = Big()
    tr, plan = plan_for(model, reader, ["a_part", "b_part", "c_emb"])
    assert len(plan.writes) == 3 and not plan.fallback
    moved = wp.rehome(plan, model, {0: reader}, tr.other_writes)
    assert moved["parameters"] + moved["in_phase"] == 2 and not moved["stayed"], moved
    align = reader.direct_align()
    assert model.fused.data_ptr() % align == reader.info("a_part")[3] % align
    assert model.emb.data_ptr() % align == reader.info("c_emb")[3] % align
    assert (model.emb[37:] == 0).all()
    got = wp.fill(plan, {0: reader})
    assert got["bytes"] == (96 + 37) * 256 * 4
    # At most the head of the first run and the tail of each parameter's
    # run are partial blocks (staged).
    assert got["in_place_bytes"] >= got["bytes"] - 4 * align, got
    ref = Big()
    ref.load_weights(tensors.items())
    for n in ("fused", "emb"):
        assert torch.equal(getattr(model, n), getattr(ref, n)), n


def _mapping_of(address):
    """The (start, end) of the mapping in /proc/self/maps holding address."""
    with open("/proc/self/maps") as fh:
        for line in fh:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return lo, hi
    return None


def test_a_moved_parameter_gives_its_pages_back_when_it_goes(tmp_path):
    """``rehome``'s memory is a mapping of the parameter's own, not the
    allocator's heap: once glibc's mmap threshold has risen (it rises to
    each large block freed, as rehome frees the parameters' first
    storages), the heap keeps freed pages, and vLLM's CPU weight
    processing, which drops a packed linear's weight, left 20 MB resident.
    With the threshold held high here, as it is then, the moved parameter's
    address is unmapped once the parameter is dropped."""
    import ctypes

    libc = ctypes.CDLL(None)
    M_MMAP_THRESHOLD = -3
    assert libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) == 1
    try:
        f = tmp_path / "big.safetensors"
        g = torch.Generator().manual_seed(6)
        st.save_file({"_": torch.zeros(25), "a_part": torch.randn(64, 256, generator=g), "b_part": torch.randn(32, 256, generator=g), "c_emb": torch.randn(37, 256, generator=g)}, str(f))
        reader = native.Reader(str(f))
        model = Big()
        tr, plan = plan_for(model, reader, ["a_part", "b_part", "c_emb"])
        moved = wp.rehome(plan, model, {0: reader}, tr.other_writes)
        assert moved["parameters"] == 2, moved
        wp.fill(plan, {0: reader})
        fused, emb = model.fused.data_ptr(), model.emb.data_ptr()
        assert _mapping_of(fused) is not None and _mapping_of(emb) is not None
        del plan, tr
        model.fused = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        gc.collect()
        assert _mapping_of(fused) is None, "the moved parameter's pages outlived it"
        assert _mapping_of(emb) is not None
    finally:
        libc.mallopt(M_MMAP_THRESHOLD, 128 << 10)


def test_a_changed_checkpoint_never_meets_a_stale_plan(tmp_path):
    """Each load traces its own plan from the headers it opens: a tensor
    whose shape changed between two loads is planned by its new shape,
    and one that the loader can no longer take whole falls back."""
    f = tmp_path / "toy.safetensors"
    tensors = checkpoint(f)
    model = Toy()
    _tr, first = plan_for(model, native.Reader(str(f)), list(tensors))
    assert (0, "q") in first.planned
    tensors["q"] = torch.randn(12, 8)  # 12 rows where the layer takes 16
    st.save_file(tensors, str(f))
    _tr, second = plan_for(model, native.Reader(str(f)), list(tensors))
    assert (0, "q") in second.fallback and (0, "q") not in second.planned, second.fallback


def stand_ins_of(reader, names):
    from weightstream._convert import torch_dtype

    out = []
    for n in names:
        dtype, shape, _nbytes, _off = reader.info(n)
        out.append(wp.StandIn(n, (0, n), torch_dtype(dtype), shape))
    return out


def raw(t):
    return bytes(t.detach().contiguous().view(-1).view(torch.uint8).numpy())


def test_a_kept_plan_read_back_is_the_trace_and_fills_the_same_bytes(tmp_path):
    """_plan_cache: a trace kept and read back into another model of the
    same class has the same writes (keys, boxes, destinations at the same
    places of the new model's parameters), fallbacks, unused tensors and
    loader result; filled, with the fallback run by the loader, every
    parameter's bytes equal the loader's own run."""
    from weightstream import _plan_cache as pc

    f = tmp_path / "toy.safetensors"
    tensors = checkpoint(f)
    reader = native.Reader(str(f))
    names = [n for n in tensors if n != "emb"]  # emb's padding is a write of no tensor
    ins = stand_ins_of(reader, names)
    cache = tmp_path / "plans"
    first = Toy()
    key = pc.digest(first, ins, {"test": 1})
    assert pc.load(str(cache), key, first, ins) == (None, None)
    before = pc.attributes(first)
    tr = wp.trace(first.load_weights, first, ins)
    assert pc.store(str(cache), key, tr, first, before) is None
    model = Toy()
    for p in model.parameters():
        p.data.fill_(float("nan"))
    assert pc.digest(model, ins, {"test": 1}) == key
    got, why = pc.load(str(cache), key, model, ins)
    assert why is None and got is not None
    offsets = lambda m, t: (t.untyped_storage().data_ptr() - next(  # noqa: E731
        p for p in m.parameters() if p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    ).data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
    assert [(w.key, list(w.box), offsets(first, w.dest)) for w in tr.writes] == [
        (w.key, list(w.box), offsets(model, w.dest)) for w in got.writes
    ]
    assert got.fallback == tr.fallback and got.unused == tr.unused and got.loaded == tr.loaded and got.runs == tr.runs == 2
    assert [(ks, offsets(first, v)) for _sk, v, ks in tr.other_writes] == [(ks, offsets(model, v)) for _sk, v, ks in got.other_writes]
    plan = wp.check(got, model, ins)
    assert plan.planned == wp.check(tr, first, ins).planned and plan.planned
    wp.fill(plan, {0: reader})
    model.load_weights((n, tensors[n]) for n in names if (0, n) in plan.fallback)
    ref = Toy()
    for p in ref.parameters():
        p.data.fill_(float("nan"))
    ref.load_weights((n, tensors[n]) for n in names)
    for (n, a), (_, b) in zip(model.named_parameters(), ref.named_parameters()):
        assert raw(a) == raw(b), n


def test_the_plan_cache_keeps_only_what_a_replay_reproduces_and_keys_on_headers_and_layout(tmp_path):
    """Not kept: a loader that zeroes padding (a write of no checkpoint
    tensor), one that sets a module attribute. Another key: a header's
    shape changed, a model of another layout, another context (a rank)."""
    from weightstream import _plan_cache as pc

    f = tmp_path / "toy.safetensors"
    tensors = checkpoint(f)
    reader = native.Reader(str(f))
    ins = stand_ins_of(reader, list(tensors))
    model = Toy()
    before = pc.attributes(model)
    tr = wp.trace(model.load_weights, model, ins)
    why = pc.store(str(tmp_path / "c"), "k", tr, model, before)
    assert why is not None and "no checkpoint tensor" in why, why

    class Flagging(Toy):
        def load_weights(self, weights):
            self.seen = True
            return super().load_weights(weights)

    ins2 = [s for s in ins if s.name != "emb"]
    m2 = Flagging()
    before = pc.attributes(m2)
    tr = wp.trace(m2.load_weights, m2, ins2)
    why = pc.store(str(tmp_path / "c"), "k", tr, m2, before)
    assert why is not None and "attribute seen" in why, why
    assert not (tmp_path / "c" / "k.json").exists()

    key = pc.digest(Toy(), ins2, {"tp": [0, 2]})
    assert pc.digest(Toy(), ins2, {"tp": [1, 2]}) != key
    assert pc.digest(Toy(torch.bfloat16), ins2, {"tp": [0, 2]}) != key
    other = [wp.StandIn(s.name, s.key, s.dtype, (12, 8) if s.name == "q" else s.shape) for s in ins2]
    assert pc.digest(Toy(), other, {"tp": [0, 2]}) != key


def test_a_damaged_or_forged_plan_file_is_refused_before_anything_is_read(tmp_path):
    """A kept plan is untrusted input: a changed byte fails its checksum;
    a file rewritten with a valid checksum but a box outside its tensor, a
    parameter the model lacks, a destination past its parameter's end or
    a tensor the checkpoint lacks is refused, naming why; nothing of the
    model is written."""
    import hashlib
    import json

    from weightstream import _plan_cache as pc

    f = tmp_path / "toy.safetensors"
    tensors = checkpoint(f)
    reader = native.Reader(str(f))
    ins = stand_ins_of(reader, [n for n in tensors if n != "emb"])
    model = Toy()
    key = pc.digest(model, ins, {})
    d = tmp_path / "plans"
    before = pc.attributes(model)
    assert pc.store(str(d), key, wp.trace(model.load_weights, model, ins), model, before) is None
    path = d / f"{key}.json"
    good = json.loads(path.read_text())

    def forged(edit):
        doc = json.loads(json.dumps(good))
        edit(doc["plan"])
        doc["sha256"] = hashlib.sha256(json.dumps(doc["plan"], sort_keys=True).encode()).hexdigest()
        path.write_text(json.dumps(doc))
        target = Toy()
        for p in target.parameters():
            p.data.fill_(7.0)
        got, why = pc.load(str(d), key, target, ins)
        assert got is None and why, why
        assert all((p == 7.0).all() for p in target.parameters())
        return why

    path.write_text(path.read_text().replace('"runs": 2', '"runs": 3'))
    target = Toy()
    got, why = pc.load(str(d), key, target, ins)
    assert got is None and "checksum" in why, why

    def box_out(plan):
        plan["writes"][0][1][0][1] = 10**6

    def no_param(plan):
        plan["writes"][0][2][0] = "nothing.here"

    def past_end(plan):
        plan["writes"][0][2][2] = 10**9

    def no_tensor(plan):
        plan["writes"][0][0] = [0, "not-in-the-checkpoint"]

    assert "box outside" in forged(box_out)
    assert "does not have" in forged(no_param)
    assert "past the end" in forged(past_end)
    assert "checkpoint does not have" in forged(no_tensor)
    path.write_text("{not json")
    got, why = pc.load(str(d), key, Toy(), ins)
    assert got is None and "unreadable" in why, why
