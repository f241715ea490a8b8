#!/usr/bin/env python3
"""One arm of the vLLM load-format benchmark (benches/vllm/bench.sh), in a
process of its own; prints one JSON object.

    arm.py vllm FORMAT MODEL_DIR     vLLM builds the model with --load-format FORMAT
    arm.py vllm-tp2 FORMAT MODEL_DIR the same with two tensor-parallel workers (spawned,
                                     vLLM's default)

FORMAT: a vLLM load format, or weightstream-noplan (the weightstream
format with {"plan": false}), weightstream-nocache ({"plan_cache": false}:
the plan traced at every load);
WS_VLLM_EXTRA (JSON) adds options to the weightstream format's.
    arm.py ws-load MODEL_DIR         weightstream.load(MODEL_DIR) alone (the reference)
    arm.py write-config MODEL_DIR    writes config.json for write_model.py's checkpoint

vllm: the engine core and its worker run in this process (vLLM's "uni"
executor, VLLM_ENABLE_V1_MULTIPROCESSING=0), so the timings, the CPU and
the peak RSS are this process's: the same loaders, without the process
startup vLLM adds around them. Timed: every loader's load_weights (what vLLM
logs as "Loading weights took" for its default loader, wrapped here the same
way for every loader), and the whole LLM(...) construction. CPU: the
process's user + system time (getrusage) over load_weights. The output:
{"arm", "format", "bytes", "load_seconds", "gbps", "cpu_seconds_per_gb",
"construct_seconds", "peak_rss_bytes", "tokens", "versions"}, or
{"arm", "error"} (exit 1) when the format does not run here.
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import cpu_seconds as cpu, peak_rss  # noqa: E402


def model_bytes(d):
    """Payload bytes of the checkpoint (every tensor of every shard)."""
    import struct

    total = 0
    for f in sorted(os.listdir(d)):
        if not f.endswith(".safetensors"):
            continue
        with open(os.path.join(d, f), "rb") as fh:
            n = struct.unpack("<Q", fh.read(8))[0]
            header = json.loads(fh.read(n))
        total += sum(v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")
    return total


def versions():
    out = {}
    for m in ("vllm", "torch", "safetensors", "runai_model_streamer", "fastsafetensors", "weightstream"):
        try:
            out[m] = __import__(m).__version__
        except Exception:  # noqa: BLE001 - a version we cannot name
            out[m] = None
    return out


# Arms of the weightstream format with options other than its defaults:
# the arm's name -> (load format, model_loader_extra_config).
VARIANTS = {
    "weightstream-noplan": ("weightstream", {"plan": False}),
    "weightstream-nocache": ("weightstream", {"plan_cache": False}),
}


def format_of(arm_format):
    """(vLLM load format, its extra config) of an arm's FORMAT: a format
    of vLLM's, or one of VARIANTS; WS_VLLM_EXTRA (JSON) adds options to
    the weightstream format's."""
    fmt, extra = VARIANTS.get(arm_format, (arm_format, {}))
    if fmt == "weightstream":
        extra = {**extra, **json.loads(os.environ.get("WS_VLLM_EXTRA") or "{}")}
    return fmt, extra


def logged_loads(text):
    """Each process's logged weight phase in a vLLM log: [(seconds,
    read_bytes or None)], read_bytes where weightstream's line says what
    the process read from storage."""
    import re

    out = []
    for m in re.finditer(r"Loading weights took ([0-9.]+) seconds(?:[^\n]*?([0-9.]+) GB read from storage)?", text):
        out.append((float(m.group(1)), None if m.group(2) is None else float(m.group(2)) * 1e9))
    return out


