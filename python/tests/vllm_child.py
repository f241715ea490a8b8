"""vLLM runs for test_vllm.py, in a process of their own (run by it).

argv: JOBS_JSON OUT_JSON. JOBS_JSON is a list of jobs, each {"model",
"load_format", "dtype", "extra" (model_loader_extra_config), "spawn",
"tp" (tensor_parallel_size, spawned)}, or {"kind": "digests"} (each
rank's parameter digests and the loader's report, see digests()) or
{"kind": "filter"}; they
run one after another in this process: in-process (vLLM's engine core and
a "uni" executor here) unless "spawn" is true, when vLLM spawns its engine
core and worker processes as it does by default (the load format must then
be found through the entry point in each of them). Writes, per job,
{"tokens": [[...], [...]], "load_seconds"} or {"error": traceback text}.
"""

import gc
import json
import os
import sys
import time
import traceback

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

PROMPTS = [[1, 5, 9, 33, 100], [7, 8, 9], [200, 3, 3, 1]]


def main():
    jobs = json.load(open(sys.argv[1]))
    spawn = any(j.get("spawn") for j in jobs)
    if not spawn:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    results = []
    for job in jobs:
        t0 = time.perf_counter()
        if job.get("kind") == "filter":
            results.append(expert_filter(job))
            continue
        if job.get("kind") == "digests":
            results.append(digests(job))
            gc.collect()
            continue
        try:
            llm = LLM(
                model=job["model"],
                load_format=job["load_format"],
                dtype=job["dtype"],
                model_loader_extra_config=job.get("extra") or {},
                skip_tokenizer_init=True,
                enforce_eager=True,
                max_model_len=128,
                max_num_seqs=4,
                tensor_parallel_size=job.get("tp", 1),
                **({} if spawn else {"distributed_executor_backend": "uni"}),
            )
            built = time.perf_counter() - t0
            outs = llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS],
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                use_tqdm=False,
            )
            results.append({"tokens": [list(o.outputs[0].token_ids) for o in outs], "build_seconds": built})
            del llm
        except Exception:  # noqa: BLE001 - reported to the test
            results.append({"error": traceback.format_exc()})
        gc.collect()
    json.dump(results, open(sys.argv[2], "w"))


def parameter_digests(model):
    """sha256 of every parameter's bytes, and the weightstream loader's
    report when it loaded them (run in each worker by apply_model)."""
    import hashlib

    import torch

    got = {
        n: hashlib.sha256(p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
        for n, p in model.named_parameters()
    }
    report = None
    try:
        from weightstream import _vllm_loader

        report = _vllm_loader.LAST_REPORT
    except ImportError:
        pass
    return {"digests": got, "report": json.loads(json.dumps(report, default=str)) if report else None}


def digests(job):
    """A model built by vLLM with `load_format` (a pooling model unless
    "runner" says otherwise; "tp" ranks, spawned, when above 1): each
    rank's digest of each of its parameters and the loader's report."""
    from vllm import LLM

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    tp = job.get("tp", 1)
    try:
        llm = LLM(
            model=job["model"],
            load_format=job["load_format"],
            dtype=job["dtype"],
            runner=job.get("runner", "pooling"),
            model_loader_extra_config=job.get("extra") or {},
            skip_tokenizer_init=True,
            enforce_eager=True,
            max_model_len=128,
            max_num_seqs=4,
            tensor_parallel_size=tp,
            distributed_executor_backend="uni" if tp == 1 else "mp",
        )
        ranks = llm.apply_model(parameter_digests)
        out = {"digests": ranks[0]["digests"], "ranks": ranks}
        if job.get("generate"):
            from vllm import SamplingParams

            outs = llm.generate(
                [{"prompt_token_ids": p} for p in PROMPTS],
                SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                use_tqdm=False,
            )
            out["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        del llm
        return out
    except Exception:  # noqa: BLE001 - reported to the test
        return {"error": traceback.format_exc()}


def expert_filter(job):
    """The weightstream loader's reads of `model` for an expert-parallel
    rank holding `local_expert_ids`: the tensor names it hands over, and
    its report."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    import weightstream.vllm

    weightstream.vllm.register()
    try:
        loader = get_model_loader(LoadConfig(load_format="weightstream", model_loader_extra_config=job.get("extra") or {}))
        loader._default.local_expert_ids = set(job["local_expert_ids"])
        loader.report = loader.new_report()
        source = DefaultModelLoader.Source(job["model"], None, prefix="", fall_back_to_pt=False)
        names = [n for n, _ in loader._source_weights(source)]
        return {"names": names, "report": loader.report}
    except Exception:  # noqa: BLE001 - reported to the test
        return {"error": traceback.format_exc()}


if __name__ == "__main__":
    main()
