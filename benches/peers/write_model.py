#!/usr/bin/env python3
"""Writes a reference model with safetensors.torch: a Llama-shaped BF16
checkpoint in shards of at most --shard-bytes, plus the
model.safetensors.index.json that transformers' save_pretrained writes.

    write_model.py DIR [--bytes 1.91e9] [--shard-bytes 4.2e8] [--seed 1]

The tensor shapes are a small Llama's (hidden 2048, intermediate 5632,
GQA with 4 key/value heads, vocab 32000); layers are added until the
model holds about --bytes. Content is pseudo-random BF16 (never all
zeros: a loader that skipped a read would be caught by the digests).
"""
import argparse
import json
import os
import sys

import torch
from safetensors.torch import save_file


def layer_tensors(i, hidden, inter, kv):
    p = f"model.layers.{i}."
    return [
        (p + "input_layernorm.weight", (hidden,)),
        (p + "self_attn.q_proj.weight", (hidden, hidden)),
        (p + "self_attn.k_proj.weight", (kv, hidden)),
        (p + "self_attn.v_proj.weight", (kv, hidden)),
        (p + "self_attn.o_proj.weight", (hidden, hidden)),
        (p + "post_attention_layernorm.weight", (hidden,)),
        (p + "mlp.gate_proj.weight", (inter, hidden)),
        (p + "mlp.up_proj.weight", (inter, hidden)),
        (p + "mlp.down_proj.weight", (hidden, inter)),
    ]


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--bytes", type=float, default=1.91e9)
    ap.add_argument("--shard-bytes", type=float, default=4.2e8)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    hidden, inter, kv, vocab = 2048, 5632, 256, 32000
    names = [("model.embed_tokens.weight", (vocab, hidden))]
    tail = [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    total = sum(numel(s) * 2 for _, s in names + tail)
    i = 0
    while True:
        lt = layer_tensors(i, hidden, inter, kv)
        b = sum(numel(s) * 2 for _, s in lt)
        if total + b > a.bytes and i > 0:
            break
        names += lt
        total += b
        i += 1
    names += tail
    g = torch.Generator().manual_seed(a.seed)
    shards, cur, cur_bytes = [], [], 0
    for n, s in names:
        b = numel(s) * 2
        if cur and cur_bytes + b > a.shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append((n, s))
        cur_bytes += b
    shards.append(cur)
    os.makedirs(a.dir, exist_ok=True)
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for n, s in shard:
            t = torch.randn(s, generator=g, dtype=torch.float32).to(torch.bfloat16)
            tensors[n] = t
            weight_map[n] = fname
        save_file(tensors, os.path.join(a.dir, fname), metadata={"format": "pt"})
    with open(os.path.join(a.dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    print(f"{a.dir}: {i} layers, {len(names)} tensors, {total} bytes in {len(shards)} shards", file=sys.stderr)


if __name__ == "__main__":
    main()
