"""The ``weightstream`` load format's options (``--model-loader-extra-config``):
what ``weightstream.vllm`` documents and the loader (``_vllm_loader``)
reads, in a module of their own so that neither imports the other."""

# The options `--model-loader-extra-config` may give.
OPTIONS = ("dirs", "mirrors", "route", "direct", "window", "tp", "prepare", "plan", "plan_cache")
# With tensor parallelism each rank reads its own slices (with the plan,
# the tensors no rank can read its part of alone together with the group:
# _tp_share). "exchange" (the ranks splitting every tensor's reads and
# sending each other the rest over the group) was removed: it read 0.50
# of the model per rank but ran at 0.86x vLLM's default loader, where the
# plan's shared reads read 0.50 and ran over 2x it
# (docs/benchmarks/2026-12-07-vllm-tp-share).
TP_MODES = ("each",)
REMOVED_TP = {
    "exchange": "tp: exchange was removed: with the load plan each rank reads 0.50 of the model and the load runs over 2x "
    "vLLM's default loader at TP=2, where exchange ran at 0.86x it (docs/benchmarks/2026-12-07-vllm-tp-share); "
    "leave tp out"
}
DEFAULT_TP = "each"
DEFAULT_WINDOW = 8


def _paths(value, key):
    """A list of folders: a JSON list, or one string of `;`/`,`-separated
    folders (as WEIGHTSTREAM_MODEL_DIRS)."""
    if isinstance(value, str):
        return [p.strip() for p in value.replace(";", ",").split(",") if p.strip()]
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        return list(value)
    raise ValueError(f"load format weightstream: {key} must be a list of folders or a string of them, got {value!r}")


def parse_options(extra):
    """The loader's options from `model_loader_extra_config` (None or a
    dict): `dirs`, `mirrors` (lists, or `;`/`,`-separated strings),
    `route`, `direct` (strings, parsed by the library when the model is
    opened), `window` (reads in flight, 1 to 1024, default 8), `tp`
    ("each", the only mode left; "exchange" is refused, naming why),
    `prepare` (make the
    parameters' pages ready for vLLM's copies on a helper thread while the
    reads run; default true), `plan` (trace the model's own weight loaders
    on metadata stand-ins and read each tensor's bytes straight into the
    parameters it lands in; what cannot be planned goes through the
    loaders as before; default true), `plan_cache` (the folder traced
    plans are kept in and found again, keyed by the model, its config, the
    rank and the checkpoint's headers; false for none; default
    $WEIGHTSTREAM_PLAN_CACHE or ~/.cache/weightstream/vllm-plans). An unknown key or a
    bad value is a ValueError naming it, before anything is read."""
    if extra is None:
        extra = {}
    if not isinstance(extra, dict):
        raise ValueError(f"load format weightstream: model_loader_extra_config must be a dict, got {type(extra).__name__}")
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise ValueError(f"load format weightstream: unknown extra config keys {unknown} (it takes {list(OPTIONS)})")
    opts = {"dirs": None, "mirrors": None, "route": None, "direct": None, "window": DEFAULT_WINDOW, "tp": DEFAULT_TP, "prepare": True, "plan": True, "plan_cache": None}
    for key in ("dirs", "mirrors"):
        if extra.get(key) is not None:
            opts[key] = _paths(extra[key], key)
    for key in ("route", "direct"):
        if extra.get(key) is not None:
            if not isinstance(extra[key], str):
                raise ValueError(f"load format weightstream: {key} must be a string, got {extra[key]!r}")
            opts[key] = extra[key]
    w = extra.get("window", DEFAULT_WINDOW)
    if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= 1024:
        raise ValueError(f"load format weightstream: window must be an integer from 1 to 1024, got {w!r}")
    opts["window"] = w
    tp = extra.get("tp", DEFAULT_TP)
    if isinstance(tp, str) and tp in REMOVED_TP:
        raise ValueError(f"load format weightstream: {REMOVED_TP[tp]}")
    if tp not in TP_MODES:
        raise ValueError(f"load format weightstream: tp must be one of {list(TP_MODES)}, got {tp!r}")
    opts["tp"] = tp
    prepare = extra.get("prepare", True)
    if not isinstance(prepare, bool):
        raise ValueError(f"load format weightstream: prepare must be true or false, got {prepare!r}")
    opts["prepare"] = prepare
    plan = extra.get("plan", True)
    if not isinstance(plan, bool):
        raise ValueError(f"load format weightstream: plan must be true or false, got {plan!r}")
    opts["plan"] = plan
    cache = extra.get("plan_cache")
    if cache is not None and cache is not False and not (isinstance(cache, str) and cache.strip()):
        raise ValueError(f"load format weightstream: plan_cache must be a folder or false, got {cache!r}")
    opts["plan_cache"] = cache.strip() if isinstance(cache, str) else cache
    return opts
