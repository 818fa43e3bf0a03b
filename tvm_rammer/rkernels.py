"""From TVM objects to the scheduler's abstractions and back.

The policy (:mod:`tvm_rammer.policy`) is pure Python; this module makes its inputs out of lowered TVM
kernels (one ``RKernel`` per dlight-scheduled PrimFunc, an analytical time until profiling exists)
and turns its plans into reports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import tvm

from .config import RammerConfig
from .cost_model import CostModelConfig, rtask_time_us
from .policy import OpGraph, PolicyConfig, schedule
from .rtask import RKernel, ROperator
from .vdevice import VDevice


def vdevice_for(target: tvm.target.Target, config: RammerConfig) -> VDevice:
    """The vDevice: the local GPU when one is visible, else the target arch's preset."""
    overrides = {}
    if config.veus_per_sm is not None:
        overrides["max_blocks_per_sm"] = config.veus_per_sm
    arch = str(target.attrs.get("arch", "sm_90"))
    device = None
    if config.num_sms is None:
        try:
            dev = tvm.cuda(0)
            device = VDevice.from_tvm_device(dev) if dev.exist else None
        except Exception:  # no CUDA runtime
            device = None
    if device is not None:
        return dataclasses.replace(device, **overrides)
    if config.num_sms is not None:
        overrides["num_sms"] = config.num_sms
    return VDevice.for_arch(arch, **overrides)


def cost_config(config: RammerConfig, vdevice: VDevice) -> CostModelConfig:
    """The analytical cost model for this vDevice and config."""
    return CostModelConfig(num_sms=vdevice.num_sms, barrier_us=config.barrier_us,
                           launch_us=config.launch_us)


def policy_config(config: RammerConfig, vdevice: VDevice) -> PolicyConfig:
    """The policy options of a RammerConfig."""
    return PolicyConfig(cost=cost_config(config, vdevice), selection=config.selection,
                        merge=config.merge, max_waits_per_op=config.max_waits_per_op)


def _tensor_bytes(param) -> int:
    ty = param.ty
    return math.prod(int(d) for d in ty.shape) * tvm.runtime.DataType(str(ty.dtype)).bits // 8


