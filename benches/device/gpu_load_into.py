#!/usr/bin/env python3
"""load_into a model on a GPU, against the host-to-device copy rate and
the drive's read rate measured in the same run (benches/device/run.sh).

    gpu_load_into.py write MODEL_DIR BYTES
    gpu_load_into.py run MODEL_DIR OUT.json [--device cuda] [--rounds 3]

`run` builds the Llama-shaped model from the checkpoint's config, its
parameters on the device, and then, ROUNDS times, in an order that
rotates by one each round, with a cold cache before each arm where the
machine lets us drop it:

    h2d            the checkpoint's bytes copied host -> device from two
                   pinned 64 MiB buffers, non-blocking on a side stream
                   (the copy rate load_into's pipeline can reach at best)
    load-into      weightstream.torch.load_into(model, dir): O_DIRECT into
                   pinned buffers, each copied on a side stream
    ws-load-lsd    weightstream.load(dir) (host memory), then
                   model.load_state_dict (copies to the device)
    st-load-lsd    safetensors load_file(shard, device=DEVICE) per shard,
                   then model.load_state_dict
    st09-prefetch  safetensors 0.9's prefetch engine: safe_open(shard).
                   prefetch(device=DEVICE) for every shard at once (8
                   pread threads each, 16 MiB pinned slabs, copies on a
                   stream), every tensor taken, then model.load_state_dict
                   (a device-to-device copy); skipped, and said so, with
                   safetensors before 0.9 or on the CPU (it refuses it)
    ws-load        weightstream.load(dir) alone, host memory (the read
                   rate of the module on this drive)
    vllm-plan      the vLLM-shaped case (vllm_shaped.py: one tensor-parallel
                   rank of 2, fused qkv and gate_up, column shards, a
                   load_weights doing what vLLM's does): weightstream's
                   load plan traced from that load_weights, each write read
                   straight into its device parameter (pinned staging,
                   copies on a side stream), only the rank's bytes read
    vllm-loader    the same parameters filled as vLLM fills them with any
                   format: weightstream.load into host memory, then
                   load_weights' per-tensor copies to the device

After every arm that fills the model, each parameter is compared with a
reference read once by safetensors (its bytes, on the device), and the
model is zeroed again. GB/s is over the checkpoint's payload bytes, from
the call to the device's synchronisation. The CPU time of the process
(getrusage) per GB is kept too. `--device cpu` runs every line but the
CUDA ones (a dry run on a machine without a GPU; vllm-plan then goes
through the device pipeline all the same). The vLLM-shaped arms' GB/s are
over the rank's bytes (rank_bytes), compared with a reference that
load_weights made from safetensors' tensors."""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "load_into"))
import arm  # noqa: E402  (the checkpoint writer and the payload count)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_shaped  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from benchlib import cpu_seconds as cpu  # noqa: E402


def can_drop_caches():
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build(torch, d, device):
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(d), dtype=torch.bfloat16)
    model.to_empty(device=device)
    zero(torch, model, device)
    return model


def zero(torch, model, device):
    with torch.no_grad():
        for t in model.state_dict().values():
            t.zero_()
    sync(torch, device)


def reference(torch, d, device):
    from safetensors.torch import load_file

    ref = {}
    for f in sorted(os.listdir(d)):
        if f.endswith(".safetensors"):
            # Copies (copy=True): on the CPU, to() would keep safetensors'
            # tensors, and the pages they map could not be dropped from the
            # cache before each arm.
            ref.update({k: v.to(device, copy=True) for k, v in load_file(os.path.join(d, f)).items()})
    return ref


def equal(torch, model, ref):
    """Every parameter's bytes equal the reference's, compared as bytes:
    the checkpoint's random bit patterns include NaNs, which torch.equal
    on bf16 never calls equal."""

    return equal_state(torch, model.state_dict(), ref)


