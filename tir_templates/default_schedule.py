"""TVM's default GPU schedule of one operator: the one dlight rule list of tvm-rammer.

TVM 0.27's default CUDA pipeline (``tvm.relax.backend.cuda.pipeline.legalize_passes``) schedules every
PrimFunc with ``dlight.ApplyDefaultSchedule(Matmul, GEMV, Reduction, GeneralReduction, Fallback)``.
tvm-rammer uses the same rules, in the same order, wherever it needs "what TVM would do":

- the rKernels' own schedule (under the rTask thread cap, ``tvm_rammer.target.rkernel_target``);
- the reference kernel every other rKernel version is checked against on the device;
- the kernel of an operator that stays an ordinary kernel (TVM's default, uncapped).
"""
from __future__ import annotations

import tvm
from tvm import tirx
from tvm.s_tir import dlight as dl

__all__ = ["default_rules", "default_schedule_pass", "default_schedule_each", "schedule_like_default",
           "is_scheduled"]


def default_rules() -> tuple:
    """Fresh instances of TVM's default CUDA dlight rules, in TVM's order."""
    return (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
            dl.gpu.Fallback())


def default_schedule_pass() -> tvm.transform.Pass:
    """``dlight.ApplyDefaultSchedule`` with :func:`default_rules` (schedules under the target in scope)."""
    return dl.ApplyDefaultSchedule(*default_rules())


@tvm.transform.module_pass(opt_level=0, name="DefaultScheduleEach")
def default_schedule_each(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    """:func:`default_schedule_pass` one PrimFunc at a time, under the target in scope. A PrimFunc
    whose rule raises (dlight's Matmul rule asserts on some fused epilogues under a thread cap that
    TVM's default pipeline does not set) is left unscheduled instead of failing the compilation:
    the back end then gives it TVM's default kernel, as for any operator that cannot become rTasks."""
    updates = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
            continue
        try:
            scheduled = default_schedule_pass()(tvm.IRModule({gv: func}))[gv]
        except Exception:  # pylint: disable=broad-except  (dlight rules may hit TVM internal errors)
            continue
        if not scheduled.same_as(func):
            updates[gv] = scheduled
    if not updates:
        return mod
    out = mod.clone()
    for gv, func in updates.items():
        out[gv] = func
    return out


def is_scheduled(func: tirx.PrimFunc) -> bool:
    """Whether dlight (or a template) marked ``func`` as scheduled."""
    return bool(func.attrs is not None and func.attrs.get("tirx.is_scheduled", False))


def schedule_like_default(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """``func`` (unscheduled) scheduled as TVM's default pipeline would for ``target``; None when no
    rule applies or a rule fails (like a dlight rule, this never raises for a kernel it cannot do)."""
    try:
        with target:
            mod = default_schedule_pass()(tvm.IRModule({"main": func}))
    except Exception:  # pylint: disable=broad-except  (dlight rules may hit TVM internal errors)
        return None
    out = mod["main"]
    return out if is_scheduled(out) else None
