"""``weightstream.torch.load_into``: a checkpoint read straight into the
tensors a model already has. transformers models built from their config
(random init) compute the same logits as ``from_pretrained``'s, to the last
bit (dense and MoE, tied embeddings, experts fused in memory); a
tensor-parallel rank's slices land in its parameters; in-place and
forced-staging reads give the reference reader's bytes; the device
pipeline's logic runs on the CPU; every check happens before a byte is
read."""

import json
import os

import numpy as np
import pytest
from conftest import require, torch_or_skip


def transformers_or_skip():
    return require("transformers")


def same_bytes(torch, a, b):
    """Equal bytes (random payloads hold NaNs, which torch.equal calls
    unequal to themselves)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def logits(model, torch, vocab):
    ids = torch.arange(0, 40).reshape(2, 20) % vocab
    with torch.no_grad():
        return model(input_ids=ids).logits


def saved(tmp_path_factory, name, config, tf, torch, shard="300KB"):
    """A transformers checkpoint of ``config`` (random weights, bf16),
    sharded, as ``save_pretrained`` writes it."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    d = tmp_path_factory.mktemp(name)
    model.save_pretrained(d, max_shard_size=shard)
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(files) > 1 and os.path.exists(d / "model.safetensors.index.json"), files
    return d


def random_init(tf, torch, d):
    """The model built from the checkpoint's config, as from_pretrained
    builds it (dtype, buffers), with random weights of another seed."""
    torch.manual_seed(1234)
    return tf.AutoModelForCausalLM.from_config(tf.AutoConfig.from_pretrained(d), dtype=torch.bfloat16).eval()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch, tf = torch_or_skip(), transformers_or_skip()
    config = tf.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    return saved(tmp_path_factory, "llama", config, tf, torch)


def test_a_llama_built_from_its_config_gives_from_pretrained_logits(llama):
    import weightstream.torch as wt

    torch, tf = torch_or_skip(), transformers_or_skip()
    ref = tf.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16).eval()
    model = random_init(tf, torch, llama)
    assert not torch.equal(logits(model, torch, 512), logits(ref, torch, 512)), "the random init differs"
    r = wt.load_into(model, llama)
    assert r.missing_keys == [] and r.unexpected_keys == []
    assert torch.equal(logits(model, torch, 512), logits(ref, torch, 512))
    # The tied head is read once, under the embedding's name.
    assert r.report["tied"] == {"model.embed_tokens.weight": ["lm_head.weight"]}
    n = sum(t.numel() * t.element_size() for k, t in model.state_dict().items() if k != "lm_head.weight")
    assert r.report["bytes"] == n
    assert r.report["in_place_bytes"] + r.report["staged_bytes"] + r.report["buffered_bytes"] == n
    # Memory: the staging, never the model's size again.
    assert 0 < r.report["staging_bytes"] <= 32 << 20


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_moe_models_with_experts_fused_in_memory_give_from_pretrained_logits(kind, tmp_path_factory):
    import weightstream.torch as wt

    torch, tf = torch_or_skip(), transformers_or_skip()
    common = dict(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2)
    if kind == "mixtral":
        config = tf.MixtralConfig(intermediate_size=96, num_local_experts=4, **common)
    else:
        config = tf.Qwen2MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, **common
        )
    d = saved(tmp_path_factory, kind, config, tf, torch, shard="200KB")
    # Stored one expert at a time, fused per layer in memory.
    stored = json.load(open(d / "model.safetensors.index.json"))["weight_map"]
    assert any(".experts.3." in k for k in stored)
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval()
    model = random_init(tf, torch, d)
    assert any(k.endswith("experts.gate_up_proj") for k in model.state_dict())
    # A transformers model: its own conversions apply without rename=.
    r = wt.load_into(model, d)
    assert r.missing_keys == [] and r.unexpected_keys == []
    assert r.report["rename"].startswith("transformers_rename"), r.report.get("rename")
    assert torch.equal(logits(model, torch, 500), logits(ref, torch, 500))
    # A state dict has no conversions to read: the names do not meet, and
    # the error names the fix in a bounded list.
    with pytest.raises(RuntimeError, match="Missing key") as e:
        wt.load_into(dict(model.state_dict()), d)
    msg = str(e.value)
    assert "Likely fix: the checkpoint stores experts one by one" in msg and "transformers_rename(model)" in msg, msg
    assert "more (" in msg and len(msg) < 6000, len(msg)
    model = random_init(tf, torch, d)
    r = wt.load_into(model, d, rename=wt.transformers_rename(model))
    assert r.missing_keys == [] and r.unexpected_keys == [] and "rename" not in r.report
    assert torch.equal(logits(model, torch, 500), logits(ref, torch, 500))


