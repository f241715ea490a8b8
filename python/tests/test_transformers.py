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
