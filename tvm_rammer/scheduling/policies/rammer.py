"""The ``rammer`` policy: Rammer's wavefront scheduling, Algorithm 1 of the paper (OSDI'20, 3.3).

It lives in ``tvm_rammer.scheduling.policy`` with the placement primitives every policy shares (SelectRKernels,
SelectvEU, Append/Wait in ``materialize``); this module only names it for the registry.
"""
from ..policy import schedule

__all__ = ["schedule"]
