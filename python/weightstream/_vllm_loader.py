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

import collections
import dataclasses
import json
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

# The last load's report in this process (tests, benches: read in the
# worker through LLM.apply_model).
LAST_REPORT = None

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
        self.report = self.new_report()

    @staticmethod
    def new_report():
        """An empty report of one load: what `load_weights` fills."""
        return {
            "tensors": 0,
            "bytes": 0,
            "skipped_experts": 0,
            "skipped_unused": 0,
            "vllm_files": [],
            "vllm_tensors": 0,
            "warnings": [],
            "drives": {},
        }

    def download_model(self, model_config):
        self._default.download_model(model_config)

    def load_weights(self, model, model_config):
        d = self._default
        self._model_config = model_config
        d._init_ep_weight_filter(model_config)
        d._init_mm_encoder_only_weight_filter(model, model_config)
        self.report = self.new_report()
        t0 = time.perf_counter()
        read0 = _read_bytes()
        why_not = self._why_no_plan(model_config)
        if why_not is None:
            loaded = self._load_planned(model)
        else:
            self.report["plan"] = {"used": False, "why_not": why_not}
            prep = _Prepare(model if self.options["prepare"] else None)
            try:
                loaded = model.load_weights(self._all_weights(model))
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
        self.report["read_bytes"] = _read_bytes() - read0
        global LAST_REPORT
        LAST_REPORT = self.report
        self._log(seconds)
        track = d.enable_weights_track
        if track is None:
            track = model_config.quantization is None and loaded is not None
        if track:
            d.track_weights_loading(model, loaded, quantized=model_config.quantization is not None)

    def _why_no_plan(self, model_config):
        """Why this load does not take the plan (None when it does)."""
        if not self.options["plan"]:
            return "the plan option is false"
        if model_config.quantization is not None:
            return f"a quantized model ({model_config.quantization}): its loaders repack the checkpoint's layout"
        return None

    def _log(self, seconds):
        """What was read, once per load, in vLLM's log: the weight phase,
        the plan (planned, fallback by reason, unused), the drives, and
        the engine's warnings."""
        r = self.report
        plan = r.get("plan", {})
        logger.info(
            "Loading weights took %.2f seconds (weightstream: %d tensors, %.3f GB, %.2f GB/s; %d experts of other ranks "
            "and %d unused weights not read; %d tensors from %d file(s) that are not safetensors read by vLLM's own "
            "iterator; %.3f GB read from storage by this process)",
            seconds,
            r["tensors"],
            r["bytes"] / 1e9,
            r["bytes"] / 1e9 / max(seconds, 1e-9),
            r["skipped_experts"],
            r["skipped_unused"],
            r["vllm_tensors"],
            len(r["vllm_files"]),
            r["read_bytes"] / 1e9,
        )
        if plan.get("used"):
            logger.info(
                "weightstream plan: %d tensors (%.3f GB) read straight into the parameters (%.3f GB in place, %.3f GB "
                "staged and copied; %d parameters moved in phase with their files), %d tensors (%.3f GB) through vLLM's loaders, %d the model does not use (not "
                "read); %s in %.3f s (%d run(s) of the loaders)%s",
                plan["planned_tensors"],
                plan["planned_bytes"] / 1e9,
                plan["in_place_bytes"] / 1e9,
                plan["staged_bytes"] / 1e9,
                plan["rehomed"]["parameters"],
                plan["fallback_tensors"],
                plan["fallback_bytes"] / 1e9,
                plan["unused_tensors"],
                "plan from the cache" if plan["cache"]["state"] == "hit" else "traced",
                plan["trace_seconds"],
                plan["trace_runs"],
                "" if plan["cache"]["state"] in ("hit", "kept", "off") else f"; plan cache: {plan['cache']['why']}",
            )
            shared = plan.get("shared")
            if shared is not None and shared["why_not"] is None:
                logger.info(
                    "weightstream plan: %d tensors (%.3f GB) read together by the %d tensor-parallel ranks (a part "
                    "of a rank is too narrow to read alone): this rank read %.3f GB of them, %.3f GB alone; %d "
                    "batch(es) through a %.0f MiB buffer, %.3f s",
                    shared["tensors"],
                    shared["bytes"] / 1e9,
                    shared["ranks"],
                    shared["read_bytes"] / 1e9,
                    shared["alone_bytes"] / 1e9,
                    shared["batches"],
                    shared["buffer_bytes"] / 2**20,
                    shared["seconds"],
                )
            elif shared is not None:
                logger.info("weightstream plan: no tensor read together by the tensor-parallel ranks: %s", shared["why_not"])
            for field, why in (
                ("too_large", "larger than the shared buffer's half and landing where rows cannot be cut"),
                ("on_device", "landing on a device (the shared buffer is host memory)"),
            ):
                names = (shared or {}).get(field) or []
                if names:
                    logger.info(
                        "weightstream plan: %d tensors this rank read alone, though it cannot read its part alone: %s (%s%s)",
                        len(names),
                        why,
                        ", ".join(names[:4]),
                        ", ..." if len(names) > 4 else "",
                    )
            for reason, g in plan["fallback_reasons"].items():
                logger.info(
                    "weightstream plan: %d tensors (%.3f GB) through vLLM's loaders: %s (%s%s)",
                    g["tensors"],
                    g["bytes"] / 1e9,
                    reason,
                    ", ".join(g["names"]),
                    ", ..." if g["tensors"] > len(g["names"]) else "",
                )
            for reason, names in plan["rehomed"].get("stayed", {}).items():
                logger.info(
                    "weightstream plan: %d parameters left where vLLM put them (read staged where out of phase): %s (%s%s)",
                    len(names),
                    reason,
                    ", ".join(names[:8]),
                    ", ..." if len(names) > 8 else "",
                )
        elif plan:
            logger.info("weightstream plan: not used: %s", plan["why_not"])
        if r["drives"]:
            logger.info(
                "weightstream drives: %s",
                "; ".join(f"{dev}: {b / 1e9:.3f} GB" for dev, b in sorted(r["drives"].items())),
            )
        for message in r["warnings"]:
            logger.warning("weightstream: %s", message)

    def _warnings(self, engine):
        """Adds ``engine``'s (a Reader's or a Stream's) warnings and bytes per
        drive to the report: each warning said once per load."""
        import json

        try:
            stats = json.loads(engine.stats_json())
        except Exception as e:  # noqa: BLE001 - a closed engine: its stats are gone, nothing to add
            logger.debug("weightstream: no stats from %r: %s", engine, e)
            return
        for w in stats.get("warnings", ()):
            msg = w.get("message")
            if msg and msg not in self.report["warnings"]:
                self.report["warnings"].append(msg)
        for d in stats.get("drives", ()):
            key = d.get("device") or str(d.get("mount"))
            self.report["drives"][key] = self.report["drives"].get(key, 0) + int(d.get("bytes", 0))

    def _sources(self, model):
        """The model's checkpoint sources: its own, then its secondary
        weights (vLLM's ``secondary_weights``)."""
        primary = DefaultModelLoader.Source(
            self._model_config.model,
            self._model_config.revision,
            prefix="",
            fall_back_to_pt=False,
            allow_patterns_overrides=getattr(model, "allow_patterns_overrides", None),
            is_unused_weight=getattr(model, "is_unused_checkpoint_weight", None),
        )
        return [primary, *getattr(model, "secondary_weights", ())]

    def _load_planned(self, model):
        """The load with a plan: the model's own ``load_weights`` traced on
        metadata stand-ins (``_weight_plan``), the plan checked, each
        planned tensor's bytes read straight into its parameters
        (``Engine::fill``; a parameter on a device through pinned staging,
        ``load_into``'s pipeline), then ``load_weights`` run on the real
        tensors of what fell back and of the files that are not
        safetensors. Returns the names the loaders loaded."""
        # With tensor parallelism the ranks read some tensors together
        # (_tp_share): every rank then joins the group's collectives, and
        # one that fails before them says so to the others (they raise
        # too, rather than wait for it).
        group = _tp_group()
        readers = {}
        # Whether this rank has joined the group's agreement (from then on
        # the collectives carry its errors themselves).
        self._tp_joined = False
        try:
            try:
                t0 = time.perf_counter()
                sels = [self._select(s) for s in self._sources(model)]
                traced = self._plan(model, sels, readers)
                # Selecting, tracing (or the cache), checking, moving in phase.
                self._plan_seconds = time.perf_counter() - t0
                return self._fill_planned(model, sels, readers, traced, group)
            except BaseException as e:
                if group is not None and not self._tp_joined:
                    from . import _tp_share

                    _tp_share.abandon(group, e)
                raise
        finally:
            # Closed whatever happened (a refused plan, a failed read, a
            # loader that raised): no Reader outlives its load.
            for r in readers.values():
                r.close()

    def _plan(self, model, sels, readers):
        """The plan of ``sels``: each source's Reader opened into
        ``readers`` (empty; the caller closes them), the stand-ins traced
        (or the plan cache's), checked, the parameters it fills whole moved
        in phase. Returns ``(trace, plan, rehomed, cache, packed, nbytes)``."""
        import torch  # noqa: F401 - the stand-ins and the fill are torch's

        from . import _weight_plan as wp
        from ._convert import torch_dtype, torch_shape

        o = self.options
        stand_ins, packed = [], {}
        nbytes = {}
        for i, sel in enumerate(sels):
            if not sel["items"]:
                continue
            r = _native.Reader(sel["folder"], dirs=o["dirs"], mirrors=o["mirrors"], route=o["route"], direct=o["direct"], env=True)
            readers[i] = r
            prefix = sel["source"].prefix
            for n in sel["items"]:
                dtype, shape, size, _off = r.info(n)
                nbytes[(i, n)] = size
                if dtype == "F4":
                    # Two elements to a byte in torch: a box of the header's
                    # elements is not one of torch's.
                    packed[(i, n)] = "a packed dtype (F4: two elements per byte)"
                    continue
                stand_ins.append(wp.StandIn(prefix + n, (i, n), torch_dtype(dtype), torch_shape(dtype, shape, n)))
        tr, cache = self._trace(model, stand_ins)
        plan = wp.check(tr, model, stand_ins)
        # Parameters a planned tensor fills whole, out of phase with its
        # file offset, move to memory of their own in phase (before the
        # helper prepares their pages): the reads land in them in place.
        rehomed = wp.rehome(plan, model, readers, tr.other_writes)
        return tr, plan, rehomed, cache, packed, nbytes

    def _fill_planned(self, model, sels, readers, traced, group):
        """Reads the plan (``_plan``'s) into the parameters: with a
        tensor-parallel ``group``, the tensors no rank can read its part of
        alone together with the group while the rest is read alone
        (``_fill_with_group``); then what fell back through the loaders.
        Returns the names the loaders loaded."""
        from . import _weight_plan as wp

        o = self.options
        tr, plan, rehomed, cache, packed, nbytes = traced
        # The planned parameters get the huge-page advice only: the fill's
        # reads fault their pages in as they land (see _Prepare).
        planned_storages = []
        for w in plan.writes:
            if w.dest.device.type == "cpu":
                st = w.dest.untyped_storage()
                planned_storages.append((st.data_ptr(), st.nbytes()))
        prep = _Prepare(model if o["prepare"] else None, advise_only=planned_storages)
        fallback = collections.OrderedDict(packed)
        fallback.update(plan.fallback)
        info = {
            "used": True,
            "plan_seconds": self._plan_seconds,
            "trace_seconds": tr.seconds,
            "trace_runs": tr.runs,
            "rehomed": rehomed,
            "cache": cache,
        }
        force_pipeline = os.environ.get("WEIGHTSTREAM_FORCE_DEVICE_PATH", "") not in ("", "0")
        try:
            t_fill = time.perf_counter()
            if group is None:
                info.update(wp.fill(plan, readers, pipeline=force_pipeline))
            else:
                info.update(self._fill_with_group(plan, readers, group, force_pipeline, info))
            info["fill_seconds"] = time.perf_counter() - t_fill
        finally:
            self.report["prepared"] = prep.stop()
        for r in readers.values():
            self._warnings(r)
        planned = set(plan.planned)
        self.report["tensors"] += len(planned)
        self.report["bytes"] += sum(nbytes[k] for k in planned)
        info["planned_tensors"] = len(planned)
        info["planned_bytes"] = sum(nbytes[k] for k in planned)
        info["unused_tensors"] = len(plan.unused)
        info["unused_bytes"] = sum(nbytes[k] for k in plan.unused)
        info["fallback_tensors"] = len(fallback)
        info["fallback_bytes"] = sum(nbytes[k] for k in fallback)
        reasons = collections.OrderedDict()
        for k, why in fallback.items():
            g = reasons.setdefault(why, {"tensors": 0, "bytes": 0, "names": []})
            g["tensors"] += 1
            g["bytes"] += nbytes[k]
            if len(g["names"]) < 3:
                g["names"].append(sels[k[0]]["source"].prefix + k[1])
        info["fallback_reasons"] = reasons
        self.report["plan"] = info
        # The planned reads are done: their Readers go before the rest is
        # streamed (the finally above closes them again, a no-op).
        for r in readers.values():
            r.close()
        # What was not planned: through the loaders, as the load without a
        # plan would hand it (file order, vLLM's iterator for the rest).
        loaded = set(tr.loaded or ()) if tr.whole_reason is None else set()
        if fallback or any(sel["others"] for sel in sels):

            def rest():
                for i, sel in enumerate(sels):
                    if sel["others"]:
                        yield from self._vllm_weights(sel["source"], sel["others"])
                    names = [n for n in sel["items"] if (i, n) in fallback]
                    if names:
                        yield from self._stream(sel, names)

            more = model.load_weights(rest())
            if more is None:
                return None if tr.loaded is None else loaded
            loaded |= set(more)
        elif tr.loaded is None:
            return None
        return loaded

    def _fill_with_group(self, plan, readers, group, pipeline, info):
        """``plan``'s reads with a tensor-parallel ``group``: the tensors no
        rank can read its part of alone with the group (``_tp_share``, on
        this thread: its collectives), the rest alone at the same time (on a
        thread of its own: the two share the engine, whose fills share
        its staging). Returns ``wp.fill``'s byte counts; ``info["shared"]``
        gets the shared reads' report. Returns only once neither reads."""
        import threading

        from . import _tp_share
        from . import _weight_plan as wp

        block = max((r.direct_align() for r in readers.values()), default=4096)
        # split joins the agreement whatever happens in it (its errors go
        # to every rank through the gather).
        self._tp_joined = True
        own, shared = _tp_share.split(plan, readers, group, block)
        info["shared"] = shared.report
        got, failed = {}, []

        def own_fill():
            try:
                got.update(wp.fill(own, readers, pipeline=pipeline))
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below
                failed.append(e)

        worker = threading.Thread(target=own_fill, name="ws-vllm-own-fill", daemon=True)
        worker.start()
        try:
            done = _tp_share.run(shared, readers, block)
        finally:
            # Never return (or raise) while the other fill still reads into
            # the parameters.
            worker.join()
        if failed:
            raise failed[0]
        if not done:
            # No shared buffer (every rank alike, said in the report): this
            # rank reads them alone.
            alone = wp.Plan()
            alone.writes = [w for ws in shared.writes.values() for w in ws]
            for k, v in wp.fill(alone, readers, pipeline=pipeline).items():
                got[k] = got.get(k, 0) + v
        return got

    def _trace(self, model, stand_ins):
        """The plan's trace: from the plan cache when it holds this model's
        (``_plan_cache``), else traced, and kept there when a replay is all
        the loader did. Returns ``(trace, cache)``: ``cache`` is a dict
        (``state``: "off", "hit", "kept", "not kept" or "refused";
        ``why``; ``file``) for the report and the log."""
        from . import _plan_cache as pc
        from . import _weight_plan as wp

        directory = self.options["plan_cache"]
        if directory is False:
            return wp.trace(model.load_weights, model, stand_ins), {"state": "off", "why": "plan_cache is false", "file": None}
        directory = directory or pc.default_dir()
        key = pc.digest(model, stand_ins, _plan_context(self._model_config))
        path = os.path.join(directory, key + ".json")
        tr, refused = pc.load(directory, key, model, stand_ins)
        if tr is not None:
            return tr, {"state": "hit", "why": None, "file": path}
        before = pc.attributes(model)
        tr = wp.trace(model.load_weights, model, stand_ins)
        why = pc.store(directory, key, tr, model, before)
        if refused is not None:
            logger.warning("weightstream plan: a kept plan was refused and the loaders traced again: %s", refused)
            return tr, {"state": "refused", "why": refused, "file": path}
        return tr, {"state": "kept" if why is None else "not kept", "why": why, "file": path}

    def _all_weights(self, model):
        for source in self._sources(model):
            yield from self._source_weights(source)

    def _select(self, source):
        """What of ``source`` is read, and how: a dict with ``source``,
        ``folder``, ``items`` (the safetensors tensors vLLM would read,
        ``[name]`` in file order, after vLLM's filters) and ``others`` (its
        files that are not safetensors, for vLLM's own iterator)."""
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
        sel = {"source": source, "folder": folder, "items": [], "others": []}
        # What weightstream does not read (a model's `.pt` or `.bin` heads,
        # such as BGE-M3's sparse_linear.pt, named by the source's own
        # patterns): vLLM's own iterator reads it, as `auto` would, said in
        # vLLM's log with the files named. Never a weight skipped.
        sel["others"] = [f for f in files if not f.endswith(".safetensors")]
        files = [f for f in files if f.endswith(".safetensors")]
        if not files:
            return sel
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

        for name, _dtype, _shape, nbytes, file, offset, _drives in sorted(catalog, key=lambda e: (e[4], e[5], e[0])):
            if not wanted(file):
                continue
            if source.is_unused_weight is not None and source.is_unused_weight(name):
                self.report["skipped_unused"] += 1
                continue
            if should_skip_weight(name, d.local_expert_ids):
                self.report["skipped_experts"] += 1
                continue
            sel["items"].append(name)
        return sel

    def _source_weights(self, source):
        """``source``'s tensors for ``model.load_weights``: its other files
        through vLLM's iterator, then weightstream's stream."""
        sel = self._select(source)
        if sel["others"]:
            yield from self._vllm_weights(source, sel["others"])
        if sel["items"]:
            yield from self._stream(sel, sel["items"])

    def _stream(self, sel, names):
        """``names`` of ``sel``'s folder, each in memory of its own, in the
        order given, ``window`` reads in flight."""
        o = self.options
        source, folder = sel["source"], sel["folder"]
        stream = _native.Stream(
            folder,
            dirs=o["dirs"],
            mirrors=o["mirrors"],
            route=o["route"],
            direct=o["direct"],
            window=o["window"],
            items=[(n, None) for n in names],
            env=True,
            # vLLM copies each tensor into its parameters and drops it, and
            # its workers fork nothing: no hand-over to forked children
            # (which splits the mapping's huge pages, 10% of this load).
            inherit=False,
        )
        for name, dtype, shape, payload in stream:
            t = to_torch(payload, dtype, shape)
            self.report["tensors"] += 1
            self.report["bytes"] += t.numel() * t.element_size()
            yield source.prefix + name, t
        self._warnings(stream)

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


