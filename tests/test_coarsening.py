"""Coarsened rTasks: several thread blocks of one kernel per rTask, same code, fewer instructions."""
import pytest

import tvm_rammer
from tvm_rammer.config import RammerConfig
from tvm_rammer.frontend import import_onnx, lower
from tvm_rammer.models import get_model
from tvm_rammer.report import rprogram_reports
from tvm_rammer.resources import cuda_source
from tvm_rammer.rkernels import MAX_BLOCKS_PER_RTASK, MIN_COARSE_RTASKS, coarsenings
from tvm_rammer.rtask import RKernel

TARGET = "rammer/nvidia-h100"


def test_coarsenings_keep_enough_rtasks_and_stop_at_the_maximum():
    assert coarsenings(10) == [1]
    assert coarsenings(2 * MIN_COARSE_RTASKS) == [1, 2]
    assert coarsenings(1 << 20)[-1] == MAX_BLOCKS_PER_RTASK
    for blocks in (17, 100, 1000, 32768):
        assert all(-(-blocks // b) >= MIN_COARSE_RTASKS for b in coarsenings(blocks)[1:])


def test_an_rkernel_needs_a_positive_block_count():
    with pytest.raises(ValueError, match="blocks_per_rtask must be >= 1"):
        RKernel("k", 4, 128, None, 0, 1.0, "dlight", blocks_per_rtask=0)


@pytest.fixture(scope="module")
def coarse():
    """A NASBench cell scheduled with the most efficient rKernels: its wide convolutions and
    elementwise operators run several blocks per rTask."""
    model = get_model("nasbench_cell", seed=1, channels=16, image_size=16)
    return lower(import_onnx(model), TARGET, RammerConfig(selection="efficient", profile=False))


def test_the_most_efficient_rkernels_are_coarsened(coarse):
    ops = [op for report in rprogram_reports(coarse) for op in report["operators"]]
    coarse_ops = [op for op in ops if op["blocks_per_rtask"] > 1]
    assert coarse_ops, ops
    assert all(op["kernel"].endswith(f"x{op['blocks_per_rtask']}") for op in coarse_ops)


@pytest.mark.nvcc
def test_a_coarsened_rtask_loops_over_its_blocks_and_builds_for_sm90a(coarse):
    from tir_templates.cuda_resources import compile_cuda_resources

    target = tvm_rammer.rammer_target(TARGET)
    for gv, func in coarse.functions_items():
        if "rammer.report" not in (func.attrs or {}):
            continue
        source = cuda_source(func.with_attr("global_symbol", gv.name_hint), target)
        assert "block_in_rtask" in source
        usage = compile_cuda_resources(source, "sm_90a")
        assert 0 < usage["registers"] <= 255