def vllm_arm(arm_format, d):
    fmt, extra = format_of(arm_format)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.model_executor.model_loader import get_model_loader  # noqa: F401 - registers plugins' loaders
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    timed = {}
    original = BaseModelLoader.load_model

    def load_model(self, *a, **k):
        # Wrap this loader's load_weights (each format's own class) once.
        cls = type(self)
        if not getattr(cls, "_bench_wrapped", False):
            inner = cls.load_weights

            def load_weights(s, model, model_config):
                c0, t0 = cpu(), time.perf_counter()
                r = inner(s, model, model_config)
                timed["seconds"] = time.perf_counter() - t0
                timed["cpu"] = cpu() - c0
                return r

            cls.load_weights = load_weights
            cls._bench_wrapped = True
        return original(self, *a, **k)

    BaseModelLoader.load_model = load_model
    n = model_bytes(d)
    t0 = time.perf_counter()
    llm = LLM(
        model=d,
        load_format=fmt,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=4,
        distributed_executor_backend="uni",
        model_loader_extra_config=extra,
    )
    construct = time.perf_counter() - t0
    outs = llm.generate([{"prompt_token_ids": [1, 5, 9, 33, 100]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    s = timed["seconds"]
    report = None
    if fmt == "weightstream":
        from weightstream import _vllm_loader

        report = _vllm_loader.LAST_REPORT
    return {
        "arm": f"vllm-{arm_format}",
        "format": fmt,
        "options": extra,
        "bytes": n,
        "read_bytes": None if report is None else report.get("read_bytes"),
        "plan": None if report is None else {k: v for k, v in report.get("plan", {}).items() if k != "fallback_reasons"},
        "prepared": None if report is None else report.get("prepared"),
        "load_seconds": s,
        "seconds": s,
        "gbps": n / s / 1e9,
        "cpu_seconds_per_gb": timed["cpu"] / (n / 1e9),
        "construct_seconds": construct,
        "peak_rss_bytes": peak_rss(),
        "tokens": list(outs[0].outputs[0].token_ids),
        "versions": versions(),
    }


def vllm_tp2_arm(arm_format, d):
    """Two tensor-parallel workers, spawned as vLLM does by default. Each
    worker times its loader's load_weights itself (tp_timer.py, imported
    in each worker as vLLM's worker_extension_cls): the load is the
    slowest worker's, the CPU the workers' sum, and each worker's bytes
    read from storage (its /proc/self/io) are kept. vLLM's own log lines
    cannot serve: its default loader logs its time once per node, and
    runai_streamer's none. The workers' output goes to a file, not this
    process's stdout."""
    import tempfile

    fmt, extra = format_of(arm_format)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    # The spawned workers import tp_timer from here.
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = here + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    log = tempfile.NamedTemporaryFile(prefix="ws-vllm-tp2-", suffix=".log", delete=False)
    # vLLM's processes log to stdout and stderr, which they inherit.
    saved = (os.dup(1), os.dup(2))
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    try:
        from vllm import LLM, SamplingParams

        n = model_bytes(d)
        t0 = time.perf_counter()
        llm = LLM(
            model=d,
            load_format=fmt,
            model_loader_extra_config=extra,
            dtype="bfloat16",
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=128,
            max_num_seqs=4,
            tensor_parallel_size=2,
            worker_extension_cls="tp_timer.TimedLoads",
        )
        construct = time.perf_counter() - t0
        phases = llm.collective_rpc("weight_phase")
        outs = llm.generate([{"prompt_token_ids": [1, 5, 9, 33, 100]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        del llm
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    text = open(log.name, errors="replace").read()
    os.unlink(log.name)
    if len(phases) != 2 or not all("seconds" in p for p in phases):
        raise RuntimeError(f"the workers' timed loads: {phases}; log tail: {text[-2000:]}")
    took = [p["seconds"] for p in phases]
    s = max(took)
    cpu_s = sum(p["cpu_seconds"] for p in phases)
    return {
        "arm": f"tp2-{arm_format}",
        "format": fmt,
        "options": extra,
        "bytes": n,
        "load_seconds": s,
        "seconds": s,
        "per_rank_seconds": took,
        "per_rank_read_bytes": [p["read_bytes"] for p in phases],
        "per_rank_logged": [t for t, _ in logged_loads(text)],
        "per_rank_plan": [p.get("plan") for p in phases],
        "gbps": n / s / 1e9,
        # Both workers' CPU over their loads, per GB of the model.
        "cpu_seconds_per_gb": cpu_s / (n / 1e9),
        "construct_seconds": construct,
        "peak_rss_bytes": peak_rss(),
        "tokens": list(outs[0].outputs[0].token_ids),
        "versions": versions(),
    }


def ws_load_arm(d):
    import torch  # noqa: F401 - imported before the clock, as vLLM has it

    import weightstream

    n = model_bytes(d)
    c0, t0 = cpu(), time.perf_counter()
    sd = weightstream.load(d)
    # One byte of every page read, as a consumer would (and as the vLLM
    # arms' copies into parameters do).
    for t in sd.values():
        if t.numel():
            t.view(-1).view(__import__("torch").uint8)[::4096].sum()
    s = time.perf_counter() - t0
    return {
        "arm": "ws-load",
        "bytes": n,
        "load_seconds": s,
        "seconds": s,
        "gbps": n / s / 1e9,
        "cpu_seconds_per_gb": (cpu() - c0) / (n / 1e9),
        "peak_rss_bytes": peak_rss(),
        "versions": versions(),
    }


def write_config(d):
    """config.json for benches/peers/write_model.py's Llama-shaped
    checkpoint (hidden 2048, intermediate 5632, 16 heads of 128, 2 KV
    heads, vocab 32000), its layer count read from the index."""
    idx = json.load(open(os.path.join(d, "model.safetensors.index.json")))
    layers = 1 + max(int(k.split(".")[2]) for k in idx["weight_map"] if k.startswith("model.layers."))
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "num_hidden_layers": layers,
        "vocab_size": 32000,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)
    return {"layers": layers}


def main():
    # vLLM logs to stdout: everything but the one JSON line goes to stderr.
    out_fd = os.dup(1)
    os.dup2(2, 1)

    def emit(v):
        os.write(out_fd, (json.dumps(v) + "\n").encode())

    kind = sys.argv[1]
    try:
        if kind == "vllm":
            out = vllm_arm(sys.argv[2], sys.argv[3])
        elif kind == "vllm-tp2":
            out = vllm_tp2_arm(sys.argv[2], sys.argv[3])
        elif kind == "ws-load":
            out = ws_load_arm(sys.argv[2])
        elif kind == "write-config":
            out = write_config(sys.argv[2])
        else:
            raise SystemExit(f"unknown arm {kind}")
    except Exception as e:  # noqa: BLE001 - the record says why
        import traceback

        emit({"arm": kind if kind not in ("vllm", "vllm-tp2") else f"{kind}-{sys.argv[2]}", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]})
        sys.exit(1)
    emit(out)


if __name__ == "__main__":
    main()
