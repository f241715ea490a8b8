#!/usr/bin/env python3
"""One arm of the MoE decode benchmark (benches/moe-decode/bench.sh), in a
process of its own (the bench puts it in a memory cgroup); prints one JSON
object.

    arm.py write DIR                 the benchmark's model: a Qwen3-MoE
                                     (transformers 5's architecture, synthetic
                                     weights) with its experts fused as
                                     transformers holds them, bf16, 4 shards
    arm.py ARM DIR FRACTION BATCH TOKENS [OFFLOAD_DIR]

ARM:
    ws-prefetch    weightstream.transformers.from_pretrained(DIR,
                   expert_budget_bytes=FRACTION x the routed experts' bytes)
    ws-noprefetch  the same, prefetch=False
    tf-offload     transformers' own disk offload: from_pretrained with
                   device_map="auto", max_memory {"cpu": the non-expert weights +
                   FRACTION of the experts}, offload_folder=OFFLOAD_DIR
    mmap           the model's parameters views of mmaps of the shards (llama.cpp's
                   way): pages read on first touch, evicted by the cgroup
    full           transformers' from_pretrained, everything in memory (the
                   bound; run without a limit)

Each builds the model, then decodes TOKENS greedy tokens for BATCH prompts
(16 tokens each); timed: the build/load, and the decode (tokens/s = BATCH x
TOKENS / decode seconds). Reported: the generated tokens (every arm must
agree), the peak RSS, and for the weightstream arms the cache's counters
and per-token steps (hits, misses, prefetch used and wasted, seconds
waited, bytes read).
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import peak_rss  # noqa: E402

CONFIG = dict(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2048,
    moe_intermediate_size=512,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=4,
    decoder_sparse_step=1,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    dtype="bfloat16",
)


def write(d):
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    os.makedirs(d, exist_ok=True)
    config = Qwen3MoeConfig(**CONFIG)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    names = [(n, tuple(p.shape)) for n, p in model.state_dict().items()]
    config.save_pretrained(d)
    g = torch.Generator().manual_seed(48)
    layers = CONFIG["num_hidden_layers"]
    shards = 4

    def shard_of(n):
        if ".layers." not in n:
            return 0 if "embed" in n else shards - 1
        return int(n.split(".layers.")[1].split(".")[0]) * shards // layers

    weight_map = {}
    for s in range(shards):
        part = {}
        for n, shape in names:
            if shard_of(n) != s:
                continue
            if n.endswith("norm.weight"):
                t = 1 + 0.1 * torch.randn(shape, generator=g)
            else:
                t = torch.randn(shape, generator=g) * (0.02 if "embed" in n or "lm_head" in n else 0.06)
            part[n] = t.to(torch.bfloat16)
        f = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, os.path.join(d, f), metadata={"format": "pt"})
        weight_map.update({n: f for n in part})
        del part
    total = sum(os.path.getsize(os.path.join(d, f)) for f in set(weight_map.values()))
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh)
    print(json.dumps(sizes(d)))


def sizes(d):
    """The routed experts' bytes and the rest's, from the headers."""
    import struct

    experts = other = 0
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with open(os.path.join(d, f), "rb") as fh:
                h = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
            for k, v in h.items():
                if k == "__metadata__":
                    continue
                n = v["data_offsets"][1] - v["data_offsets"][0]
                if ".mlp.experts." in k:
                    experts += n
                else:
                    other += n
    return {"expert_bytes": experts, "other_bytes": other}


def mmap_model(d):
    """The model with every parameter a view of a private mmap of its
    shard (no byte read until touched; clean file pages the cgroup can
    evict); buffers computed as at construction."""
    import mmap
    import struct

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    config = AutoConfig.from_pretrained(d)
    with no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation="eager")
    params = dict(model.named_parameters())
    keep = []
    for f in sorted(os.listdir(d)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(d, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            h = json.loads(fh.read(n))
            m = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        keep.append(m)
        for k, v in h.items():
            if k == "__metadata__" or k not in params:
                continue
            a, b = v["data_offsets"]
            t = torch.frombuffer(m, dtype=torch.bfloat16, count=(b - a) // 2, offset=8 + n + a).view(v["shape"])
            params[k].data = t
    model._ws_mmaps = keep
    return model.eval()


def main():
    what, d = sys.argv[1], sys.argv[2]
    if what == "write":
        return write(d)
    frac, batch, tokens = float(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    import torch
    import transformers

    torch.set_num_threads(os.cpu_count() or 1)
    sz = sizes(d)
    budget = int(frac * sz["expert_bytes"])
    out = {"arm": what, "fraction": frac, "batch": batch, "tokens": tokens, **sz, "expert_budget_bytes": budget}
    t0 = time.perf_counter()
    if what in ("ws-prefetch", "ws-noprefetch"):
        import weightstream.transformers as wtf

        model = wtf.from_pretrained(d, dtype=torch.bfloat16, expert_budget_bytes=budget, prefetch=what == "ws-prefetch")
    elif what == "tf-offload":
        off = sys.argv[6]
        limit = sz["other_bytes"] + budget
        model = transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.bfloat16, device_map="auto", max_memory={"cpu": limit}, offload_folder=off,
            experts_implementation="eager",
        ).eval()
        out["offloaded_modules"] = sum(1 for v in getattr(model, "hf_device_map", {}).values() if v == "disk")
    elif what == "mmap":
        model = mmap_model(d)
    elif what == "full":
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16, experts_implementation="eager").eval()
    else:
        raise SystemExit(f"unknown arm {what}")
    out["load_seconds"] = time.perf_counter() - t0
    g = torch.Generator().manual_seed(7)
    prompts = torch.randint(0, CONFIG["vocab_size"], (batch, 16), generator=g)
    t1 = time.perf_counter()
    with torch.no_grad():
        ids = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0)
    secs = time.perf_counter() - t1
    out.update(decode_seconds=secs, tokens_per_second=batch * tokens / secs, generated=ids[:, 16:].tolist(), peak_rss_bytes=peak_rss())
    ws = getattr(model, "weightstream", None)
    if ws is not None and ws.expert_cache is not None:
        st = ws.stats()
        out["experts"] = st["experts"]
        steps = st["steps"][1:]  # the prompt's forward is not a decode step
        out["per_token"] = {k: sum(s[k] for s in steps) / max(len(steps), 1) for k in ("hits", "misses", "prefetch_used", "prefetch_wasted", "wait_seconds", "bytes_read")}
        out["capacity"] = ws.expert_cache.capacity
    print(json.dumps(out))


if __name__ == "__main__":
    main()
