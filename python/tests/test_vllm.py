"""vLLM's `weightstream` load format: found through the entry point,
token-exact against vLLM's default loader on dense and MoE models (float32
and bfloat16 checkpoints, several shards with an index), its options (split
folders, mirrors), the experts an expert-parallel rank holds, a truncated
shard. vLLM runs in a process of its own (vllm_child.py); the tests need
vLLM's CPU build (benches/vllm/venv.sh makes the venv ci/python uses) and
skip without it, but fail where WEIGHTSTREAM_REQUIRE_VLLM=1 (CI)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import weightstream.vllm as wv

CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_child.py")


def vllm_or_skip():
    try:
        import vllm  # noqa: F401
    except ImportError:
        if os.environ.get("WEIGHTSTREAM_REQUIRE_VLLM") == "1":
            pytest.fail("vllm is required here (WEIGHTSTREAM_REQUIRE_VLLM=1)")
        pytest.skip("vllm is not installed")


def make_models(d):
    """Tiny Llama, Qwen3-MoE and Mixtral models saved by transformers in
    several shards with an index, each in float32 and in bfloat16: a
    dict {"llama-float32": path, ...}."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(vocab_size=1024, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=256, tie_word_embeddings=False)
    makers = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(intermediate_size=512, **common)),
        "qwen3moe": lambda: Qwen3MoeForCausalLM(
            Qwen3MoeConfig(intermediate_size=512, moe_intermediate_size=128, head_dim=64, num_experts=8,
                           num_experts_per_tok=2, decoder_sparse_step=1, **common)
        ),
        "mixtral": lambda: MixtralForCausalLM(
            MixtralConfig(intermediate_size=256, num_local_experts=4, num_experts_per_tok=2, **common)
        ),
    }
    out = {}
    for name, make in makers.items():
        torch.manual_seed(36)
        model = make()
        for dtype in ("float32", "bfloat16"):
            path = d / f"{name}-{dtype}"
            model.to(getattr(torch, dtype)).save_pretrained(path, max_shard_size="500KB")
            assert (path / "model.safetensors.index.json").exists() and len(list(path.glob("*.safetensors"))) >= 3
            out[f"{name}-{dtype}"] = path
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    vllm_or_skip()
    return make_models(tmp_path_factory.mktemp("vllm"))


def run(jobs, tmp_path, tag, timeout=1500):
    """The jobs' results from one vllm_child.py process."""
    spec, out = tmp_path / f"jobs-{tag}.json", tmp_path / f"out-{tag}.json"
    spec.write_text(json.dumps([{**j, "model": str(j["model"])} for j in jobs]))
    p = subprocess.run([sys.executable, CHILD, str(spec), str(out)], capture_output=True, text=True, timeout=timeout)
    assert out.exists(), (p.returncode, p.stdout[-3000:], p.stderr[-6000:])
    return json.loads(out.read_text())


def test_greedy_tokens_equal_the_default_loaders_on_dense_and_moe_models(models, tmp_path):
    names = sorted(models)
    jobs = [
        {"model": models[n], "load_format": f, "dtype": n.rsplit("-", 1)[1]}
        for n in names
        for f in ("auto", "weightstream")
    ]
    res = run(jobs, tmp_path, "exact")
    for i, n in enumerate(names):
        ref, ours = res[2 * i], res[2 * i + 1]
        assert "error" not in ref, (n, ref.get("error", "")[-3000:])
        assert "error" not in ours, (n, ours.get("error", "")[-3000:])
        assert ours["tokens"] == ref["tokens"], n
        assert all(len(t) == 12 for t in ours["tokens"]), n


def digest_jobs(models, names, **job):
    return [
        {"kind": "digests", "runner": "generate", "generate": True, "model": models[n], "load_format": f, "dtype": n.rsplit("-", 1)[1], **job}
        for n in names
        for f in ("auto", "weightstream")
    ]


def assert_same_parameters(ref, ours, what):
    assert "error" not in ref, (what, ref.get("error", "")[-3000:])
    assert "error" not in ours, (what, ours.get("error", "")[-3000:])
    assert len(ref["ranks"]) == len(ours["ranks"])
    for rank, (a, b) in enumerate(zip(ref["ranks"], ours["ranks"])):
        differ = sorted(n for n in a["digests"] if b["digests"].get(n) != a["digests"][n])
        assert not differ and sorted(a["digests"]) == sorted(b["digests"]), (what, rank, differ)
    assert ours["tokens"] == ref["tokens"], what


