#!/usr/bin/env python3
"""One arm of the load_into benchmark (benches/load_into/bench.sh), in a
process of its own; prints one JSON object.

    arm.py write MODEL_DIR BYTES     a Llama-shaped bf16 checkpoint of about BYTES,
                                     written by transformers (save_pretrained, sharded)
    arm.py load-into MODEL_DIR       weightstream.torch.load_into(model, MODEL_DIR)
    arm.py ws-load-lsd MODEL_DIR     weightstream.load(MODEL_DIR), then model.load_state_dict
    arm.py st-load-lsd MODEL_DIR     safetensors.torch.load_file per shard, then load_state_dict
    arm.py ws-load MODEL_DIR         weightstream.load(MODEL_DIR) alone (fresh memory; no model)
    arm.py tf-from-pretrained MODEL_DIR   transformers' AutoModelForCausalLM.from_pretrained
    arm.py tf-patch MODEL_DIR        the same under weightstream.transformers.patch()
    arm.py ws-from-pretrained MODEL_DIR   weightstream.transformers.from_pretrained

The three from-pretrained arms time the whole way to a ready model (built
from the config, loaded, then one forward of one token: transformers 5
leaves its parameters views of the files' mmaps, read when first touched;
bfloat16, the checkpoint's dtype), from a process that has imported torch,
transformers and the model's classes: their RSS added is what the model
and its load take over that baseline.

Every arm but ws-load first builds the model from the checkpoint's config
with its parameters allocated and touched (on the meta device, to_empty on
the CPU, every parameter zeroed: the memory a random init would have
touched, without its minutes of random numbers), then times the load.
Reported: the seconds of the load (and of its read part, for the two-step
arms), GB/s over the checkpoint's payload bytes, the process's CPU (user +
system, getrusage) over the load per GB, the RSS before the load (the
allocated model) and the peak RSS after it, their difference (what the load
added), and a digest of the model's bytes afterwards (every arm that fills
the model must agree)."""

import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import cpu_seconds as cpu, peak_rss, rss_now  # noqa: E402


def payload_bytes(d):
    import struct

    total = 0
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            with open(os.path.join(d, f), "rb") as fh:
                n = struct.unpack("<Q", fh.read(8))[0]
                h = json.loads(fh.read(n))
            total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in h.items() if k != "__metadata__")
    return total


def write(d, size):
    import torch
    from transformers import LlamaConfig, AutoModelForCausalLM

    # About `size` bytes of bf16: hidden 2048, MLP 5632, vocab 32000,
    # untied head; the layers make up the rest (45.1 M parameters each).
    fixed = 2 * 32000 * 2048 + 2 * 2048
    layers = max(1, round((float(size) / 2 - fixed) / 45_092_864))
    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            # Bytes that differ everywhere (a digest catches a misplaced
            # byte), cheaper than a normal init.
            p.view(torch.int16).copy_(torch.randint(-30000, 30000, p.shape, generator=g, dtype=torch.int16))
    model.save_pretrained(d, max_shard_size="500MB")
    print(json.dumps({"dir": d, "layers": layers, "bytes": payload_bytes(d)}))


def allocated_model(d):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_()
    return model


def digest(model):
    import torch

    h = hashlib.sha256()
    for k, t in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main():
    what, d = sys.argv[1], sys.argv[2]
    if what == "write":
        return write(d, sys.argv[3])
    import torch
    import weightstream
    import weightstream.torch as wt

    n = payload_bytes(d)
    out = {"arm": what, "bytes": n}
    pretrained = what in ("tf-from-pretrained", "tf-patch", "ws-from-pretrained")
    if pretrained:
        # The baseline: torch's and transformers' imports, the config and
        # model classes included (transformers imports them lazily, 2-3 s
        # here, the same for every arm; a serving process pays it once).
        import transformers
        import transformers.initialization  # noqa: F401
        import weightstream.transformers as wtf

        cfg = transformers.AutoConfig.from_pretrained(d)
        transformers.AutoModelForCausalLM._model_mapping[type(cfg)]  # noqa: B018 - imports the model's module
    model = None if what == "ws-load" or pretrained else allocated_model(d)
    base_rss, base_peak = rss_now(), peak_rss()
    c0, t0 = cpu(), time.perf_counter()
    if what == "load-into":
        r = wt.load_into(model, d)
        out["report"] = {k: v for k, v in r.report.items() if k not in ("tied",)}
        assert not r.missing_keys and not r.unexpected_keys, r
    elif what == "ws-load-lsd":
        sd = weightstream.load(d)
        out["read_seconds"] = time.perf_counter() - t0
        model.load_state_dict(sd, strict=True)
    elif what == "st-load-lsd":
        from safetensors.torch import load_file

        sd = {}
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                sd.update(load_file(os.path.join(d, f)))
        out["read_seconds"] = time.perf_counter() - t0
        model.load_state_dict(sd, strict=True)
    elif what == "ws-load":
        sd = weightstream.load(d)
    elif what == "tf-from-pretrained":
        model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
    elif what == "tf-patch":
        with wtf.patch() as p:
            model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
        out["files_through_weightstream"] = len(p.opened)
        assert p.opened, "the patch read nothing"
    elif what == "ws-from-pretrained":
        model = wtf.from_pretrained(d, dtype=torch.bfloat16)
        out["report"] = {k: v for k, v in model.weightstream.report.items() if k not in ("tied", "cast", "rename")}
        out["build_seconds"] = model.weightstream.build_seconds
    else:
        raise SystemExit(f"unknown arm {what}")
    if pretrained:
        # Ready: one forward of one token. transformers 5 leaves its
        # parameters views of the files' mmaps, read on first touch: the
        # first forward reads them.
        out["from_pretrained_seconds"] = time.perf_counter() - t0
        with torch.no_grad():
            model(input_ids=torch.tensor([[1]]))
    secs, c = time.perf_counter() - t0, cpu() - c0
    out.update(
        load_seconds=secs,
        gbps=n / secs / 1e9,
        cpu_seconds_per_gb=c / (n / 1e9),
        rss_before_bytes=base_rss,
        peak_rss_before_bytes=base_peak,
        peak_rss_bytes=peak_rss(),
        added_rss_bytes=peak_rss() - base_rss,
        versions={"torch": torch.__version__, "weightstream": weightstream.__version__},
    )
    if model is not None:
        try:
            import safetensors

            out["versions"]["safetensors"] = safetensors.__version__
        except ImportError:
            pass
        out["digest"] = digest(model)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
