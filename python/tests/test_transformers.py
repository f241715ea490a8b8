"""A real client: transformers computes the same logits from weightstream's
state dicts as from its own loading, to the last bit."""

import os

import pytest
from conftest import require, torch_or_skip


def transformers_or_skip():
    return require("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch = torch_or_skip()
    tf = transformers_or_skip()
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        torch_dtype="bfloat16",
    )
    model = tf.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    d = tmp_path_factory.mktemp("llama")
    # Sharded, as real checkpoints are: several files and their index.
    model.save_pretrained(d, safe_serialization=True, max_shard_size="300KB")
    files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    assert len(files) > 1 and os.path.exists(d / "model.safetensors.index.json"), files
    return d, config


def logits(model, torch):
    ids = torch.arange(0, 40).reshape(2, 20) % 512
    with torch.no_grad():
        return model(input_ids=ids).logits


def fresh(tf, torch, d):
    """The model as transformers builds it for these files (its own dtype
    handling of buffers such as the rotary frequencies)."""
    return tf.LlamaForCausalLM.from_pretrained(d, torch_dtype=torch.bfloat16).eval()


def test_logits_equal_with_weightstreams_state_dicts(llama):
    torch = torch_or_skip()
    tf = transformers_or_skip()
    import weightstream
    import weightstream.torch as wt

    d, _ = llama
    ref = fresh(tf, torch, d)
    want = logits(ref, torch)
    ref_sd = ref.state_dict()

    for how, sd in (
        # The whole model in one call.
        ("weightstream.load", weightstream.load(d)),
        # Shard by shard, as safetensors.torch.load_file is used.
        ("weightstream.torch.load_file", {k: v for f in sorted(os.listdir(d)) if f.endswith(".safetensors") for k, v in wt.load_file(d / f).items()}),
    ):
        for k, v in sd.items():
            assert v.dtype == ref_sd[k].dtype and torch.equal(v.view(torch.uint8), ref_sd[k].contiguous().view(torch.uint8)), (how, k)
        m = fresh(tf, torch, d)
        # Every parameter replaced by weightstream's tensor (the same
        # structure, so only the weights' source differs).
        with torch.no_grad():
            for k, p in m.named_parameters():
                if k in sd:
                    p.set_(sd[k])
        assert all(m.get_parameter(k).data_ptr() == sd[k].data_ptr() for k, _ in m.named_parameters() if k in sd), how
        got = logits(m, torch)
        assert got.dtype == want.dtype and torch.equal(got, want), how


def test_patch_reads_from_pretrained_through_weightstream_bit_equal(llama):
    """weightstream.transformers.patch(): transformers' own from_pretrained
    opens every shard through weightstream's safe_open (each binding
    transformers made of safetensors' safe_open replaced), logits equal
    bit for bit, and undo puts every binding back."""
    torch = torch_or_skip()
    tf = transformers_or_skip()
    import safetensors
    import transformers.modeling_utils as mu

    import weightstream
    import weightstream.transformers as wtf

    d, _ = llama
    want = logits(fresh(tf, torch, d), torch)
    shards = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
    with wtf.patch() as p:
        assert ("transformers.modeling_utils", "safe_open") in p.bindings, p.bindings
        assert mu.safe_open is not safetensors.safe_open
        # Whatever module a call goes through, the file is weightstream's.
        with mu.safe_open(str(d / shards[0]), framework="pt") as f:
            assert isinstance(f, weightstream.safe_open)
        p.opened.clear()
        got = logits(fresh(tf, torch, d), torch)
        opened = sorted(os.path.basename(f) for f in p.opened)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert sorted(set(opened)) == shards, opened
    for name, attr in p.bindings:
        import sys

        assert getattr(sys.modules[name], attr) is safetensors.safe_open, (name, attr)
    # A plain call, undone (twice is fine); nested patches undo innermost first.
    outer = wtf.patch()
    inner = wtf.patch()
    assert mu.safe_open == inner._open
    with pytest.raises(RuntimeError, match="innermost"):
        outer.undo()
    inner.undo()
    assert mu.safe_open == outer._open
    outer.undo()
    outer.undo()
    assert mu.safe_open is safetensors.safe_open


