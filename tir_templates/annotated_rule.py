"""A dlight-style schedule rule for the PrimFuncs a graph pass marked: one of its blocks carries
the rule's annotation (``NormGEMVFusion``'s norm + GEMV, ``SplitKGEMV``'s transposed-weight GEMV).

``apply(func, target, tunable)`` returns None for a function without the annotation, else the
subclass's ``schedule(func, max_threads)`` with the target's ``max_num_threads`` (the pipeline's
rKernel target: ``RammerConfig.max_rtask_threads``; 256 without a target), or None where a
schedule primitive fails (logged at debug level with its reason: dlight schedules it then).
"""
from __future__ import annotations

import logging

import tvm_ffi
from tvm import s_tir, tirx

__all__ = ["AnnotatedRule"]

LOG = logging.getLogger(__name__)


class AnnotatedRule:
    """Base of a rule for marked PrimFuncs (module docstring). Subclasses set ``annotation`` and
    ``schedule_name`` (``default_schedule.SCHEDULED_BY_ATTR`` of what it schedules) and define
    ``schedule(func, max_threads) -> s_tir.Schedule``, raising where it does not apply."""

    annotation = ""
    schedule_name = ""

    def schedule(self, func: tirx.PrimFunc, max_threads: int):
        raise NotImplementedError

    def apply(self, func, target=None, _tunable=False):
        if not isinstance(func, tirx.PrimFunc):
            return None
        marked = []
        tvm_ffi.structural_walk(func.body, [(s_tir.SBlock, lambda b: marked.append(
            self.annotation in b.annotations))])
        if not any(marked):
            return None
        max_threads = 256
        if target is not None and hasattr(target, "attrs"):
            max_threads = int(target.attrs.get("max_num_threads", 256))
        try:
            return self.schedule(func, max_threads)
        except Exception as err:  # pylint: disable=broad-except  (a failing primitive: no apply)
            LOG.debug("tvm-rammer: %s does not apply: %s", type(self).__name__,
                      (str(err).strip().splitlines() or [type(err).__name__])[-1])
            return None