def test_the_plan_fills_every_parameter_byte_equal_to_the_default_loader(models, tmp_path):
    """The load plan (traced from each model's own load_weights) on dense
    Llama, Qwen3-MoE and Mixtral, float32 and bfloat16: every parameter's
    sha256 equals `auto`'s, greedy tokens too, and every tensor was
    planned (none fell back: these loaders only narrow and copy)."""
    names = sorted(models)
    res = run(digest_jobs(models, names), tmp_path, "plan")
    for i, n in enumerate(names):
        ref, ours = res[2 * i], res[2 * i + 1]
        assert_same_parameters(ref, ours, n)
        plan = ours["ranks"][0]["report"]["plan"]
        assert plan["used"] and plan["fallback_tensors"] == 0 and plan["planned_tensors"] > 0, (n, plan)
        assert plan["planned_bytes"] == ours["ranks"][0]["report"]["bytes"], (n, plan)


def test_a_plan_kept_in_the_cache_fills_the_same_bytes_and_a_changed_checkpoint_is_traced_again(models, tmp_path):
    """The first load with the plan traces it and keeps it; the second,
    in another engine, takes it from the plan cache (no trace) with every
    parameter's sha256 equal to `auto`'s. A checkpoint whose header then
    changes (a tensor's dtype) has another key: it is traced again, never
    served the stale plan. A damaged plan file is refused and traced."""
    import glob

    import torch
    from safetensors.torch import load_file, save_file

    for n in ("llama-bfloat16", "qwen3moe-float32"):
        ref, first, second = run(digest_jobs(models, [n]) + [digest_jobs(models, [n])[1]], tmp_path, f"cache-{n}")
        assert_same_parameters(ref, first, n)
        assert_same_parameters(ref, second, n + " from the plan cache")
        p1, p2 = first["ranks"][0]["report"]["plan"], second["ranks"][0]["report"]["plan"]
        assert p1["cache"]["state"] == "kept" and p2["cache"]["state"] == "hit", (p1["cache"], p2["cache"])
        assert p1["cache"]["file"] == p2["cache"]["file"]
        assert p2["planned_tensors"] == p1["planned_tensors"] > 0 and p2["fallback_tensors"] == 0
    # Another checkpoint: one norm's header says float32 where it said bf16.
    src = models["llama-bfloat16"]
    changed = tmp_path / "llama-changed"
    shutil.copytree(src, changed)
    shard = sorted(glob.glob(str(changed / "*.safetensors")))[-1]
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("norm.weight"))
    tensors[name] = tensors[name].to(torch.float32)
    save_file(tensors, shard, metadata={"format": "pt"})
    jobs = digest_jobs({"c-bfloat16": changed}, ["c-bfloat16"]) * 2
    ref, first, _ref2, second = run(jobs, tmp_path, "cache-changed")
    assert_same_parameters(ref, first, "changed")
    assert_same_parameters(ref, second, "changed, again")
    p1, p2 = first["ranks"][0]["report"]["plan"], second["ranks"][0]["report"]["plan"]
    assert p1["cache"]["state"] == "kept", p1["cache"]
    assert p2["cache"]["state"] == "hit" and p2["cache"]["file"] == p1["cache"]["file"]
    kept = {c["file"] for c in (p1["cache"],)}
    # The float32 norm is cast by the loader: it falls back, as traced.
    assert any(r.startswith("a cast") for r in p1["fallback_reasons"]) and p2["fallback_reasons"] == p1["fallback_reasons"]
    # A damaged file: refused (said), traced again, the same bytes.
    path = kept.pop()
    text = open(path).read()
    open(path, "w").write(text.replace('"writes": [[', '"writes": [[1, ', 1) if '"writes": [[' in text else text[:-10])
    ref, third = run(digest_jobs({"c-bfloat16": changed}, ["c-bfloat16"]), tmp_path, "cache-damaged")
    assert_same_parameters(ref, third, "damaged plan file")
    p3 = third["ranks"][0]["report"]["plan"]
    assert p3["cache"]["state"] == "refused" and "checksum" in p3["cache"]["why"], p3["cache"]