def tiny_models(tf, torch, d):
    """A dense Llama (tied embeddings), Mixtral (experts w1/w2/w3),
    Qwen2-MoE (a shared expert and its gate), Qwen3-MoE and OLMoE
    (q/k norms, experts gate/up/down), each saved by transformers in
    float32 and bfloat16, in several shards: {name-dtype: folder}."""
    common = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=128)
    makers = {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(intermediate_size=160, tie_word_embeddings=True, **common)),
        "mixtral": lambda: tf.MixtralForCausalLM(tf.MixtralConfig(intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, **common)),
        "qwen2moe": lambda: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
            intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=80, num_experts=6,
            num_experts_per_tok=2, decoder_sparse_step=1, **common)),
        "qwen3moe": lambda: tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=48, head_dim=16, num_experts=6, num_experts_per_tok=2,
            decoder_sparse_step=1, **common)),
        "olmoe": lambda: tf.OlmoeForCausalLM(tf.OlmoeConfig(intermediate_size=48, num_experts=6, num_experts_per_tok=2, **common)),
    }
    out = {}
    for name, make in makers.items():
        torch.manual_seed(48)
        model = make()
        for p in model.parameters():
            # Every weight away from transformers' init (norms of ones
            # included): a weight left unloaded shows in the logits.
            p.data.normal_(0, 0.2, generator=torch.Generator().manual_seed(p.numel()))
        for dtype in ("float32", "bfloat16"):
            path = d / f"{name}-{dtype}"
            model.to(getattr(torch, dtype)).save_pretrained(path, max_shard_size="100KB")
            assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 3, path
            out[f"{name}-{dtype}"] = path
    return out


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    torch = torch_or_skip()
    tf = transformers_or_skip()
    return tiny_models(tf, torch, tmp_path_factory.mktemp("zoo"))


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen2moe", "qwen3moe", "olmoe"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_from_pretrained_gives_transformers_logits_to_the_last_bit(zoo, name, dtype):
    """weightstream.transformers.from_pretrained (built from the config,
    weights not initialized, filled by load_into) against
    transformers.from_pretrained on the same folder: logits bit-equal,
    every parameter and buffer equal, the model in eval mode, and every
    weight read by weightstream (a parameter left unread would show)."""
    torch = torch_or_skip()
    tf = transformers_or_skip()
    import weightstream.transformers as wtf

    d = zoo[f"{name}-{dtype}"]
    dt = getattr(torch, dtype)
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=dt).eval()
    ours = wtf.from_pretrained(d, dtype=dt)
    assert type(ours) is type(ref) and not ours.training
    ids = torch.arange(3, 43).reshape(2, 20) % 384
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits, ours(input_ids=ids).logits
    assert a.dtype == b.dtype == dt
    assert torch.equal(a.view(torch.uint8) if dt == torch.bfloat16 else a, b.view(torch.uint8) if dt == torch.bfloat16 else b)
    rs, os_ = dict(ref.named_parameters()), dict(ours.named_parameters())
    assert sorted(rs) == sorted(os_)
    for k in rs:
        assert torch.equal(rs[k], os_[k]), k
    for (k, x), (_, y) in zip(ref.named_buffers(), ours.named_buffers()):
        assert torch.equal(x, y), k
    rep = ours.weightstream.report
    assert rep["tensors"] > 0 and rep["bytes"] > 0 and not ours.weightstream.ignored, ours.weightstream.stats()
    if name == "llama":
        assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()


def test_from_pretrained_converts_dtypes_as_transformers_and_refuses_what_it_cannot_fill(zoo, tmp_path):
    """dtype None is "auto" (the config's), as in transformers 5; float32
    converts a bfloat16 checkpoint as transformers does; a checkpoint
    missing a weight raises naming it (never a weight left at random);
    an expert budget on a dense model is refused."""
    import shutil

    torch = torch_or_skip()
    tf = transformers_or_skip()
    import weightstream.transformers as wtf
    from safetensors.torch import load_file, save_file

    d = zoo["qwen3moe-bfloat16"]
    assert next(wtf.from_pretrained(d).parameters()).dtype == torch.bfloat16
    assert next(tf.AutoModelForCausalLM.from_pretrained(d).parameters()).dtype == torch.bfloat16
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = wtf.from_pretrained(d, dtype="float32")
    assert next(ours.parameters()).dtype == torch.float32
    for (k, x), (_, y) in zip(ref.state_dict().items(), ours.state_dict().items()):
        assert torch.equal(x, y), k
    assert ours.weightstream.report["cast"], "the conversions are listed"
    broken = tmp_path / "broken"
    shutil.copytree(d, broken)
    shard = sorted(f for f in os.listdir(broken) if f.endswith(".safetensors"))[0]
    t = load_file(str(broken / shard))
    gone = sorted(t)[0]
    del t[gone]
    save_file(t, str(broken / shard), metadata={"format": "pt"})
    idx = broken / "model.safetensors.index.json"
    import json

    j = json.loads(idx.read_text())
    del j["weight_map"][gone]
    idx.write_text(json.dumps(j))
    with pytest.raises(RuntimeError, match="does not fill"):
        wtf.from_pretrained(broken, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="no fused experts modules"):
        wtf.from_pretrained(zoo["llama-float32"], expert_capacity=2)
    with pytest.raises(FileNotFoundError):
        wtf.from_pretrained(tmp_path / "nothing-here")


MOE = ["mixtral", "qwen2moe", "qwen3moe", "olmoe"]


def raw(t, torch):
    return t.view(torch.uint8) if t.dtype == torch.bfloat16 else t