def test_a_tensor_parallel_ranks_slices_land_in_its_parameters(llama):
    """Rank r of 2: q_proj column-parallel (rows), o_proj row-parallel
    (columns). Each slice equals the reference reader's; the ranks' slices
    put together give from_pretrained's logits."""
    import weightstream.torch as wt
    from safetensors import safe_open

    torch, tf = torch_or_skip(), transformers_or_skip()
    ref = tf.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16).eval()
    rule = {"*.q_proj.weight": (0, None, 2), "*.o_proj.weight": (1, None, 2)}
    where = json.load(open(llama / "model.safetensors.index.json"))["weight_map"]
    ranks = []
    for rank in range(2):
        model = random_init(tf, torch, llama)
        shard = {k: (dim, rank, world) for k, (dim, _r, world) in rule.items()}
        sd = model.state_dict()
        dests = {}
        for k, t in sd.items():
            if k.endswith("q_proj.weight"):
                dests[k] = torch.empty(t.shape[0] // 2, t.shape[1], dtype=t.dtype)
            elif k.endswith("o_proj.weight"):
                dests[k] = torch.empty(t.shape[0], t.shape[1] // 2, dtype=t.dtype)
            else:
                dests[k] = t
        r = wt.load_into(dests, llama, shard=shard)
        assert r.missing_keys == [] and r.unexpected_keys == []
        for k in dests:
            if k.endswith(("q_proj.weight", "o_proj.weight")):
                with safe_open(str(llama / where[k]), framework="pt") as f:
                    s = f.get_slice(k)
                    rows, cols = s.get_shape()
                    want = s[rank * rows // 2 : (rank + 1) * rows // 2] if "q_proj" in k else s[:, rank * cols // 2 : (rank + 1) * cols // 2]
                assert torch.equal(dests[k], want), k
        ranks.append(dests)
    # Put together, the ranks' slices are the model.
    model = random_init(tf, torch, llama)
    with torch.no_grad():
        for k, t in model.state_dict().items():
            if k.endswith("q_proj.weight"):
                t.copy_(torch.cat([ranks[0][k], ranks[1][k]], 0))
            elif k.endswith("o_proj.weight"):
                t.copy_(torch.cat([ranks[0][k], ranks[1][k]], 1))
            else:
                t.copy_(ranks[0][k])
    assert torch.equal(logits(model, torch, 512), logits(ref, torch, 512))


def _in_phase(torch, reader_info, names, align, shift):
    """Destinations in one buffer, each ``shift`` bytes from its phase
    (0: in phase with its file offset, so its whole blocks read in place)."""
    total = sum(reader_info[n][2] for n in names) + (len(names) + 2) * 2 * align
    raw = torch.empty(total + align, dtype=torch.uint8)
    base = (-raw.data_ptr()) % align
    cursor, out = base + align, {}
    for n in names:
        dtype, shape, nbytes, off = reader_info[n]
        at = cursor + ((off + shift - (raw.data_ptr() + cursor)) % align)
        view = raw[at : at + nbytes]
        from weightstream._convert import torch_dtype, torch_shape

        out[n] = view.view(torch_dtype(dtype)).view(torch_shape(dtype, shape)) if nbytes else torch.empty(torch_shape(dtype, shape), dtype=torch_dtype(dtype))
        cursor = at + nbytes + align
    return raw, out


@pytest.mark.parametrize("shift,in_place", [(0, True), (0, False), (8, True)])
def test_in_place_and_staged_reads_give_the_reference_bytes(np_model, shift, in_place):
    import weightstream
    import weightstream.torch as wt
    from safetensors.torch import load_file

    torch = torch_or_skip()
    path, _ = np_model
    ref = load_file(path)
    with weightstream.Engine(path) as e:
        info = {n: e._reader.info(n) for n in e.keys()}
        align = e._reader.direct_align()
    names = sorted(info)
    raw, dests = _in_phase(torch, info, names, align, shift)
    r = wt.load_into(dests, path, in_place=in_place, staging_bytes=256 << 10)
    for n in names:
        assert same_bytes(torch, dests[n], ref[n]), n
    rep = r.report
    assert rep["in_place_bytes"] + rep["staged_bytes"] + rep["buffered_bytes"] == rep["bytes"]
    if not in_place or shift:
        assert rep["in_place_bytes"] == 0 and rep["in_place_reads"] == 0, rep
    elif rep["buffered_reads"] == 0:
        # In phase: every tensor with a whole block lands it in place.
        assert rep["in_place_bytes"] > rep["bytes"] // 2, rep
    assert rep["staging_bytes"] <= (256 << 10) + 2 * align


class _Deferred:
    """A copier whose copies happen only when their event is waited for (as
    a device's run later): a buffer filled again before its event was
    waited for would hand later bytes to earlier destinations."""

    pinned = False

    def __init__(self):
        self.queue, self.n, self.done = [], 0, set()

    def pin(self, buf):
        return False

    def unpin(self, buf):
        pass

    def start(self):
        pass

    def copy(self, dest, src):
        self.queue.append((self.n, dest, src))

    def record(self):
        self.n += 1
        return self.n - 1

    def wait(self, event):
        if event is None:
            return
        for ev, dest, src in [q for q in self.queue if q[0] <= event]:
            dest.copy_(src)
        self.queue = [q for q in self.queue if q[0] > event]

    def finish(self):
        self.wait(self.n)


@pytest.mark.parametrize("copier", ["host", "deferred"])
def test_the_device_pipeline_runs_on_the_cpu_through_small_buffers(copier, np_model, tmp_path):
    """The pipeline device destinations take (pinned buffers, copies that
    run later, a buffer reused only after its event), with CPU tensors as
    destinations: tensors larger than a buffer in parts, row slices and
    column slices, each equal to the reference."""
    import weightstream
    from weightstream import _load_into as li
    from safetensors import safe_open

    torch = torch_or_skip()
    path, _ = np_model
    with safe_open(path, framework="pt") as f:
        names = sorted(n for n in f.keys() if f.get_slice(n).get_shape() and 0 not in f.get_slice(n).get_shape())
        items, want = [], {}
        for n in names:
            t = f.get_tensor(n)
            shape = f.get_slice(n).get_shape()
            if n == "big":
                # Columns of a row-parallel rank and rows of a column-parallel one.
                items.append((n, [(0, shape[0]), (100, 700)], torch.empty(shape[0], 600, dtype=t.dtype)))
                want[len(items) - 1] = t[:, 100:700]
                items.append((n, [(10, 990)], torch.empty(980, shape[1], dtype=t.dtype)))
                want[len(items) - 1] = t[10:990]
            items.append((n, None, torch.empty_like(t)))
            want[len(items) - 1] = t
    reader = weightstream.Engine(path)._reader
    try:
        cp = li._HostCopier() if copier == "host" else _Deferred()
        # 3 buffers of 256 KiB: "big" (2.8 MB) goes in parts.
        pipe = li._Pipeline(reader, cp, 3 * (256 << 10), buffers=3)
        r = pipe.run(items)
    finally:
        reader.close()
    for i, (n, bounds, dest) in enumerate(items):
        assert same_bytes(torch, dest, want[i]), (n, bounds)
    assert r["bytes"] == sum(d.numel() * d.element_size() for _, _, d in items)
    assert r["buffers"] == 3 and r["staging_bytes"] >= 3 * (256 << 10)


def test_every_mismatch_is_refused_before_a_byte_is_read(llama):
    import weightstream.torch as wt

    torch, tf = torch_or_skip(), transformers_or_skip()
    model = random_init(tf, torch, llama)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = dict(model.state_dict())
    sd["model.norm.weight"] = torch.empty(7, dtype=torch.bfloat16)
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"].float()
    sd["extra.weight"] = torch.empty(3)
    del sd["model.layers.1.input_layernorm.weight"]
    with pytest.raises(RuntimeError) as e:
        wt.load_into(sd, llama)
    msg = str(e.value)
    for want in (
        "nothing was read",
        'Missing key(s) in state_dict: "extra.weight"',
        'Unexpected key(s) in state_dict: "model.layers.1.input_layernorm.weight"',
        "size mismatch for model.norm.weight",
        "(128,)",
        "(7,)",
        "dtype mismatch for model.layers.0.mlp.up_proj.weight",
        "torch.float32",
    ):
        assert want in msg, (want, msg)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "nothing was written"
    # The body's names without the checkpoint's "model.": the error says
    # which prefix to pass.
    body = {k[len("model.") :]: v for k, v in model.state_dict().items() if k.startswith("model.")}
    with pytest.raises(RuntimeError, match=r"Likely fix: prefix='model\.'"):
        wt.load_into(body, llama)
    assert wt.load_into(body, llama, prefix="model.", strict=False).missing_keys == []
    # Not strict: the keys come back, and what matches is read.
    sd2 = dict(model.state_dict())
    del sd2["model.layers.1.input_layernorm.weight"]
    sd2["extra.weight"] = torch.empty(3)
    r = wt.load_into(sd2, llama, strict=False)
    assert r.missing_keys == ["extra.weight"] and r.unexpected_keys == ["model.layers.1.input_layernorm.weight"]
    # A cast is never silent: asked for, done, and listed.
    sd3 = {"model.norm.weight": torch.zeros(128, dtype=torch.float32)}
    r = wt.load_into(sd3, llama, strict=False, cast=True)
    ref = tf.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    assert r.report["cast"] == ["model.norm.weight"]
    assert torch.equal(sd3["model.norm.weight"], ref.model.norm.weight.float())
    # The meta device, and overlapping destinations.
    with pytest.raises(RuntimeError, match="meta device"):
        wt.load_into({"model.norm.weight": torch.empty(128, dtype=torch.bfloat16, device="meta")}, llama, strict=False)
    flat = torch.zeros(200, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="overlap"):
        wt.load_into(
            {"model.norm.weight": flat[:128], "model.layers.0.input_layernorm.weight": flat[50:178]}, llama, strict=False
        )


def test_an_expanded_destination_is_refused_in_the_plan_before_any_read(llama):
    """A stride-0 (expanded) destination is listed with the other problems
    before a byte is read, and no other destination is written. Before: the
    plan passed it, the others were filled, then torch's copy_ raised its
    own error."""
    import weightstream.torch as wt

    torch = torch_or_skip()
    norm = torch.full((128,), 3.0, dtype=torch.bfloat16)
    one = torch.full((1,), 5.0, dtype=torch.bfloat16)
    sd = {"model.norm.weight": norm, "model.layers.0.input_layernorm.weight": one.expand(128)}
    with pytest.raises(RuntimeError) as e:
        wt.load_into(sd, llama, strict=False)
    msg = str(e.value)
    assert "nothing was read" in msg and "model.layers.0.input_layernorm.weight" in msg and "overlap" in msg, msg
    assert torch.equal(norm, torch.full((128,), 3.0, dtype=torch.bfloat16)), "another destination was written"
    assert torch.equal(one, torch.full((1,), 5.0, dtype=torch.bfloat16))


def test_copy_threads_have_one_bound_and_never_exceed_the_pieces(llama):
    """copy_threads above the bound C also keeps (256) is refused before a
    read; a small load starts no more copy threads than it stages pieces.
    Before: 1,000 threads for one tensor."""
    import weightstream.torch as wt

    torch = torch_or_skip()
    sd = {"model.norm.weight": torch.empty(128, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="256"):
        wt.load_into(sd, llama, strict=False, copy_threads=1000)
    r = wt.load_into(sd, llama, strict=False, copy_threads=256, in_place=False)
    assert 0 < r.report["copy_threads"] <= r.report["staged_reads"], r.report


def test_a_failed_load_names_the_destinations_left_incomplete(llama, tmp_path, monkeypatch):
    """A shard cut short after it was opened (its header checked): the
    error names the tensors not complete (in the message and as
    ``incomplete``) and those that are (``complete``); every complete one
    holds the checkpoint's bytes. Before: only how many were complete."""
    import shutil
    import types

    import weightstream._load_into as li
    import weightstream.torch as wt

    torch, tf = torch_or_skip(), transformers_or_skip()
    d = tmp_path / "cut"
    shutil.copytree(llama, d)
    ref = tf.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16).state_dict()
    index = json.load(open(d / "model.safetensors.index.json"))["weight_map"]
    shard = sorted(set(index.values()))[0]
    names = sorted(n for n, f in index.items() if f == shard)
    sd = {n: torch.empty_like(ref[n]) for n in names}
    size = os.path.getsize(d / shard)
    real = li._native.Reader

    def cut_after_open(*a, **k):
        r = real(*a, **k)
        with open(d / shard, "r+b") as f:
            f.truncate(size - 1000)
        return r

    monkeypatch.setattr(li, "_native", types.SimpleNamespace(Reader=cut_after_open))
    with pytest.raises(Exception, match="destinations are complete") as e:
        wt.load_into(sd, d, strict=False)
    err = e.value
    assert sorted(err.complete + err.incomplete) == names, (err.complete, err.incomplete)
    assert err.incomplete, "the cut tensor is incomplete"
    for n in err.incomplete[:8]:
        assert n in str(err), (n, str(err))
    for n in err.complete:
        assert same_bytes(torch, sd[n], ref[n]), n


def test_names_with_a_prefix_and_a_rename_hook(llama):
    import weightstream.torch as wt

    torch, tf = torch_or_skip(), transformers_or_skip()
    ref = tf.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    base = random_init(tf, torch, llama).model  # LlamaModel: names without "model."
    r = wt.load_into(base, llama, prefix="model.", rename=lambda n: None if n == "lm_head.weight" else n)
    assert r.missing_keys == [] and r.unexpected_keys == []
    for k, t in base.state_dict().items():
        assert torch.equal(t, ref.model.state_dict()[k]), k
    with pytest.raises(RuntimeError, match="more than one checkpoint tensor maps to"):
        wt.load_into(base, llama, rename=lambda n: "norm.weight")