def test_the_plan_through_the_device_path_gives_the_same_bytes(models, tmp_path, monkeypatch):
    """WEIGHTSTREAM_FORCE_DEVICE_PATH=1: the CPU parameters are filled as
    CUDA ones are (load_into's pipeline: staging buffers, a copier, events),
    with the same bytes."""
    monkeypatch.setenv("WEIGHTSTREAM_FORCE_DEVICE_PATH", "1")
    ref, ours = run(digest_jobs(models, ["qwen3moe-bfloat16"]), tmp_path, "device")
    assert_same_parameters(ref, ours, "device path")
    plan = ours["ranks"][0]["report"]["plan"]
    assert plan["device_bytes"] == plan["planned_bytes"] > 0, plan


def test_tensor_parallel_ranks_with_the_plan_read_only_their_slices(models, tmp_path, monkeypatch):
    """TP=2 with the plan, dense and MoE: each rank's parameters equal
    `auto`'s rank's, and each rank reads half the checkpoint: its slices,
    and its half of the tensors it cannot read its part of alone (the
    row-parallel o_proj and down_proj, whose half-rows here are 256-512
    bytes, and the replicated norms), which the two ranks read together
    (_tp_share). Counted twice: the engine's bytes from the drives (0.5 of
    a TP=1 load's, exactly, but for the block-aligned cuts), and
    /proc/self/io read_bytes over the load (the kernel's, less than a
    TP=1 load's; on a model of a few MB the engine's drive probe and the
    imports weigh: the bench measures a real size)."""
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1" if (os.cpu_count() or 1) >= 2 else "0|0")
    m = "llama-bfloat16"
    moe = ["qwen3moe-float32", "mixtral-bfloat16"]
    jobs = digest_jobs(models, [m], tp=2) + [digest_jobs(models, [m])[1], digest_jobs(models, [m], tp=2)[1]]
    jobs += digest_jobs(models, moe, tp=2)
    ref, ours, whole, again, *moe_res = run(jobs, tmp_path, "tp2plan")
    assert_same_parameters(ref, ours, "tp2")
    for i, n in enumerate(moe):
        assert_same_parameters(moe_res[2 * i], moe_res[2 * i + 1], f"tp2 {n}")
    # The second TP=2 load finds each rank's own plan in the cache (the
    # key holds the rank: rank 1 given rank 0's slices would differ here).
    assert_same_parameters(ref, again, "tp2 from the plan cache")
    assert [r["report"]["plan"]["cache"]["state"] for r in ours["ranks"]] == ["kept", "kept"], ours["ranks"][0]["report"]["plan"]
    assert [r["report"]["plan"]["cache"]["state"] for r in again["ranks"]] == ["hit", "hit"]
    assert len({r["report"]["plan"]["cache"]["file"] for r in again["ranks"]}) == 2
    assert "error" not in whole, whole.get("error", "")[-3000:]
    one = whole["ranks"][0]["report"]["read_bytes"]
    one_drives = sum(whole["ranks"][0]["report"]["drives"].values())
    assert one_drives == whole["ranks"][0]["report"]["bytes"]
    # Direct reads are counted; a folder on tmpfs would count none.
    assert one > 0
    for res in [ours, again] + moe_res[1::2]:
        drives = []
        for rank in res["ranks"]:
            rep = rank["report"]
            assert rep["plan"]["used"] and rep["plan"]["fallback_tensors"] == 0, rep["plan"]
            shared = rep["plan"]["shared"]
            assert shared["why_not"] is None and shared["tensors"] > 0 and shared["ranks"] == 2, shared
            assert shared["read_bytes"] <= 0.5 * shared["bytes"] + 4096 * shared["tensors"], shared
            drives.append(sum(rep["drives"].values()))
        if res is ours or res is again:
            for d in drives:
                assert 0.45 * one_drives < d < 0.53 * one_drives, (drives, one_drives)
            for rank in res["ranks"]:
                assert 0 < rank["report"]["read_bytes"] < 0.8 * one, (rank["report"]["read_bytes"], one)
        # Between them the ranks read each byte about once.
        assert sum(drives) < 1.06 * res["ranks"][0]["report"]["bytes"], drives


