"""The ``weightstream`` load format's loader (imported by
``weightstream.vllm.register`` only, inside vLLM).

It finds the checkpoint as vLLM's default loader does (a local folder, or
a download from the hub), keeps vLLM's own filters (the index's duplicate
shards, multimodal encoder-only shards, weights the model does not use,
experts another expert-parallel rank holds), and hands ``model.load_weights``
the tensors from weightstream's stream, in file order, ``window`` reads in
flight, each tensor in memory of its own. vLLM does the merging and the
tensor-parallel narrowing, as for every load format.
"""

import dataclasses
import os
import time

from vllm.logger import init_logger
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.model_loader.ep_weight_filter import should_skip_weight
from vllm.model_executor.model_loader.weight_utils import (
    filter_mm_encoder_only_safetensors_files,
    pt_weights_iterator,
)

from . import _native
from ._convert import to_torch
from ._vllm_options import parse_options

# Under vLLM's own logger tree, so its handlers print it as theirs.
logger = init_logger("vllm.model_executor.model_loader.weightstream")


class WeightstreamModelLoader(BaseModelLoader):
    """``load_format="weightstream"``: safetensors checkpoints read by
    weightstream (O_DIRECT, every drive, mirrors and split folders)."""

    def __init__(self, load_config):
        super().__init__(load_config)
        self.options = parse_options(load_config.model_loader_extra_config)
        # vLLM's own loader, for what is not about reading bytes: finding
        # and downloading the files, its filters, its weight tracking.
        self._default = DefaultModelLoader(
            dataclasses.replace(load_config, load_format="safetensors", model_loader_extra_config={})
        )
        self.report = {}

    def download_model(self, model_config):
        self._default.download_model(model_config)

    def load_weights(self, model, model_config):
        d = self._default
        d._init_ep_weight_filter(model_config)
        d._init_mm_encoder_only_weight_filter(model, model_config)
        self.report = {"tensors": 0, "bytes": 0, "skipped_experts": 0, "skipped_unused": 0, "vllm_files": [], "vllm_tensors": 0}
        t0 = time.perf_counter()
        prep = _Prepare(model if self.options["prepare"] else None)
        try:
            loaded = model.load_weights(self._all_weights(model, model_config))
        finally:
            self.report["prepared"] = prep.stop()
        seconds = time.perf_counter() - t0
        refused = self.report["prepared"]["refused"]
        if refused:
            logger.warning(
                "weightstream: the parameters could not be prepared for the copies (%s): vLLM's copies fault their "
                "pages in themselves (slower, never wrong)",
                refused,
            )
        self.report["seconds"] = seconds
        logger.info(
            "Loading weights took %.2f seconds (weightstream: %d tensors, %.3f GB, %.2f GB/s; %d experts of other ranks "
            "and %d unused weights not read; %d tensors from %d file(s) that are not safetensors read by vLLM's own "
            "iterator)",
            seconds,
            self.report["tensors"],
            self.report["bytes"] / 1e9,
            self.report["bytes"] / 1e9 / max(seconds, 1e-9),
            self.report["skipped_experts"],
            self.report["skipped_unused"],
            self.report["vllm_tensors"],
            len(self.report["vllm_files"]),
        )
        track = d.enable_weights_track
        if track is None:
            track = model_config.quantization is None and loaded is not None
        if track:
            d.track_weights_loading(model, loaded, quantized=model_config.quantization is not None)

    def _all_weights(self, model, model_config):
        primary = DefaultModelLoader.Source(
            model_config.model,
            model_config.revision,
            prefix="",
            fall_back_to_pt=False,
            allow_patterns_overrides=getattr(model, "allow_patterns_overrides", None),
            is_unused_weight=getattr(model, "is_unused_checkpoint_weight", None),
        )
        yield from self._source_weights(primary)
        for source in getattr(model, "secondary_weights", ()):
            yield from self._source_weights(source)

    def _source_weights(self, source):
        d = self._default
        o = self.options
        # Split across folders, the index names shards the folder lacks,
        # which vLLM's own filter refuses: the folder's shards are listed
        # as they are and kept when the index names them (as that filter
        # does), and the other folders' come from weightstream's catalog.
        split = bool(o["dirs"] or os.environ.get("WEIGHTSTREAM_MODEL_DIRS", "").strip())
        own = source.allow_patterns_overrides is None
        folder, files, use_safetensors, index_file = d._prepare_weights(
            source.model_or_path,
            source.subfolder,
            source.revision,
            False,
            ["*.safetensors"] if split and own else source.allow_patterns_overrides,
        )
        if split and own:
            named = _index_shards(os.path.join(folder, index_file))
            if named is not None:
                files = [f for f in files if os.path.basename(f) in named]
        # What weightstream does not read (a model's `.pt` or `.bin` heads,
        # such as BGE-M3's sparse_linear.pt, named by the source's own
        # patterns): vLLM's own iterator reads it, as `auto` would, said in
        # vLLM's log with the files named. Never a weight skipped.
        others = [f for f in files if not f.endswith(".safetensors")]
        if others:
            yield from self._vllm_weights(source, others)
            files = [f for f in files if f.endswith(".safetensors")]
            if not files:
                return
        if d._encoder_only_lm_prefixes is not None and files:
            files = filter_mm_encoder_only_safetensors_files(
                files, folder, index_file, d._encoder_only_lm_prefixes, weights_mapper=d._encoder_only_weights_mapper
            )
        # The model as weightstream opens it: the folder (its index), the
        # split folders and mirrors; WEIGHTSTREAM_* where an option is unset.
        catalog = _native.catalog(folder, dirs=o["dirs"], mirrors=o["mirrors"], env=True)
        # The shards vLLM would read: its list of the folder's files, plus
        # every shard of a split folder (vLLM lists the folder alone).
        here = os.path.realpath(folder)
        kept = {os.path.basename(f) for f in files}

        def wanted(file):
            return os.path.basename(file) in kept or os.path.realpath(os.path.dirname(file)) != here

        items = []
        for name, _dtype, _shape, nbytes, file, offset, _drives in sorted(catalog, key=lambda e: (e[4], e[5], e[0])):
            if not wanted(file):
                continue
            if source.is_unused_weight is not None and source.is_unused_weight(name):
                self.report["skipped_unused"] += 1
                continue
            if should_skip_weight(name, d.local_expert_ids):
                self.report["skipped_experts"] += 1
                continue
            items.append((name, None))
            self.report["bytes"] += nbytes
        group = _tp_group() if o["tp"] == "exchange" else None
        if group is not None:
            # The ranks of the tensor-parallel group share the reads: each
            # reads its part (by bytes, by drive on a node) and sends the
            # rest; every rank gets every tensor it asked for.
            from .torch import iter_distributed

            exchanged = {}
            for name, t in iter_distributed(
                folder,
                group=group,
                dirs=o["dirs"],
                mirrors=o["mirrors"],
                route=o["route"],
                direct=o["direct"],
                select={n for n, _ in items},
                report=exchanged,
                env=True,
                inherit=False,
            ):
                self.report["tensors"] += 1
                yield source.prefix + name, t
            self.report["exchange"] = exchanged
            return
        stream = _native.Stream(
            folder,
            dirs=o["dirs"],
            mirrors=o["mirrors"],
            route=o["route"],
            direct=o["direct"],
            window=o["window"],
            items=items,
            env=True,
            # vLLM copies each tensor into its parameters and drops it, and
            # its workers fork nothing: no hand-over to forked children
            # (which splits the mapping's huge pages, 10% of this load).
            inherit=False,
        )
        for name, dtype, shape, payload in stream:
            self.report["tensors"] += 1
            yield source.prefix + name, to_torch(payload, dtype, shape)


    def _vllm_weights(self, source, files):
        """``files`` (not safetensors) through vLLM's own ``.pt``/``.bin``
        iterator, as its default loader reads them, with ``source``'s
        prefix; each file named in vLLM's log."""
        lc = self.load_config
        logger.warning(
            "weightstream: %d file(s) of %s are not safetensors and are read by vLLM's own iterator (torch.load, through "
            "the page cache): %s",
            len(files),
            source.model_or_path,
            ", ".join(os.path.basename(f) for f in sorted(files)),
        )
        self.report["vllm_files"] += sorted(files)
        for name, tensor in pt_weights_iterator(files, lc.use_tqdm_on_load, lc.pt_load_map_location):
            self.report["vllm_tensors"] += 1
            yield source.prefix + name, tensor


