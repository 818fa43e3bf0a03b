"""default_schedule_each: a PrimFunc that dlight cannot schedule under the rTask thread cap stays
unscheduled (and becomes TVM's default kernel) instead of failing the whole compilation."""

import pytest
import tvm
from tvm import relax

from relay_passes.branch_fusion import BranchPreservingFusion
from tir_templates.default_schedule import default_schedule_each, default_schedule_pass, is_scheduled
from tvm_rammer.config import RammerConfig
from tvm_rammer.frontend import import_onnx
from tvm_rammer.inspection import inspect_model
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.target import resolve_target, rkernel_target

# the reduced RandWire: some of its fused conv2d + add (+ stack) epilogues make dlight's Matmul rule
# assert under the 256-thread cap (TVM's uncapped default pipeline schedules them)
RANDWIRE = REDUCED["randwire"]
CAPPED = rkernel_target(resolve_target("rammer/nvidia-h100"), RammerConfig())


def _fused():
    mod = import_onnx(get_model("randwire", **RANDWIRE))
    return tvm.transform.Sequential([
        relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(), BranchPreservingFusion(), relax.transform.FuseTIR()])(mod)


def test_functions_dlight_fails_on_stay_unscheduled_and_the_rest_are_scheduled():
    mod = _fused()
    with CAPPED:
        with pytest.raises(Exception):
            default_schedule_pass()(mod)  # the whole-module pass fails on them
        out = default_schedule_each(mod)
    funcs = {gv.name_hint: f for gv, f in out.functions_items() if isinstance(f, tvm.tirx.PrimFunc)}
    unscheduled = [name for name, f in funcs.items() if not is_scheduled(f)]
    assert unscheduled and all("conv2d" in name for name in unscheduled)
    assert len(unscheduled) < len(funcs)


def test_such_a_model_compiles_with_no_more_launches_than_tvm_default():
    summary = inspect_model(get_model("randwire", **RANDWIRE), "rammer/nvidia-h100",
                            RammerConfig(profile=False))
    assert summary["rprograms"] >= 1
    assert summary["launches"] <= summary["default_launches"]
    assert any("no thread-block schedule" in op["reason"] for op in summary["unplaced"])