@pytest.mark.parametrize("name", MOE)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_experts_streamed_at_a_quarter_of_them_give_the_whole_models_tokens_and_logits(zoo, name, dtype):
    """from_pretrained with expert_capacity at 25% of the routed experts
    (3 of 2 layers x 4-6): the experts' fused parameters are never part of
    the model (no gate_up_proj/down_proj in its state dict), every expert
    the router picks comes from the ExpertCache; the logits equal the
    whole model's under transformers' eager experts to the last bit, and
    32 greedy tokens are the same. Each forward is a step in the stats."""
    torch = torch_or_skip()
    tf = transformers_or_skip()
    import weightstream.transformers as wtf

    d = zoo[f"{name}-{dtype}"]
    dt = getattr(torch, dtype)
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=dt, experts_implementation="eager").eval()
    ours = wtf.from_pretrained(d, dtype=dt, expert_capacity=3)
    assert not [k for k in ours.state_dict() if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    cache = ours.weightstream.expert_cache
    assert cache.capacity == 3
    ids = torch.arange(3, 43).reshape(2, 20) % 384
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits, ours(input_ids=ids).logits
    assert torch.equal(raw(a, torch), raw(b, torch))
    prompt = ids[:1, :5]
    want = ref.generate(prompt, max_new_tokens=32, do_sample=False)
    got = ours.generate(prompt, max_new_tokens=32, do_sample=False)
    assert torch.equal(want, got)
    st = ours.weightstream.stats()
    assert len(st["steps"]) == 1 + 32 and st["experts"]["misses"] > 0 and st["experts"]["bytes_read"] > 0
    assert all(s["hits"] + s["misses"] > 0 for s in st["steps"])


def test_prefetch_on_and_off_give_the_same_tokens_and_prefetch_is_counted(zoo):
    torch = torch_or_skip()
    transformers_or_skip()
    import weightstream.transformers as wtf

    d = zoo["qwen3moe-bfloat16"]
    prompt = (torch.arange(5) + 7).reshape(1, 5)
    runs = {}
    for prefetch in (True, False, 2):
        m = wtf.from_pretrained(d, expert_capacity=4, prefetch=prefetch)
        runs[prefetch] = (m.generate(prompt, max_new_tokens=32, do_sample=False), m.weightstream.stats())
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[2][0], runs[False][0])
    assert runs[True][1]["experts"]["prefetched"] > 0
    assert runs[2][1]["experts"]["prefetched"] >= runs[True][1]["experts"]["prefetched"]
    assert runs[False][1]["experts"]["prefetched"] == 0
    with pytest.raises(ValueError, match="prefetch"):
        wtf.from_pretrained(d, expert_capacity=4, prefetch="yes")


def test_a_truncated_expert_shard_fails_the_step_naming_the_file_and_the_next_step_after_the_fix_works(zoo, tmp_path):
    """A shard of expert tensors cut short after the model was built: the
    forward that needs one of them raises naming the file (no logits are
    returned); the file put back, the next forward gives the whole model's
    logits."""
    import json
    import shutil

    torch = torch_or_skip()
    tf = transformers_or_skip()
    import weightstream.transformers as wtf

    src = zoo["qwen3moe-float32"]
    d = tmp_path / "m"
    shutil.copytree(src, d)
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    per = {}
    for k, f in wm.items():
        per.setdefault(f, [0, 0])[".experts." in k] += 1
    # A shard of experts only, so that the rest of the model is whole.
    shard = next(f for f, (other, experts) in sorted(per.items()) if experts and not other)
    ours = wtf.from_pretrained(d, expert_capacity=3)
    ref = tf.AutoModelForCausalLM.from_pretrained(src, experts_implementation="eager").eval()
    ids = torch.arange(3, 43).reshape(2, 20) % 384
    good = (d / shard).read_bytes()
    (d / shard).write_bytes(good[: len(good) // 2])
    with pytest.raises(Exception) as e:
        with torch.no_grad():
            ours(input_ids=ids)
    assert shard in str(e.value), e.value
    (d / shard).write_bytes(good)
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits, ours(input_ids=ids).logits
    assert torch.equal(a, b)


def test_a_checkpoint_with_fused_experts_is_streamed_by_rows(zoo, tmp_path):
    """A checkpoint saved in transformers 5's own layout (experts.gate_up_proj
    [E, 2I, H], experts.down_proj [E, H, I] per layer): the cache reads
    each expert's rows of the fused tensors (no gate/up assembly), the
    logits equal the whole model's under eager experts."""
    import shutil

    torch = torch_or_skip()
    tf = transformers_or_skip()
    import weightstream.transformers as wtf
    from safetensors.torch import save_file

    src = zoo["qwen3moe-bfloat16"]
    ref = tf.AutoModelForCausalLM.from_pretrained(src, experts_implementation="eager").eval()
    d = tmp_path / "fused"
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    sd = {k: v.contiguous() for k, v in ref.state_dict().items() if k != "lm_head.weight" or not ref.config.tie_word_embeddings}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    ours = wtf.from_pretrained(d, expert_capacity=3)
    lay = ours.weightstream._streamer.layouts[0]["sources"]
    assert lay == {"gate_up_proj": [("gate_up_proj", None)], "down_proj": [("down_proj", None)]}, lay
    ids = torch.arange(3, 43).reshape(2, 20) % 384
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits, ours(input_ids=ids).logits
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert ours.weightstream.stats()["experts"]["misses"] > 0
