"""Imported in each vLLM worker process of a tensor-parallel arm
(benches/vllm/arm.py names it as vLLM's ``worker_extension_cls``, so each
spawned worker imports it before it loads the model): every loader's
``load_weights`` is timed the same way, whatever the format logs, with
the worker's CPU (user + system, getrusage) and its bytes read from
storage (``/proc/self/io`` read_bytes) over it. ``TimedLoads.weight_phase``
(called through ``LLM.collective_rpc``) returns them per worker."""

import os
import sys
import time

from vllm.model_executor.model_loader.base_loader import BaseModelLoader

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchlib import cpu_seconds as _cpu  # noqa: E402

PHASE = {}


def _read_bytes():
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


_load_model = BaseModelLoader.load_model


def _timed_load_model(self, *a, **k):
    cls = type(self)
    if not cls.__dict__.get("_tp_timer_wrapped", False):
        inner = cls.load_weights

        def load_weights(s, model, model_config):
            r0, c0, t0 = _read_bytes(), _cpu(), time.perf_counter()
            out = inner(s, model, model_config)
            r1 = _read_bytes()
            PHASE.update(
                seconds=time.perf_counter() - t0,
                cpu_seconds=_cpu() - c0,
                read_bytes=None if r0 is None or r1 is None else r1 - r0,
                loader=cls.__name__,
            )
            return out

        cls.load_weights = load_weights
        cls._tp_timer_wrapped = True
    return _load_model(self, *a, **k)


BaseModelLoader.load_model = _timed_load_model


class TimedLoads:
    """Mixed into vLLM's worker class: ``weight_phase()`` is this worker's
    timed load."""

    def weight_phase(self):
        out = dict(PHASE, pid=os.getpid())
        if PHASE.get("loader") == "WeightstreamModelLoader":
            # Where a weightstream load's time went: the plan (select, trace
            # or cache, check, rehome), the reads shared with the other ranks,
            # this rank's own fill.
            from weightstream import _vllm_loader

            plan = (_vllm_loader.LAST_REPORT or {}).get("plan", {})
            out["plan"] = {k: plan.get(k) for k in ("plan_seconds", "fill_seconds", "in_place_bytes", "staged_bytes")}
            out["plan"]["shared"] = plan.get("shared")
        return out