def _plan_context(model_config):
    """What a traced plan depends on beyond the model's layout and the
    checkpoint's headers: the versions, the model's config, its dtype and
    quantization, and this process's rank in each parallel group."""
    import torch
    import vllm

    from . import __version__

    ctx = {
        "weightstream": __version__,
        "vllm": getattr(vllm, "__version__", None),
        "torch": torch.__version__,
        "dtype": str(getattr(model_config, "dtype", None)),
        "quantization": getattr(model_config, "quantization", None),
    }
    try:
        ctx["hf_config"] = model_config.hf_config.to_json_string(use_diff=False)
    except Exception:  # noqa: BLE001 - a config without transformers' serializer
        ctx["hf_config"] = repr(model_config.hf_config)
    try:
        from vllm.distributed import parallel_state as ps

        for group in ("tp", "pp", "dp", "ep"):
            g = getattr(ps, f"_{group.upper()}", None)
            if g is not None:
                ctx[group] = [g.rank_in_group, g.world_size]
    except Exception:  # noqa: BLE001 - no parallel state (a model built outside vLLM's workers)
        pass
    return ctx


def _read_bytes():
    """Bytes this process has had read from storage (``/proc/self/io``'s
    read_bytes, all its threads; 0 where the kernel does not say)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


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


# The planned storages are populated in pieces of this size (at 4-10 GB/s
# a piece is 3-8 ms of clearing), each only if the CPUs were idle for at
# least IDLE_CPUS over the last IDLE_WINDOW_S or more; else the helper
# looks again after IDLE_POLL_S. A whole CPU: the helper is one thread
# that keeps one busy, so it runs only where it takes no CPU from the
# reads (half a CPU let it populate 0.2-0.73 GB on memloop, where the
# drive's own workers need the CPUs, in 2 of 3 runs, 0.47-1.01 s; a
# whole CPU, 0 GB and 0.39-0.50 s; on the machine's disk both populate
# every byte).
PLANNED_PIECE = 32 << 20
IDLE_WINDOW_S = 0.05
IDLE_POLL_S = 0.005
IDLE_CPUS = 1.0


def _planned_populate_mode():
    """WEIGHTSTREAM_VLLM_POPULATE_PLANNED: idle (the default), never or
    always (an unknown word is idle); a knob for measurements."""
    v = os.environ.get("WEIGHTSTREAM_VLLM_POPULATE_PLANNED", "idle").strip().lower()
    return v if v in ("idle", "never", "always") else "idle"


def _cpu_idle():
    """(idle CPU seconds, wall seconds) now: the machine's idle and iowait
    time of /proc/stat's `cpu` line; (0, now) where it cannot be read
    (then nothing counts as idle)."""
    import time

    t = time.monotonic()
    try:
        with open("/proc/stat") as f:
            v = f.readline().split()[1:]
        return (int(v[3]) + int(v[4])) / os.sysconf("SC_CLK_TCK"), t
    except (OSError, ValueError, IndexError):
        return 0.0, t


class _Prepare:
    """Makes the model's parameters ready to be written while the reads
    run: vLLM allocates them empty, and its copies would otherwise fault
    each 4 KiB page in (and clear it) on the thread that copies.

    Every parameter's storage gets MADV_HUGEPAGE at once, here (no page is
    touched, microseconds each): whatever faults a page in first, a copy
    or an O_DIRECT read landing in place, then takes a whole 2 MiB page.
    Then a thread of its own populates them (MADV_POPULATE_WRITE), in the
    model's order (roughly the checkpoint's, which the copies follow),
    then ``advise_only``: ``(address, bytes)`` of storages a plan's reads
    land in, in the fill's order, each piece only while a CPU is spare
    (``_run_planned``): the reads fault their own pages in as they land,
    and clearing ahead of them helps only where they leave CPUs idle. No
    byte of a parameter changes; a refusal (a kernel before 5.14) ends the
    helper, said in the report.

    Measured on the benchmark's 1.85 GB model: the load without a plan 10%
    faster (docs/benchmarks/2026-12-03-vllm). With the plan (cold, 3
    runs each, benches/vllm/arm.py): the fill 0.46-0.50 s with the helper
    alone, 0.38-0.40 s with the advice first, 0.34 s with the advice and
    no populating of the planned storages on zram; 0.40-0.43 s and
    0.38-0.39 s for the last two on memloop."""

    def __init__(self, model, advise_only=()):
        import threading

        self._stop = threading.Event()
        self.result = {"storages": 0, "bytes": 0, "advised": 0, "refused": None}
        self._ranges = []
        if model is None:
            self._thread = None
            return
        advised = []
        seen = set()
        for ptr, n in advise_only:
            if n and ptr not in seen:
                seen.add(ptr)
                advised.append((ptr, n))
        for p in model.parameters():
            try:
                st = p.data.untyped_storage()
                ptr, n = st.data_ptr(), st.nbytes()
            except Exception:  # noqa: BLE001 - a parameter without plain CPU storage
                continue
            if p.device.type != "cpu" or n == 0 or ptr in seen:
                continue
            seen.add(ptr)
            self._ranges.append((ptr, n))
        for ptr, n in advised + self._ranges:
            why = _native._prepare_for_writes(ptr, n, True, False)
            if why is not None:
                self.result["refused"] = why
                self._ranges = []
                break
            self.result["advised"] += 1
        self._advised = advised if self.result["refused"] is None else []
        self._mode = _planned_populate_mode()
        self.result.update(planned_mode=self._mode, planned_bytes=0, planned_waits=0)
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
        if self._mode != "never":
            self._run_planned()

    def _run_planned(self):
        """The planned storages, in the fill's order, a piece at a time,
        each only while a CPU is spare (``idle``, the default): on a slow
        drive the reads leave the CPUs waiting, and a page cleared here is
        one the read landing in it does not clear; on a fast one the reads
        keep the CPUs busy, and populating would only take CPU from them
        (docs/benchmarks/2026-12-07-vllm-plan-cache: the helper populating
        them was 10% faster on the virtio disk, slower on memloop and
        zram). Spare: at least IDLE_CPUS of a CPU idle over the last
        IDLE_WINDOW_S or more (/proc/stat counts in 10 ms ticks; this
        thread's own clearing counts as busy). ``always`` populates without
        looking (for comparisons)."""
        import collections as _c

        samples = _c.deque([_cpu_idle()])
        for ptr, n in self._advised:
            at = 0
            while at < n:
                if self._stop.is_set():
                    return
                if self._mode == "idle":
                    now = _cpu_idle()
                    samples.append(now)
                    while len(samples) > 2 and now[1] - samples[1][1] >= IDLE_WINDOW_S:
                        samples.popleft()
                    then = samples[0]
                    if now[1] - then[1] < IDLE_WINDOW_S or (now[0] - then[0]) / (now[1] - then[1]) < IDLE_CPUS:
                        self.result["planned_waits"] += 1
                        self._stop.wait(IDLE_POLL_S)
                        continue
                piece = min(PLANNED_PIECE, n - at)
                why = _native._prepare_for_writes(ptr + at, piece, True)
                if why is not None:
                    self.result["refused"] = why
                    return
                self.result["planned_bytes"] += piece
                at += piece

    def stop(self):
        """Stops the helper (it finishes the storage in hand) and returns
        what it prepared."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return self.result
