"""A vLLM-shaped Llama for the device check (benches/device/gpu_load_into.py):
the parameters as vLLM's layers hold them on one tensor-parallel rank
(qkv_proj and gate_up_proj fused by rows, o_proj and down_proj column
shards, the embedding and the head row shards, the norms whole), and a
load_weights that does what vLLM's Llama loader and its weight_loaders do
(the stacked-parameter mapping, narrow to the rank's share, copy_ into a
narrowed parameter). No vLLM is needed: the device machine has none.

Two ways to fill it, as the arms compare them:
- ``plan_load``: weightstream's load plan (weightstream._weight_plan, the one
  vLLM's ``weightstream`` format uses): load_weights traced on metadata
  stand-ins, the plan checked, each write read straight into its
  parameter (on a device: pinned staging, copies on a side stream);
- ``loader_load``: what vLLM does with every load format: the checkpoint's
  tensors in host memory (weightstream.load), handed to load_weights, one
  copy per tensor into the device parameter.
"""

import json
import os


def _config(d):
    with open(os.path.join(d, "config.json")) as f:
        return json.load(f)


class VllmShapedLlama:
    """Builds the torch module (``self.module``) lazily so this file
    imports without torch."""

    def __init__(self, torch, d, device, tp_size=2, tp_rank=0, dtype=None):
        self.torch = torch
        c = _config(d)
        dtype = dtype or torch.bfloat16
        h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        heads, kv = c["num_attention_heads"], c.get("num_key_value_heads", c["num_attention_heads"])
        hd = c.get("head_dim") or h // heads
        assert heads % tp_size == 0 and kv % tp_size == 0 and inter % tp_size == 0 and vocab % tp_size == 0
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.q, self.kv, self.inter, self.vocab = heads * hd // tp_size, kv * hd // tp_size, inter // tp_size, vocab // tp_size
        m = torch.nn.Module()
        self.params = {}

        def param(name, *shape):
            p = torch.nn.Parameter(torch.zeros(*shape, dtype=dtype, device=device), requires_grad=False)
            owner = m
            parts = name.split(".")
            for part in parts[:-1]:
                if not hasattr(owner, part):
                    owner.add_module(part, torch.nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(parts[-1], p)
            self.params[name] = p

        param("model.embed_tokens.weight", self.vocab, h)
        param("lm_head.weight", self.vocab, h)
        param("model.norm.weight", h)
        for i in range(c["num_hidden_layers"]):
            L = f"model.layers.{i}."
            param(L + "self_attn.qkv_proj.weight", self.q + 2 * self.kv, h)
            param(L + "self_attn.o_proj.weight", h, self.q)
            param(L + "mlp.gate_up_proj.weight", 2 * self.inter, h)
            param(L + "mlp.down_proj.weight", h, self.inter)
            param(L + "input_layernorm.weight", h)
            param(L + "post_attention_layernorm.weight", h)
        m.load_weights = self.load_weights
        self.module = m

    def rank_bytes(self):
        """Bytes of the rank's parameters (what a plan reads)."""
        return sum(p.numel() * p.element_size() for p in self.params.values())

    def load_weights(self, weights):
        """vLLM's Llama loader on one rank: stacked parameters by rows
        (q, k, v; gate, up), row-parallel layers' columns, vocabulary rows,
        norms whole."""
        stacked = (
            ("qkv_proj", "q_proj", "q"),
            ("qkv_proj", "k_proj", "k"),
            ("qkv_proj", "v_proj", "v"),
            ("gate_up_proj", "gate_proj", 0),
            ("gate_up_proj", "up_proj", 1),
        )
        loaded = set()
        r = self.tp_rank
        for name, w in weights:
            for fused, part, shard in stacked:
                if part not in name:
                    continue
                pname = name.replace(part, fused)
                p = self.params[pname]
                if fused == "qkv_proj":
                    off, n = {"q": (0, self.q), "k": (self.q, self.kv), "v": (self.q + self.kv, self.kv)}[shard]
                else:
                    off, n = shard * self.inter, self.inter
                # QKVParallelLinear / MergedColumnParallelLinear.weight_loader
                p.data.narrow(0, off, n).copy_(w.narrow(0, r * n, n))
                loaded.add(pname)
                break
            else:
                p = self.params[name]
                if name.endswith(("o_proj.weight", "down_proj.weight")):
                    # RowParallelLinear: the rank's input columns.
                    n = p.shape[1]
                    p.data.copy_(w.narrow(1, r * n, n))
                elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                    # VocabParallelEmbedding / ParallelLMHead: the rank's rows.
                    n = p.shape[0]
                    p.data.copy_(w.narrow(0, r * n, n))
                else:
                    p.data.copy_(w)
                loaded.add(name)
        return loaded

    def zero(self):
        with self.torch.no_grad():
            for p in self.params.values():
                p.zero_()

    def state(self):
        return {k: p.data for k, p in self.params.items()}


def plan_load(torch, shaped, d, pipeline=False):
    """Fills ``shaped`` through weightstream's load plan; returns the plan's
    report (trace seconds, bytes by way, planned and fallback tensors)."""
    import time

    import weightstream._native as native
    from weightstream import _weight_plan as wp
    from weightstream._convert import torch_dtype, torch_shape

    reader = native.Reader(d)
    try:
        ins = []
        for name in reader.keys():
            dtype, shape, _nbytes, _off = reader.info(name)
            ins.append(wp.StandIn(name, (0, name), torch_dtype(dtype), torch_shape(dtype, shape, name)))
        t0 = time.perf_counter()
        tr = wp.trace(shaped.load_weights, shaped.module, ins)
        plan = wp.check(tr, shaped.module, ins)
        trace_seconds = time.perf_counter() - t0
        if plan.fallback:
            raise RuntimeError(f"the vLLM-shaped loader fell back: {dict(list(plan.fallback.items())[:4])}")
        got = wp.fill(plan, {0: reader}, pipeline=pipeline)
    finally:
        reader.close()
    got.update(trace_seconds=trace_seconds, planned_tensors=len(plan.planned))
    return got


def loader_load(torch, shaped, d):
    """What vLLM does with every format: host tensors (weightstream.load),
    then load_weights' copies into the parameters."""
    import weightstream

    sd = weightstream.load(d)
    shaped.load_weights(sd.items())
    del sd


def reference(torch, shaped_cls, d, device):
    """The parameters load_weights makes from safetensors' tensors (host),
    once: what both arms must equal."""
    from safetensors.torch import load_file

    ref = shaped_cls(torch, d, device)
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            ref.load_weights(load_file(os.path.join(d, f)).items())
    return ref.state()