def flops_and_bytes(func: tvm.tirx.PrimFunc) -> tuple:
    """FLOPs (TVM's estimate; 1 per output element when it cannot tell) and bytes of every
    parameter read or written once."""
    nbytes = sum(_tensor_bytes(p) for p in func.params)
    try:
        flops = float(tvm.s_tir.analysis.estimate_tir_flops(tvm.IRModule({"main": func})))
    except Exception:  # estimate_tir_flops rejects some opaque loops
        flops = float(nbytes // 4)
    return flops, float(nbytes)


def analytical_us(flops: float, nbytes: float, lowered, config: RammerConfig,
                  vdevice: VDevice) -> float:
    """The analytical per-rTask time of one lowered rKernel of an operator."""
    veus_per_sm = vdevice.occupancy(lowered.threads, None, lowered.shared_bytes)
    return rtask_time_us(flops, nbytes, lowered.num_rtasks, veus_per_sm, cost_config(config, vdevice))


def operator_from_kernel(uid: int, name: str, func, lowered, config: RammerConfig,
                         vdevice: VDevice) -> ROperator:
    """An rOperator with one rKernel: the dlight schedule, timed by the analytical model."""
    flops, nbytes = flops_and_bytes(func)
    time_us = analytical_us(flops, nbytes, lowered, config, vdevice)
    kernel = RKernel(name=name, num_rtasks=lowered.num_rtasks, threads=lowered.threads,
                     registers=None, shared_bytes=lowered.shared_bytes, time_us=time_us,
                     source="dlight", payload=lowered)
    return ROperator(uid=uid, name=name, kernels=[kernel], flops=flops, bytes=nbytes)


# --- rKernel versions (tvm_rammer.tuning) ------------------------------------------------------
@dataclass
class VersionedOperator(ROperator):
    """An rOperator with several rKernel versions and, per version, where its time comes from.

    ``timing[i]`` is ``kernels[i]``'s ``tuning.profiler.Timing`` ("profiled", "database" or
    "analytical"); ``analytical_us[i]`` the analytical model's per-rTask time for comparison.
    """

    timing: list = field(default_factory=list)
    analytical_us: list = field(default_factory=list)


def operator_versions(uid: int, name: str, func, versions, config: RammerConfig, vdevice: VDevice,
                      profiler) -> ROperator:
    """An rOperator with one rKernel per version (``tuning.versions.KernelVersion``), timed by the
    profiler (database, GPU, or the analytical model). ``func`` is the operator's scheduled PrimFunc
    (for its FLOPs and bytes); each version's payload is its LoweredKernel, as for
    :func:`operator_from_kernel`."""
    flops, nbytes = flops_and_bytes(func)
    estimates = {id(v): analytical_us(flops, nbytes, v.lowered, config, vdevice) for v in versions}
    timings = profiler.timings(versions, vdevice, lambda v: estimates[id(v)])
    kernels = []
    for version, timing in zip(versions, timings):
        lowered = version.lowered
        kernels.append(RKernel(name=f"{name}:{version.name}#{version.key[:8]}",
                               num_rtasks=lowered.num_rtasks, threads=lowered.threads,
                               registers=timing.registers, shared_bytes=lowered.shared_bytes,
                               time_us=timing.rtask_us, source=version.source, payload=lowered))
    return VersionedOperator(uid=uid, name=name, kernels=kernels, flops=flops, bytes=nbytes,
                             timing=list(timings), analytical_us=[estimates[id(v)] for v in versions])
# --- end rKernel versions ------------------------------------------------------------------------


def replace_plan(plan, graph: OpGraph, registers: int, vdevice: VDevice, config: RammerConfig):
    """The same operators and rKernel versions, placed again for the compiled kernel's registers."""
    members = set(plan.ops)
    sub_ops = {op: ROperator(uid=op, name=graph.ops[op].name,
                             kernels=[graph.ops[op].kernels[plan.selected[op]]],
                             flops=graph.ops[op].flops, bytes=graph.ops[op].bytes) for op in plan.ops}
    preds = {op: [p for p in graph.preds.get(op, []) if p in members] for op in plan.ops}
    waves = [list(w) for w in plan.waves] or [list(plan.ops)]
    sub = OpGraph(ops=sub_ops, preds=preds, waves=waves, split_before=set())
    cfg = PolicyConfig(cost=cost_config(config, vdevice), selection="fastest", merge="always",
                       registers=registers, max_waits_per_op=None)
    (new_plan,) = schedule(sub, vdevice, cfg)
    new_plan.selected = dict(plan.selected)
    new_plan.reason = dict(plan.reason)
    return new_plan


def plan_report(plan, ops: dict, spec, num_veus: int, registers) -> dict:
    """JSON-able description of one rProgram (used by ``tvm-rammer inspect``)."""
    program = plan.program
    operators = []
    for op in plan.ops:
        kernel = ops[op].kernels[plan.selected[op]]
        entry = {"name": ops[op].name, "rtasks": kernel.num_rtasks,
                 "threads": kernel.threads, "version": kernel.source,
                 "reason": plan.reason.get(op, "only"),
                 "time_us_per_rtask": round(kernel.time_us, 3)}
        timing = getattr(ops[op], "timing", None)  # VersionedOperator: which version, timed how
        if timing:
            chosen = timing[plan.selected[op]]
            entry.update(kernel=kernel.name, versions=len(ops[op].kernels), time_source=chosen.source,
                         predicted_us_per_rtask=round(ops[op].analytical_us[plan.selected[op]], 3),
                         profiled_kernel_us=None if chosen.kernel_us is None
                         else round(chosen.kernel_us, 3))
        operators.append(entry)
    return {"kernel": spec.name, "rtasks": int(program.num_rtasks), "num_veus": num_veus,
            "veus_per_sm": plan.veus_per_sm, "veu_threads": spec.veu_threads,
            "registers": registers, "shared_bytes": spec.shared_bytes,
            "kernel_bodies": len(spec.entries),
            "barriers": int(program.num_barriers), "predicted_us": float(plan.predicted_us),
            "operators": operators}
