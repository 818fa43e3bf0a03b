"""The guarded dlight default schedule: a rule that raises on one function does not apply."""
import sys

import pytest
import tvm
from tvm import relax
from tvm.s_tir import dlight as dl

from conftest_tir import TARGET, single_op_module
from tir_templates.default_schedule import (SCHEDULE_NOTE_ATTR, GuardedDefaultSchedule,
                                            default_rules, default_schedule_pass,
                                            schedule_like_default)
from tir_templates.prelower import UnsupportedKernel, prelower


def _legalized(op, *shapes):
    return tvm.transform.Sequential([relax.transform.LegalizeOps(),
                                     relax.transform.AnnotateTIROpPattern()])(
        single_op_module(op, *shapes))


def _prim_funcs(mod):
    return {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}


class _Raising(dl.ScheduleRule):
    """A rule that fails the way dlight's Reduction does on some fused reductions."""

    def apply(self, func, target, tunable):
        raise tvm.error.InternalError("Check failed: block_realize == old_block_realize_.get()")


def test_without_failures_it_schedules_exactly_as_dlight():
    mod = _legalized(lambda x: relax.op.sum(x, axis=[1]), (128, 512))
    with TARGET:
        ours = default_schedule_pass()(mod)
        theirs = dl.ApplyDefaultSchedule(*default_rules())(mod)
    tvm.ir.assert_structural_equal(ours, theirs)


def test_a_raising_rule_falls_through_to_the_next_with_its_reason():
    mod = _legalized(lambda x: relax.op.sum(x, axis=[1]), (128, 512))
    with TARGET:
        out = GuardedDefaultSchedule(_Raising(), *default_rules())(mod)
    (func,) = _prim_funcs(out).values()
    assert func.attrs["tirx.is_scheduled"]
    note = str(func.attrs[SCHEDULE_NOTE_ATTR])
    assert "_Raising failed" in note and "block_realize" in note and "Reduction instead" in note


def test_schedule_like_default_survives_a_failing_rule(monkeypatch):
    mod = _legalized(relax.op.add, (64, 64), (64, 64))
    (func,) = _prim_funcs(mod).values()
    monkeypatch.setattr("tir_templates.default_schedule.default_rules",
                        lambda: (_Raising(), dl.gpu.Fallback()))
    out = schedule_like_default(func, TARGET)
    assert out is not None and out.attrs["tirx.is_scheduled"]


def test_a_lowering_failure_is_an_unsupported_kernel(monkeypatch):
    """TVM 0.27 raises InternalError (a RuntimeError; there is no tvm.error.TVMError): the kernel
    is refused with the reason, it stays TVM's own."""
    mod = _legalized(relax.op.add, (64, 64), (64, 64))
    with TARGET:
        (func,) = _prim_funcs(default_schedule_pass()(mod)).values()

    @tvm.transform.module_pass(opt_level=0, name="Failing")
    def failing(mod, _ctx):
        raise tvm.error.InternalError("Check failed: something deep in TVM")

    monkeypatch.setattr(sys.modules["tir_templates.prelower"], "_lowering_passes", lambda: [failing])
    with pytest.raises(UnsupportedKernel, match="add: TVM lowering failed: .*something deep"):
        prelower(func, TARGET, "add")


def test_a_model_whose_capped_dlight_rule_raises_compiles_with_no_more_launches_than_tvm_default():
    """The reduced RandWire: dlight's Matmul rule asserts on some fused conv2d + add epilogues under
    the 256-thread cap (TVM's uncapped default pipeline schedules them); the next rule schedules them
    with the reason noted, and the model compiles with no more launches than TVM's default."""
    from relay_passes.branch_fusion import BranchPreservingFusion
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.views.inspection import inspect_model
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.target import resolve_target, rkernel_target

    model = get_model("randwire", **REDUCED["randwire"])
    fused = tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(), BranchPreservingFusion(),
        relax.transform.FuseTIR()])(import_onnx(model))
    with rkernel_target(resolve_target("rammer/nvidia-h100"), RammerConfig()):
        out = default_schedule_pass()(fused)
    notes = [str(f.attrs[SCHEDULE_NOTE_ATTR]) for f in _prim_funcs(out).values()
             if f.attrs is not None and SCHEDULE_NOTE_ATTR in f.attrs]
    assert notes and all("Matmul failed" in n for n in notes)
    summary = inspect_model(model, "rammer/nvidia-h100", RammerConfig(profile=False))
    assert summary["rprograms"] >= 1 and summary["launches"] <= summary["default_launches"]
