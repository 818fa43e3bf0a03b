"""Scheduling policies as plug-ins: each is a pure function

    policy(graph: OpGraph, vdevice: VDevice, config: PolicyConfig, profile) -> list[RProgramPlan]

(rPrograms in execution order, every operator of ``graph`` in exactly one), chosen by
``RammerConfig(policy=...)`` / ``tvm-rammer --policy``. All of them place rTasks with the primitives
of ``tvm_rammer.scheduling.policy`` (SelectRKernels, SelectvEU, Append and Wait), so every policy's output goes
through the same invariant checker (``RProgram.validate``) and codegen.

- ``rammer``: Rammer's Algorithm 1 (wavefront, :mod:`.rammer`);
- ``ios``: IOS's dynamic-programming stage partition (MLSys'21, :mod:`.ios`);
- ``opara``: Opara's resource- and interference-aware launch order (2023, :mod:`.opara`).
"""
from __future__ import annotations

from typing import Callable

from ...config import POLICIES as POLICY_NAMES
from . import ios, opara, rammer

__all__ = ["POLICIES", "Policy", "get_policy"]

Policy = Callable[..., list]

POLICIES: dict[str, Policy] = {
    "rammer": rammer.schedule,
    "ios": ios.schedule,
    "opara": opara.schedule,
}
assert tuple(POLICIES) == POLICY_NAMES, "RammerConfig's POLICIES and the registry name the same policies"


def get_policy(name: str) -> Policy:
    """The policy registered as ``name``; ValueError naming the valid ones otherwise."""
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]
