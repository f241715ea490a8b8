"""vLLM's ``weightstream`` load format: ``vllm serve MODEL --load-format
weightstream`` (or ``LLM(model, load_format="weightstream")``).

This module is what the package's ``vllm.general_plugins`` entry point
names: vLLM calls :func:`register` in each of its processes (the main one,
the engine core, every worker). Registering is idempotent and cheap, does
nothing where vLLM is not installed, and nothing at all happens on
``import weightstream``: only vLLM imports this module.

The loader (``weightstream._vllm_loader``) hands ``model.load_weights``
each tensor as weightstream's stream lands it (every drive busy, reads in
flight while vLLM copies the previous tensors into its parameters), each
in memory of its own: a tensor vLLM keeps stays valid. Options come through
``--model-loader-extra-config`` (JSON): ``dirs`` (split folders),
``mirrors``, ``route``, ``direct``, ``window`` (reads in flight, default
8); the ``WEIGHTSTREAM_*`` variables apply where a key is not given. With
expert parallelism, only the experts of this rank's layers are read.
"""

from ._vllm_options import DEFAULT_TP, DEFAULT_WINDOW, OPTIONS, TP_MODES, parse_options  # noqa: F401 - the documented names

_registered = False


def register():
    """Registers the ``weightstream`` load format with vLLM (once per
    process; nothing where vLLM is not installed)."""
    global _registered
    if _registered:
        return
    try:
        from vllm.model_executor import model_loader as ml
    except ImportError:
        return
    from ._vllm_loader import WeightstreamModelLoader, logger

    # vLLM's register_model_loader says "Registered model loader" at INFO
    # in every process (the engine core, each worker): the table's entry
    # is set here, said at DEBUG.
    ml._LOAD_FORMAT_TO_MODEL_LOADER["weightstream"] = WeightstreamModelLoader
    logger.debug("weightstream: load format registered (%s)", WeightstreamModelLoader.__name__)
    _check_options_in_the_front_end()
    _registered = True


def _check_options_in_the_front_end():
    """Options are parsed where vLLM makes its load config (the front-end
    process, from the command line or LLM(...)): an unknown key or a bad
    value is refused there at once, not in a worker's traceback later."""
    try:
        from vllm.engine.arg_utils import EngineArgs
    except ImportError:
        return
    make = EngineArgs.create_load_config
    if getattr(make, "_weightstream", False):
        return

    def create_load_config(self):
        if self.load_format == "weightstream":
            parse_options(self.model_loader_extra_config or None)
        return make(self)

    create_load_config._weightstream = True
    EngineArgs.create_load_config = create_load_config
