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
from .registry import POLICIES, Policy, get_policy

__all__ = ["POLICIES", "Policy", "get_policy"]