def equal_state(torch, sd, ref):
    """``sd``'s tensors byte-equal ``ref``'s, every name of ``ref``."""

    def bits(t):
        return t.detach().reshape(-1).view(torch.uint8)

    bad = [k for k, v in ref.items() if not torch.equal(bits(sd[k]), bits(v))]
    return not bad, bad[:5]


def h2d(torch, n, device):
    """The checkpoint's bytes, host -> device, from two pinned buffers, as
    load_into's pipeline moves them."""
    buf = 64 << 20
    pinned = [torch.empty(buf, dtype=torch.uint8, pin_memory=device.type == "cuda") for _ in range(2)]
    for p in pinned:
        p.fill_(1)
    dest = torch.empty(n, dtype=torch.uint8, device=device)
    if device.type == "cuda":
        stream = torch.cuda.Stream(device)
        done = [None, None]
    t0 = time.perf_counter()
    at, i = 0, 0
    while at < n:
        k = min(buf, n - at)
        if device.type == "cuda":
            if done[i] is not None:
                done[i].synchronize()
            with torch.cuda.stream(stream):
                dest[at : at + k].copy_(pinned[i][:k], non_blocking=True)
                done[i] = torch.cuda.Event()
                done[i].record(stream)
        else:
            dest[at : at + k].copy_(pinned[i][:k])
        at += k
        i ^= 1
    sync(torch, device)
    secs = time.perf_counter() - t0
    del dest
    return secs


def one(torch, name, model, d, n, device, shaped=None):
    import weightstream
    import weightstream.torch as wt

    out = {"arm": name}
    if name.startswith("vllm-"):
        n = shaped.rank_bytes()
        out["rank_bytes"] = n
    c0, t0 = cpu(), time.perf_counter()
    if name == "vllm-plan":
        out["report"] = vllm_shaped.plan_load(torch, shaped, d, pipeline=device.type != "cuda")
        sync(torch, device)
        secs = time.perf_counter() - t0
    elif name == "vllm-loader":
        vllm_shaped.loader_load(torch, shaped, d)
        sync(torch, device)
        secs = time.perf_counter() - t0
    elif name == "h2d":
        secs = h2d(torch, n, device)
    elif name == "load-into":
        r = wt.load_into(model, d)
        sync(torch, device)
        secs = time.perf_counter() - t0
        assert not r.missing_keys and not r.unexpected_keys, r
        out["report"] = {k: v for k, v in r.report.items() if k != "tied"}
    elif name == "ws-load-lsd":
        sd = weightstream.load(d)
        model.load_state_dict(sd, strict=True)
        sync(torch, device)
        secs = time.perf_counter() - t0
        del sd
    elif name == "st-load-lsd":
        from safetensors.torch import load_file

        sd = {}
        dev = str(device)
        for f in sorted(os.listdir(d)):
            if f.endswith(".safetensors"):
                sd.update(load_file(os.path.join(d, f), device=dev))
        model.load_state_dict(sd, strict=True)
        sync(torch, device)
        secs = time.perf_counter() - t0
        del sd
    elif name == "st09-prefetch":
        from safetensors import safe_open

        loaders = [safe_open(os.path.join(d, f), framework="pt").prefetch(device=str(device), threads=8)
                   for f in sorted(os.listdir(d)) if f.endswith(".safetensors")]
        sd = {}
        for ld in loaders:
            sd.update(dict(ld))
            ld.close()
        model.load_state_dict(sd, strict=True)
        sync(torch, device)
        secs = time.perf_counter() - t0
        del sd, loaders
    elif name == "ws-load":
        sd = weightstream.load(d)
        secs = time.perf_counter() - t0
        del sd
    else:
        raise SystemExit(f"unknown arm {name}")
    out.update(seconds=secs, gbps=n / secs / 1e9, cpu_seconds_per_gb=(cpu() - c0) / (n / 1e9))
    return out


