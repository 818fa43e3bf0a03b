"""Template versions made from one re-indexed GEMM form (padded on copies) are the versions made
from the operator each time (``gemm_form(func, pad, base)``)."""
import pytest
from tvm import tirx

from conftest_tir import TARGET
from test_tensor_cores import fused16
from test_versions import CASES, stashed_and_scheduled
from tir_templates.gemm_templates import gemm_form, schedule_gemm_small_batch, schedule_gemm_tiled
from tir_templates.mma_templates import MMA_CONFIGS, schedule_gemm_mma
from tir_templates.templates import _GEMM, _SMALL_BATCH
from tvm_rammer.tuning.versions import func_key, unscheduled_funcs


def _unscheduled(case):
    mod, gv = stashed_and_scheduled(*CASES[case])
    return unscheduled_funcs(mod)[gv.name_hint]


def _keys(make, func, configs, form=None):
    out = []
    for config in configs:
        made = make(func, *config, form=form) if form is not None else make(func, *config)
        out.append(func_key(made) if isinstance(made, tirx.PrimFunc) else None)
    return out


@pytest.mark.parametrize("case", ["matmul", "conv2d", "gemv"])
def test_tiled_and_small_batch_versions_are_the_same_from_one_form(case):
    func = _unscheduled(case)
    form = gemm_form(func)
    before = form.sch.mod
    for make, configs in ((schedule_gemm_tiled, _GEMM), (schedule_gemm_small_batch, _SMALL_BATCH)):
        assert _keys(make, func, configs, form) == _keys(make, func, configs)
    assert form.sch.mod.same_as(before)  # the shared form is never scheduled itself


def test_tensor_core_versions_are_the_same_from_one_form():
    func = fused16("matmul")
    form = gemm_form(func)
    keys = _keys(schedule_gemm_mma, func, MMA_CONFIGS, form)
    assert any(keys) and keys == _keys(schedule_gemm_mma, func, MMA_CONFIGS)


def test_the_comparison_sees_another_operators_form():
    """The control: versions made from another operator's form differ (so equal keys above mean
    the form was this operator's)."""
    matmul, conv = _unscheduled("matmul"), _unscheduled("conv2d")
    mine = _keys(schedule_gemm_tiled, conv, _GEMM)
    theirs = _keys(schedule_gemm_tiled, conv, _GEMM, gemm_form(matmul))
    assert any(mine) and mine != theirs
