"""Without measured times an rProgram is built only when the occupancy- and latency-aware estimate
(tvm_rammer.scheduling.unmeasured_check) puts it ahead of TVM's default kernels; the wins it must keep (many
small operators side by side: the GEMV branches, an RNN) stay rPrograms."""
import pytest

from tvm_rammer import rammer_target
from tvm_rammer.scheduling import unmeasured_check
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.driver.report import fallbacks, rprogram_reports

TARGET = "rammer/nvidia-h100"


def _lowered(name, **config):
    model = get_model(name, **REDUCED[name])
    return lower(import_onnx(model), TARGET, RammerConfig(profile=False, **config))


@pytest.fixture(scope="module")
def alexnet():
    """Reduced AlexNet: a chain of convolutions and dense layers, nothing to run side by side,
    whose kernels hold more blocks per SM alone than the rProgram's vEUs."""
    return {check: _lowered("alexnet", check_unmeasured=check) for check in (True, False)}


def test_a_chain_of_device_filling_kernels_stays_tvms_default(alexnet):
    mod = alexnet[True]
    assert rprogram_reports(mod) == []
    (record,) = [f for f in fallbacks(mod) if f.get("source") == "estimate"]
    assert record["rammer_us"] >= record["default_us"] > 0
    assert record["operators"] and "nothing measured" in record["reason"]
    assert record["kernel"] == "rammer_rprogram0"


def test_without_the_check_the_same_model_is_an_rprogram(alexnet):
    """Negative control: the rProgram the check drops is what the policy builds without it."""
    assert rprogram_reports(alexnet[False])
    assert not [f for f in fallbacks(alexnet[False]) if f.get("source") == "estimate"]


@pytest.mark.parametrize("name", ["branches", "lstm_tc"])
def test_side_by_side_wins_stay_rprograms(name):
    mod = _lowered(name)
    reports = rprogram_reports(mod)
    assert reports and not fallbacks(mod)
    assert all(op["kernel"].split(":")[1].startswith("dlight#")
               for report in reports for op in report["operators"])


def test_the_estimates_see_occupancy_and_block_latency():
    """One operator of 32,768 blocks of 256 threads, the NASNet-CIFAR convolutions' shape: alone it
    holds 8 blocks per SM (threads-limited), in an rProgram of 4 vEUs per SM it runs twice as many
    rounds, so the rProgram is estimated slower; the 16 one-block GEMVs of the demo are not."""
    from tvm_rammer.scheduling.policy import OpGraph, bfs_waves, schedule
    from tvm_rammer.scheduling.rkernels import policy_config, vdevice_for
    from tvm_rammer.abstractions.rtask import ROperator, RKernel

    config = RammerConfig(profile=False, num_sms=132)
    vdevice = vdevice_for(rammer_target(TARGET), config)

    def plan_of(kernels):
        ops = {i: ROperator(uid=i, name=f"op{i}", kernels=[k], flops=0.0, bytes=0.0)
               for i, k in enumerate(kernels)}
        preds = {i: [] for i in ops}
        graph = OpGraph(ops=ops, preds=preds, waves=bfs_waves(list(ops), preds), split_before=set())
        (plan,) = schedule(graph, vdevice, policy_config(config, vdevice))
        return plan, graph

    conv = RKernel("conv", 32768, 256, None, 64, 0.51, "dlight")
    plan, graph = plan_of([conv])
    assert plan.veus_per_sm == 4
    rammer_us = unmeasured_check.rprogram_estimate_us(plan, graph, vdevice, config)
    default_us = unmeasured_check.default_estimate_us(plan, graph, vdevice, config)
    assert rammer_us > default_us  # 63 rounds of >= 1 us vs 32 rounds + one launch
    assert unmeasured_check.check_plan(plan, graph, vdevice, config)["rammer_us"] == rammer_us
    gemvs = [RKernel(f"gemv{i}", 16, 256, None, 0, 2.0, "dlight") for i in range(16)]
    plan, graph = plan_of(gemvs)
    assert unmeasured_check.check_plan(plan, graph, vdevice, config) is None


def test_block_us_cannot_be_negative():
    with pytest.raises(ValueError, match="block_us=-1"):
        RammerConfig(block_us=-1.0)