def run(args):
    import torch
    import weightstream

    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        # An explicit index: safetensors' prefetch takes cuda:N.
        device = torch.device("cuda", torch.cuda.current_device())
    d = args.model
    n = arm.payload_bytes(d)
    cold = can_drop_caches()
    model = build(torch, d, device)
    ref = reference(torch, d, device)
    arms = args.arms.split(",")
    shaped = vref = None
    if any(a.startswith("vllm-") for a in arms):
        shaped = vllm_shaped.VllmShapedLlama(torch, d, device)
        vref = vllm_shaped.reference(torch, vllm_shaped.VllmShapedLlama, d, device)
    skipped = {}
    if "st09-prefetch" in arms:
        from importlib.metadata import version

        v = version("safetensors")
        if not v.startswith("0.9") or device.type != "cuda":
            skipped["st09-prefetch"] = f"safetensors {v} on {device.type}: its prefetch engine needs 0.9 and a CUDA device"
            arms.remove("st09-prefetch")
            print(f"skipped st09-prefetch: {skipped['st09-prefetch']}", flush=True)
    rounds = []
    result = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bytes": n,
        "cold_cache": cold,
        "versions": {"torch": torch.__version__, "weightstream": weightstream.__version__, "python": sys.version.split()[0],
                     "safetensors": __import__("importlib.metadata").metadata.version("safetensors")},
        "skipped": skipped,
        "rounds": rounds,
    }
    for r in range(args.rounds):
        k = r % len(arms)
        for name in arms[k:] + arms[:k]:
            if cold:
                can_drop_caches()
            got = one(torch, name, model, d, n, device, shaped)
            got["round"] = r + 1
            if name in ("load-into", "ws-load-lsd", "st-load-lsd", "st09-prefetch"):
                got["equal"], got["differs"] = equal(torch, model, ref)
                zero(torch, model, device)
            elif name.startswith("vllm-"):
                got["equal"], got["differs"] = equal_state(torch, shaped.state(), vref)
                shaped.zero()
                sync(torch, device)
            rounds.append(got)
            extra = ""
            if "report" in got:
                rep = got["report"]
                of = got.get("rank_bytes", n)
                extra = f"  in place {rep.get('in_place_bytes', 0) / of:.0%}, device {rep.get('device_bytes', 0) / of:.0%}"
            print(
                f"round {r + 1} {name:12s} {got['gbps']:7.3f} GB/s {got['seconds']:7.3f} s"
                f"  CPU {got['cpu_seconds_per_gb']:.3f} s/GB"
                + ("" if "equal" not in got else f"  equal {got['equal']}")
                + extra,
                flush=True,
            )
    med = {a: statistics.median(x["gbps"] for x in rounds if x["arm"] == a) for a in arms}
    result["median_gbps"] = med
    if "h2d" in med and "load-into" in med:
        result["load_into_over_h2d"] = med["load-into"] / med["h2d"]
    if "ws-load" in med and "load-into" in med:
        result["load_into_over_ws_load"] = med["load-into"] / med["ws-load"]
    if "vllm-plan" in med and "vllm-loader" in med:
        result["vllm_plan_over_loader"] = med["vllm-plan"] / med["vllm-loader"]
    if "vllm-plan" in med and "h2d" in med:
        result["vllm_plan_over_h2d"] = med["vllm-plan"] / med["h2d"]
    if "st09-prefetch" in med and "load-into" in med:
        result["load_into_over_st09_prefetch"] = med["load-into"] / med["st09-prefetch"]
    result["all_equal"] = all(x.get("equal", True) for x in rounds)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rounds"}, indent=1))
    return 0 if result["all_equal"] else 1


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "write":
        return arm.write(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["run"])
    p.add_argument("model")
    p.add_argument("out")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--arms", default="h2d,load-into,ws-load-lsd,st-load-lsd,st09-prefetch,ws-load,vllm-plan,vllm-loader")
    return run(p.parse_args())


if __name__ == "__main__":
    sys.exit(main())
