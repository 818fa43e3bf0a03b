"""Coarsened rTasks: several thread blocks of one kernel per rTask, same code, fewer instructions."""
import pytest

import tvm_rammer
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.driver.report import rprogram_reports
from tvm_rammer.codegen.resources import cuda_source
from tvm_rammer.scheduling.rkernels import MAX_BLOCKS_PER_RTASK, MIN_COARSE_RTASKS, coarsenings
from tvm_rammer.abstractions.rtask import RKernel

TARGET = "rammer/nvidia-h100"


def test_coarsenings_keep_enough_rtasks_and_stop_at_the_maximum():
    assert coarsenings(10) == [1]
    assert coarsenings(2 * MIN_COARSE_RTASKS) == [1, 2]
    assert coarsenings(1 << 20)[-1] == MAX_BLOCKS_PER_RTASK
    for blocks in (17, 100, 1000, 32768):
        assert all(-(-blocks // b) >= MIN_COARSE_RTASKS for b in coarsenings(blocks)[1:])


def test_coarsenings_keep_at_least_the_floor_of_rtasks():
    assert coarsenings(32768, 528) == [1, 2, 4, 8, 16, 32]  # 64 blocks: 512 rTasks < 528 vEUs
    assert all(-(-32768 // b) >= 528 for b in coarsenings(32768, 528))
    assert coarsenings(32768, 1) == coarsenings(32768)  # never below MIN_COARSE_RTASKS either
    assert coarsenings(500, 528) == [1]


def test_an_rkernel_needs_a_positive_block_count():
    with pytest.raises(ValueError, match="blocks_per_rtask must be >= 1"):
        RKernel("k", 4, 128, None, 0, 1.0, "dlight", blocks_per_rtask=0)


@pytest.fixture(scope="module")
def coarse():
    """A NASBench cell scheduled with the most efficient rKernels on a 2-SM vDevice: its wide
    convolutions and elementwise operators run several blocks per rTask (on the full H100 they
    would leave vEUs idle, so ``coarsen_below_veus=False`` offers them no coarsened variant)."""
    model = get_model("nasbench_cell", seed=1, channels=16, image_size=16)
    return lower(import_onnx(model), TARGET,
                 RammerConfig(selection="efficient", profile=False, num_sms=2))


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


@pytest.fixture(scope="module")
def nasnet_unmeasured():
    """The reduced NASNet-CIFAR on the full H100 vDevice without measured times, coarsened by the
    default rule and by the old one (down to MIN_COARSE_RTASKS rTasks: the negative control).
    The unmeasured check is off: these tests look at the coarsening of the rProgram, which the
    check may leave as TVM's default kernels (the old rule's is estimated 847 us vs 787 us)."""
    model = get_model("nasnet_cifar", **REDUCED["nasnet_cifar"])
    return {below: rprogram_reports(lower(import_onnx(model), TARGET, RammerConfig(
        profile=False, coarsen_below_veus=below, check_unmeasured=False)))
        for below in (False, True)}


def _starving(reports):
    """Operators coarsened to fewer rTasks than their rProgram has vEUs."""
    return [op["name"] for report in reports for op in report["operators"]
            if op["blocks_per_rtask"] > 1 and op["rtasks"] < report["num_veus"]]


def test_unmeasured_coarsening_never_leaves_veus_idle(nasnet_unmeasured):
    """Without measured times the convolutions keep TVM's default (the pipeline's dlight) kernel,
    and no operator is coarsened to fewer rTasks than vEUs: a block's latency is not its share of
    the device's peak throughput, so 128 blocks run one after another on each of a quarter of the
    vEUs are not the bargain the cost model would see (the full NASNet-CIFAR had 276 of its 602
    operators coarsened so in the build that ran 1.7x slower than TVM's default on an H200)."""
    reports = nasnet_unmeasured[False]
    assert reports  # an rProgram to look at
    ops = [op for report in reports for op in report["operators"]]
    convs = [op for op in ops if "conv2d" in op["name"]]
    assert convs and all(op["kernel"].split(":")[1].startswith("dlight#") for op in convs)
    assert {op["time_source"] for op in ops} == {"analytical"}
    assert _starving(reports) == []
    assert any(op["blocks_per_rtask"] > 1 for op in ops)  # still coarsened where vEUs stay full


def test_the_old_coarsening_floor_starves_veus(nasnet_unmeasured):
    """Negative control: coarsened down to MIN_COARSE_RTASKS, the same model has operators on
    fewer rTasks than vEUs (so the check above can fail)."""
    assert _starving(nasnet_unmeasured[True])