def _index_shards(index_path):
    """The shard names an index's weight map names, or None without an
    index."""
    import json

    if not os.path.isfile(index_path):
        return None
    with open(index_path) as f:
        return set(json.load(f).get("weight_map", {}).values())


def _tp_group():
    """The tensor-parallel group's CPU process group when there is more
    than one rank in it, else None."""
    from vllm.distributed import get_tensor_model_parallel_world_size, get_tp_group

    if get_tensor_model_parallel_world_size() <= 1:
        return None
    return get_tp_group().cpu_group


class _Prepare:
    """Makes the model's parameters ready to be written while the reads
    run, on a thread of its own: vLLM allocates them empty, and its copies
    would otherwise fault each 4 KiB page in (and clear it) on the thread
    that copies. Each parameter's storage gets MADV_HUGEPAGE (2 MiB pages
    inside it) and MADV_POPULATE_WRITE, in the model's order (roughly the
    checkpoint's, which the copies follow). No byte of a parameter
    changes; a refusal (a kernel before 5.14) ends the helper, said in the
    report. Measured on the benchmark's 1.85 GB model: the load 10% faster
    (docs/benchmarks/2026-12-03-vllm)."""

    def __init__(self, model):
        import threading

        self._stop = threading.Event()
        self.result = {"storages": 0, "bytes": 0, "refused": None}
        seen, self._ranges = set(), []
        for p in model.parameters() if model is not None else ():
            try:
                st = p.data.untyped_storage()
                ptr, n = st.data_ptr(), st.nbytes()
            except Exception:  # noqa: BLE001 - a parameter without plain CPU storage
                continue
            if p.device.type != "cpu" or n == 0 or ptr in seen:
                continue
            seen.add(ptr)
            self._ranges.append((ptr, n))
        self._thread = threading.Thread(target=self._run, name="ws-vllm-prepare", daemon=True)
        self._thread.start()

    def _run(self):
        for ptr, n in self._ranges:
            if self._stop.is_set():
                return
            why = _native._prepare_for_writes(ptr, n, True)
            if why is not None:
                self.result["refused"] = why
                return
            self.result["storages"] += 1
            self.result["bytes"] += n

    def stop(self):
        """Stops the helper (it finishes the storage in hand) and returns
        what it prepared."""
        self._stop.set()
        self._thread.join()
        return self.result
