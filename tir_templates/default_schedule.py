"""TVM's default GPU schedule of one operator: the one dlight rule list of tvm-rammer.

TVM 0.27's default CUDA pipeline (``tvm.relax.backend.cuda.pipeline.legalize_passes``) schedules every
PrimFunc with ``dlight.ApplyDefaultSchedule(Matmul, GEMV, Reduction, GeneralReduction, Fallback)``.
tvm-rammer uses the same rules, in the same order, wherever it needs "what TVM would do":

- the rKernels' own schedule (under the rTask thread cap, ``tvm_rammer.target.rkernel_target``);
- the reference kernel every other rKernel version is checked against on the device;
- the kernel of an operator that stays an ordinary kernel (TVM's default, uncapped).

One difference, for robustness: a rule that *raises* on a function (dlight's Reduction hits TVM
InternalErrors on some fused reductions, its GEMV rule asserts on some broadcast reductions) counts
as not applying, and the next rule is tried, so one function's failure neither stops the others nor
the compilation (:class:`GuardedDefaultSchedule`). When a rule raised and no later rule applies,
the function gets tvm-rammer's own plain schedule (``tir_templates.plain_schedule``: threads over
its data-parallel loops). The function then carries ``rammer.schedule_note`` saying which rule
failed and why, and :class:`GuardedDefaultSchedule` logs one warning naming the function.
"""
from __future__ import annotations

import logging

import tvm
from tvm import tirx
from tvm.s_tir import dlight as dl

from .decode_attention import DecodeAttentionRule
from .intrin_import import know_frozen_import_frames
from .plain_schedule import PLAIN_SCHEDULE, plain_schedule

__all__ = ["default_rules", "default_schedule_pass", "schedule_like_default", "is_scheduled",
           "GuardedDefaultSchedule", "SCHEDULE_NOTE_ATTR", "SCHEDULED_BY_ATTR", "scheduled_by"]

LOG = logging.getLogger("tvm_rammer")
SCHEDULE_NOTE_ATTR = "rammer.schedule_note"
SCHEDULED_BY_ATTR = "rammer.scheduled_by"  # set by a rule of ours (``schedule_name``), not dlight's


def default_rules() -> tuple:
    """Fresh instances of TVM's default CUDA dlight rules, in TVM's order (``Matmul`` may import
    the tensor intrinsics: ``intrin_import``)."""
    know_frozen_import_frames()
    return (dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(),
            dl.gpu.Fallback())


def default_schedule_pass(*first) -> tvm.transform.Pass:
    """:class:`GuardedDefaultSchedule` with :func:`default_rules` (schedules under the target in
    scope): dlight's ``ApplyDefaultSchedule``, except that a rule that raises does not apply.
    ``first``: rules tried before dlight's (the rammer pipeline's own fused-cell rule,
    ``tir_templates.gemv_epilogue``, for the functions only it applies to)."""
    return GuardedDefaultSchedule(*first, *default_rules())


def _first_line(err: BaseException) -> str:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:300]


def schedule_func(func: tirx.PrimFunc, target, rules) -> tuple:
    """(scheduled PrimFunc or None, notes): the first rule of ``rules`` that applies to ``func``
    without raising, as dlight would apply it; ``notes`` says which rules raised and why."""
    notes = []
    for rule in rules:
        try:
            space = rule.apply(func, target, False)
        except Exception as err:  # pylint: disable=broad-except  (a rule that fails does not apply)
            notes.append(f"dlight {type(rule).__name__} failed ({_first_line(err)})")
            continue
        if space is None:
            continue
        sch = space if not isinstance(space, list) else space[0]
        out = sch.mod["main"].with_attr("tirx.is_scheduled", True)
        if getattr(rule, "schedule_name", None):  # our own rules say so on the function
            out = out.with_attr(SCHEDULED_BY_ATTR, rule.schedule_name)
        if notes:
            notes.append(f"scheduled by {type(rule).__name__} instead")
            out = out.with_attr(SCHEDULE_NOTE_ATTR, "; ".join(notes))
        return out, notes
    if notes:  # a rule raised and none after it applies: our own schedule, not none at all
        out = plain_schedule(func, target)
        if out is not None:
            notes.append("scheduled by tvm-rammer's plain schedule instead")
            return (out.with_attr(SCHEDULED_BY_ATTR, PLAIN_SCHEDULE)
                    .with_attr(SCHEDULE_NOTE_ATTR, "; ".join(notes))), notes
    return None, notes


@tvm.transform.module_pass(opt_level=0, name="GuardedDefaultSchedule")
class GuardedDefaultSchedule:
    """dlight's ``ApplyDefaultSchedule`` where a rule that raises on one function does not apply.

    Input: a module with unscheduled PrimFuncs (after FuseTIR) and a target in scope (or on the
    functions). Output: every PrimFunc that some rule applies to scheduled and marked
    ``tirx.is_scheduled``, exactly as ``ApplyDefaultSchedule`` with the same rules would schedule it
    when no rule raises; a function where an earlier rule raised gets the next rule that applies,
    and ``rammer.schedule_note`` with the reason. Functions no rule applies to stay unscheduled.
    """

    def __init__(self, *rules):
        self.rules = list(rules)

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        updated = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc) or is_scheduled(func):
                continue
            target = func.attrs.get("target", None) if func.attrs is not None else None
            target = target or tvm.target.Target.current(allow_none=False)
            out, notes = schedule_func(func, target, self.rules)
            if notes:
                _warn_once(gv.name_hint, "; ".join(notes))
            if out is not None:
                updated[gv] = out
        for gv, func in updated.items():
            mod[gv] = func
        return mod


_WARNED: set = set()


def _warn_once(name: str, note: str) -> None:
    """One warning per function and reason in a process (the rKernel and the reference schedules
    of one operator meet the same failure)."""
    if (name, note) not in _WARNED:
        _WARNED.add((name, note))
        LOG.warning("tvm-rammer: %s: %s", name, note)


def scheduled_by(func: tirx.PrimFunc) -> str | None:
    """The name of the rule of ours that scheduled ``func`` (``SCHEDULED_BY_ATTR``), or None."""
    return None if func.attrs is None else func.attrs.get(SCHEDULED_BY_ATTR, None)


def is_scheduled(func: tirx.PrimFunc) -> bool:
    """Whether dlight (or a template) marked ``func`` as scheduled."""
    return bool(func.attrs is not None and func.attrs.get("tirx.is_scheduled", False))


def schedule_like_default(func: tirx.PrimFunc, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """``func`` (unscheduled) scheduled as TVM's default pipeline would for ``target``; None when no
    rule applies or a rule fails (like a dlight rule, this never raises for a kernel it cannot do).
    A kernel made whole by a template for an operator TVM has none for (the split decode attention,
    ``tir_templates.decode_attention``) is its own default: its first version, what the versions
    are checked against and what the operator runs as outside an rProgram."""
    own = DecodeAttentionRule().apply(func)
    if own is not None:
        return own.mod["main"].with_attr("tirx.is_scheduled", True)
    try:
        with target:
            out, _ = schedule_func(func, target, default_rules())
    except Exception:  # pylint: disable=broad-except  (a malformed function or target)
        return None
    return out