def test_a_model_whose_loader_the_plan_refuses_falls_back_with_the_same_bytes(tmp_path):
    """vLLM's GPT-2 transposes the checkpoint's Conv1D weights (c_attn,
    c_proj, c_fc: `loaded_weight.t()` in its load_weights) before its
    loaders copy them: no box of the checkpoint tensor is what lands, so
    the plan refuses those tensors, by reason (a view that is no box of
    the tensor), and they go through vLLM's loaders with the real tensors; the rest (embeddings, norms, biases) is
    planned. Every parameter's sha256 equals `auto`'s, tokens too."""
    vllm_or_skip()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(47)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=256, n_embd=256, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0))
    path = tmp_path / "gpt2-bfloat16"
    model.to(torch.bfloat16).save_pretrained(path, max_shard_size="500KB")
    assert len(list(path.glob("*.safetensors"))) >= 3
    ref, ours = run(digest_jobs({"gpt2-bfloat16": path}, ["gpt2-bfloat16"]), tmp_path, "refused")
    assert_same_parameters(ref, ours, "gpt2")
    plan = ours["ranks"][0]["report"]["plan"]
    assert plan["used"] and plan["planned_tensors"] > 0, plan
    reasons = plan["fallback_reasons"]
    # `.t()` is a view whose strides are no box of the checkpoint tensor.
    transposed = [r for r in reasons if r.startswith("a view that is not a box of the tensor")]
    assert transposed and all(reasons[r]["names"][0].endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")) for r in reasons), reasons
    # Each layer's c_attn, c_proj (attention and MLP) and c_fc weights.
    assert sum(reasons[r]["tensors"] for r in transposed) == 2 * 4, reasons
    assert plan["fallback_tensors"] == 2 * 4, plan
    assert plan["planned_bytes"] + plan["fallback_bytes"] == ours["ranks"][0]["report"]["bytes"], plan


def test_the_load_format_is_found_in_spawned_engine_and_worker_processes(models, tmp_path):
    """vLLM's default: the engine core and the worker are spawned
    processes; each finds the load format through the entry point."""
    m = models["qwen3moe-bfloat16"]
    jobs = [{"model": m, "load_format": f, "dtype": "bfloat16", "spawn": True} for f in ("auto", "weightstream")]
    ref, ours = run(jobs, tmp_path, "spawn")
    assert "error" not in ref, ref.get("error", "")[-3000:]
    assert "error" not in ours, ours.get("error", "")[-3000:]
    assert ours["tokens"] == ref["tokens"]


def test_split_folders_and_a_mirror_load_with_the_same_tokens(models, tmp_path):
    src = models["mixtral-float32"]
    primary, extra, mirror = tmp_path / "primary", tmp_path / "extra", tmp_path / "mirror"
    shutil.copytree(src, primary)
    shutil.copytree(src, mirror)
    extra.mkdir()
    shards = sorted(primary.glob("*.safetensors"))
    for s in shards[::2]:
        shutil.move(str(s), extra / s.name)
    jobs = [
        {"model": src, "load_format": "auto", "dtype": "float32"},
        {"model": primary, "load_format": "weightstream", "dtype": "float32", "extra": {"dirs": [str(extra)]}},
        {"model": src, "load_format": "weightstream", "dtype": "float32", "extra": {"mirrors": str(mirror), "route": "stripe", "window": 3}},
    ]
    ref, split, mirrored = run(jobs, tmp_path, "layouts")
    for r in (ref, split, mirrored):
        assert "error" not in r, r.get("error", "")[-3000:]
    assert split["tokens"] == ref["tokens"] and mirrored["tokens"] == ref["tokens"]


def test_a_truncated_shard_fails_the_load_naming_the_file(models, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(models["llama-float32"], bad)
    victim = sorted(bad.glob("*.safetensors"))[1]
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 100)
    (res,) = run([{"model": bad, "load_format": "weightstream", "dtype": "float32"}], tmp_path, "truncated")
    assert "error" in res and victim.name in res["error"], res


def test_an_expert_parallel_rank_reads_only_its_experts(models, tmp_path):
    """vLLM's expert filter, kept: experts 2 and 5 of 8 for this rank,
    decided before any byte of the others is read (they are not in the
    stream at all); dense weights, norms and the router whole."""
    m = models["qwen3moe-float32"]
    (res,) = run([{"kind": "filter", "model": m, "local_expert_ids": [2, 5]}], tmp_path, "filter")
    assert "error" not in res, res.get("error", "")[-3000:]
    names = res["names"]
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}
    assert experts == {2, 5}, experts
    assert any("embed_tokens" in n for n in names) and any(n.endswith("mlp.gate.weight") for n in names)
    # 2 layers x 6 experts x 3 projections not read.
    assert res["report"]["skipped_experts"] == 2 * 6 * 3
    assert res["report"]["tensors"] == len(names)


def bge_m3(d):
    """A tiny BGE-M3 (vLLM's BgeM3EmbeddingModel): an XLM-RoBERTa body in
    model.safetensors and its two heads as vLLM reads them, sparse_linear.pt
    and colbert_linear.pt (torch.save'd state dicts)."""
    import torch
    from transformers import XLMRobertaConfig, XLMRobertaModel

    cfg = XLMRobertaConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=128, max_position_embeddings=130, pad_token_id=1, bos_token_id=0, eos_token_id=2)
    torch.manual_seed(46)
    XLMRobertaModel(cfg, add_pooling_layer=False).save_pretrained(d)
    c = json.loads((d / "config.json").read_text())
    c["architectures"] = ["BgeM3EmbeddingModel"]
    (d / "config.json").write_text(json.dumps(c))
    torch.save({"weight": torch.randn(1, 64), "bias": torch.randn(1)}, d / "sparse_linear.pt")
    torch.save({"weight": torch.randn(64, 64), "bias": torch.randn(64)}, d / "colbert_linear.pt")
    return d


def test_a_models_pt_heads_are_read_not_skipped(tmp_path):
    """BGE-M3's sparse and ColBERT heads live in .pt files that vLLM's
    model names as secondary weights: under the weightstream format every
    parameter equals the default loader's, heads included (vLLM's own
    iterator reads the .pt files, said in its log). Before: the heads kept
    their random init and nothing said so."""
    vllm_or_skip()
    d = bge_m3(tmp_path / "bge-m3")
    res = run([{"kind": "digests", "model": d, "load_format": f, "dtype": "float32"} for f in ("auto", "weightstream")],
              tmp_path, "bge")
    assert all("error" not in r for r in res), [r.get("error", "")[-3000:] for r in res]
    ref, ours = res[0]["digests"], res[1]["digests"]
    assert any(n.startswith("sparse_linear.") for n in ref) and any(n.startswith("colbert_linear.") for n in ref), sorted(ref)
    differ = sorted(n for n in ref if ours.get(n) != ref[n])
    assert not differ and sorted(ours) == sorted(ref), differ


def test_options_are_checked_before_anything_is_read():
    assert wv.parse_options(None)["window"] == wv.DEFAULT_WINDOW
    o = wv.parse_options({"dirs": "/a; /b,", "mirrors": ["/m"], "route": "stripe", "direct": "on", "window": 3, "tp": "each"})
    assert o == {"dirs": ["/a", "/b"], "mirrors": ["/m"], "route": "stripe", "direct": "on", "window": 3, "tp": "each", "prepare": True, "plan": True, "plan_cache": None}
    assert wv.parse_options({"plan": False})["plan"] is False
    assert wv.parse_options({"plan_cache": False})["plan_cache"] is False
    assert wv.parse_options({"plan_cache": " /p "})["plan_cache"] == "/p"
    assert wv.parse_options({"prepare": False})["prepare"] is False
    assert wv.parse_options({})["tp"] == wv.DEFAULT_TP
    for bad, what in [
        ({"mirror": "/m"}, "unknown extra config keys \\['mirror'\\]"),
        ({"window": 0}, "window"),
        ({"window": True}, "window"),
        ({"dirs": [1]}, "dirs"),
        ({"route": 3}, "route"),
        ({"tp": "slices"}, "tp must be one of"),
        ({"tp": "exchange"}, "tp: exchange was removed: with the load plan each rank reads 0.50 of the model"),
        ({"prepare": "yes"}, "prepare"),
        ({"plan": 1}, "plan"),
        ({"plan_cache": 3}, "plan_cache must be a folder or false"),
        ({"plan_cache": True}, "plan_cache must be a folder or false"),
        ({"plan_cache": ""}, "plan_cache must be a folder or false"),
        ("x", "must be a dict"),
    ]:
        with pytest.raises(ValueError, match=what):
            wv.parse_options(bad)


def test_registration_is_cheap_idempotent_and_a_no_op_without_vllm():
    """`import weightstream` imports nothing of vLLM; register() twice is
    one registration; without vLLM it does nothing (run here in a process
    where vLLM cannot be imported)."""
    code = (
        "import sys\n"
        "sys.modules['vllm'] = None  # as if vLLM were not installed\n"
        "import weightstream, weightstream.vllm as wv\n"
        "wv.register(); wv.register()\n"
        "assert not wv._registered\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "ok", p.stderr[-2000:]
    p = subprocess.run([sys.executable, "-c", "import sys, weightstream; print('vllm' in sys.modules)"], capture_output=True, text=True, timeout=120)
    assert p.stdout.strip() == "False", p.stderr[-2000:]
    try:
        import vllm  # noqa: F401
    except ImportError:
        return
    code = (
        "import weightstream.vllm as wv\n"
        "wv.register(); wv.register()\n"
        "from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER as t\n"
        "from weightstream._vllm_loader import WeightstreamModelLoader\n"
        "assert t['weightstream'] is WeightstreamModelLoader and wv._registered\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "try:\n"
        "    EngineArgs(model='m', load_format='weightstream', model_loader_extra_config={'mirror': '/m'}).create_load_config()\n"
        "except ValueError as e:\n"
        "    assert 'unknown extra config keys' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('an unknown option passed the front end')\n"
        "EngineArgs(model='m', load_format='weightstream', model_loader_extra_config={'window': 4}).create_load_config()\n"
        "print('ok')\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.stdout.strip() == "ok", p.stderr[-3000:]
    # vLLM's INFO line for every process that registers a loader is not ours.
    assert "Registered model loader" not in p.stderr + p.stdout, p.stderr[-3000:]


def test_the_package_has_no_import_circle():
    """No module of the package imports, at any depth or inside a function,
    a module that imports it back. Before: weightstream.vllm imported
    _vllm_loader (in register) and _vllm_loader imported weightstream.vllm
    (for its options)."""
    import ast

    pkg = os.path.join(os.path.dirname(os.path.abspath(wv.__file__)))
    mods = {f[:-3] for f in os.listdir(pkg) if f.endswith(".py")}
    edges = {}
    for m in mods:
        tree = ast.parse(open(os.path.join(pkg, m + ".py")).read())
        out = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    out.add(node.module.split(".")[0])
                else:
                    out.update(a.name for a in node.names if a.name in mods)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("weightstream."):
                out.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("weightstream."))
        # The package itself (__init__) is every module's parent: not an edge back.
        edges[m] = {o for o in out if o in mods and o != m and o != "__init__"}

    def circle(start):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in edges[node]:
                if nxt == start:
                    return path + [start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + [nxt]))
        return None

    circles = [c for c in (circle(m) for m in sorted(mods)) if c]
    assert not circles, circles


@pytest.mark.parametrize("mode", ["never", "always", "idle"])
def test_the_prepare_helper_populates_planned_storages_by_mode(mode, monkeypatch):
    """The planned storages: never populated (`never`), all of them in
    pieces (`always`), or only while a CPU is spare (`idle`: how much
    depends on the machine's load, so only its bounds are facts). No byte
    of any parameter changes; stop() ends the helper, in every mode."""
    vllm_or_skip()
    import torch

    from weightstream import _vllm_loader as vl

    monkeypatch.setenv("WEIGHTSTREAM_VLLM_POPULATE_PLANNED", mode)
    model = torch.nn.Linear(256, 256)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    import mmap

    # Fresh anonymous memory, two pieces (the last short), its pages not
    # there until populated; a mark in every 64th page, written before.
    buf = mmap.mmap(-1, vl.PLANNED_PIECE + (5 << 20))
    planned = torch.frombuffer(buf, dtype=torch.uint8)
    planned[:: 64 * 4096] = 7
    st = planned.untyped_storage()
    prep = vl._Prepare(model, advise_only=[(st.data_ptr(), st.nbytes())])
    if mode != "idle":
        prep._thread.join()  # runs to its end without a stop
    got = prep.stop()
    assert got["refused"] is None, got
    assert got["planned_mode"] == mode
    if mode == "never":
        assert got["planned_bytes"] == 0 and got["planned_waits"] == 0
    elif mode == "always":
        assert got["planned_bytes"] == st.nbytes() and got["planned_waits"] == 0
    else:
        assert 0 <= got["planned_bytes"] <= st.nbytes()
    assert not prep._thread.is_alive()
    assert torch.all(planned[:: 64 * 4096] == 7) and int(planned.sum()) == 7 * len(planned[:: 64 * 4096])
    del planned, st
    buf.close()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
