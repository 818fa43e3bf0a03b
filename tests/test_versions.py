"""rKernel versions: several prelowered schedules per operator, fed to SelectRKernels."""
import pytest
import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl

from conftest_tir import MODELS, TARGET, single_op_module
from fake_device import FakeDevice
from tir_templates.templates import operator_kind, template_schedules
from tvm_rammer.scheduling import rkernels
from tvm_rammer.config import RammerConfig
from tvm_rammer.scheduling.policy import OpGraph, schedule
from tvm_rammer.tuning.measure import KernelJob
from tvm_rammer.tuning.profile_db import JsonProfileDB
from tvm_rammer.tuning.profiler import Profiler
from tir_templates.prelower import UnsupportedKernel, bound_launch, prelower
from tvm_rammer.tuning import versions as versions_mod
from tvm_rammer.tuning.versions import (STASH_ATTR, StashUnscheduled, VersionOptions, dlight_schedules,
                                        kernel_versions, unscheduled_funcs)
from tvm_rammer.abstractions.vdevice import VDevice

CASES = {
    "matmul": MODELS["matmul"],
    "gemv": MODELS["gemv"],
    "conv2d": MODELS["conv2d"],
    "depthwise_conv2d": (lambda x, w: relax.op.nn.conv2d(x, w, padding=1, groups=32),
                         (1, 32, 32, 32), (32, 1, 3, 3)),
}


def stashed_and_scheduled(op, *shapes):
    """(module after LegalizeOps + StashUnscheduled + dlight, the one PrimFunc's GlobalVar)."""
    mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern(),
                                    StashUnscheduled()])(single_op_module(op, *shapes))
    with TARGET:
        mod = dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                      dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)
    (gv,) = [g for g, f in mod.functions_items() if isinstance(f, tirx.PrimFunc)]
    return mod, gv


@pytest.fixture(scope="module", params=sorted(CASES))
def versions(request):
    mod, gv = stashed_and_scheduled(*CASES[request.param])
    found = kernel_versions(gv.name_hint, TARGET, scheduled=mod[gv],
                            unscheduled=unscheduled_funcs(mod)[gv.name_hint])
    return request.param, mod, gv, found


def test_stash_keeps_the_unscheduled_primfunc_through_dlight():
    mod, gv = stashed_and_scheduled(*CASES["matmul"])
    stash = unscheduled_funcs(mod)
    assert STASH_ATTR in mod.attrs and list(stash) == [gv.name_hint]
    assert mod[gv].attrs["tirx.is_scheduled"]
    assert "tirx.is_scheduled" not in (stash[gv.name_hint].attrs or {})


def test_template_kind_is_read_from_the_loop_nest(versions):
    name, mod, gv, _ = versions
    assert operator_kind(unscheduled_funcs(mod)[gv.name_hint]) == name


def test_each_operator_gets_at_least_two_distinct_prelowered_versions(versions):
    name, _, _, found = versions
    shapes = [(v.lowered.grid, v.lowered.block) for v in found]
    assert len(found) >= 2 and len(set(shapes)) == len(shapes)
    assert len({v.lowered.num_rtasks for v in found}) >= 2
    assert found[0].name == "dlight"  # the pipeline's own schedule comes first
    assert {v.source for v in found} >= {"dlight", "template"}


def test_without_the_stash_only_the_pipeline_schedule_is_a_version():
    mod, gv = stashed_and_scheduled(*CASES["matmul"])
    (only,) = kernel_versions(gv.name_hint, TARGET, scheduled=mod[gv], unscheduled=None)
    assert only.source == "dlight"


def test_max_versions_and_options_bound_the_list():
    mod, gv = stashed_and_scheduled(*CASES["gemv"])
    found = kernel_versions(gv.name_hint, TARGET, scheduled=mod[gv],
                            unscheduled=unscheduled_funcs(mod)[gv.name_hint],
                            options=VersionOptions(dlight_variants=False, max_versions=3))
    assert len(found) == 3 and {v.source for v in found} == {"dlight", "template"}
    with pytest.raises(ValueError, match="max_versions=0"):
        VersionOptions(max_versions=0)


def test_templates_decline_operators_they_do_not_handle():
    mod, gv = stashed_and_scheduled(*MODELS["softmax"])
    assert template_schedules(unscheduled_funcs(mod)[gv.name_hint]) == []


def _measured(found):
    """A profiler whose fake device measured every version (10 us each, valid)."""
    profiler = Profiler(JsonProfileDB(), FakeDevice(kernel_us=lambda job: 10.0), "sm_90a")
    profiler.prepare([KernelJob(v.key, f"op:{v.name}", v.func, v.func, "ref", 1) for v in found])
    return profiler


def test_versions_feed_select_rkernels(versions):
    """Measured versions make an operator with a fastest and a most efficient rKernel, and a wave of
    16 such operators is scheduled with one of them each, the timing source recorded."""
    _, mod, gv, found = versions
    config = RammerConfig()
    vdevice = VDevice.for_arch("sm_90")
    profiler = _measured(found)
    ops = {uid: rkernels.operator_versions(uid, gv.name_hint, mod[gv], found, config, vdevice, profiler)
           for uid in range(16)}
    op = ops[0]
    assert [k.name.split(":")[1].split("#")[0] for k in op.kernels if k.blocks_per_rtask == 1] == [
        v.name for v in found]  # every measured version, plus its coarsened variants
    assert {t.source for t in op.timing} == {"profiled"} and len(op.timing) == len(op.kernels)
    assert op.most_efficient in op.kernels and op.fastest(132) in op.kernels
    graph = OpGraph(ops=ops, preds={}, waves=[list(ops)])
    plans = schedule(graph, vdevice, rkernels.policy_config(config, vdevice))
    assert sum(len(p.ops) for p in plans) == 16
    assert all(p.reason[o] in ("fastest", "efficient", "fits") for p in plans for o in p.ops)
    assert profiler.summary()["profiled"] == 16 * len(found)


def test_unmeasured_versions_leave_only_the_pipelines_dlight_schedule(versions):
    _, mod, gv, found = versions
    vdevice = VDevice.for_arch("sm_90")
    nothing = Profiler(JsonProfileDB(), None, "sm_90a")
    op = rkernels.operator_versions(0, gv.name_hint, mod[gv], found, RammerConfig(), vdevice, nothing)
    assert {k.source for k in op.kernels} == {"dlight"}
    assert all(k.name.split(":")[1].startswith("dlight#") for k in op.kernels)
    lowered = found[0].lowered
    assert [k.blocks_per_rtask for k in op.kernels] == rkernels.coarsenings(
        lowered.num_rtasks, rkernels.coarse_floor(lowered, RammerConfig(), vdevice))
    assert {t.source for t in op.timing} == {"analytical"}


def test_a_small_mean_gets_a_version_without_partial_warp_shuffles():
    """Global average pooling (sum, then divide): dlight reduces 16 elements with 16 threads and
    warp shuffles, which cannot early-exit in a wider vEU; the spatial template (serial reduction,
    epilogue fused) can, so the operator stays placeable."""
    from tir_templates.rtask_rewrite import early_exit_problem

    mod, gv = stashed_and_scheduled(lambda x: relax.op.mean(x, axis=[2, 3]), (1, 64, 4, 4))
    found = kernel_versions(gv.name_hint, TARGET, scheduled=mod[gv],
                            unscheduled=unscheduled_funcs(mod)[gv.name_hint])
    runnable = [v for v in found if early_exit_problem(v.lowered, 256) is None]
    assert any(v.source == "template" for v in runnable), [v.name for v in found]


def _schedules(mod, gv) -> list:
    """Every schedule kernel_versions weighs for the operator: the pipeline's, dlight's variants
    and the templates."""
    unscheduled = unscheduled_funcs(mod)[gv.name_hint]
    return [("dlight", mod[gv]), *dlight_schedules(unscheduled, TARGET),
            *((t.name, t.func) for t in template_schedules(unscheduled, TARGET))]


def test_every_schedule_prelower_accepts_has_the_launch_bound_launch_reads(versions):
    _, mod, gv, _ = versions
    read = 0
    for vname, func in _schedules(mod, gv):
        try:
            kernel = prelower(func, TARGET, name=vname)
        except UnsupportedKernel:
            continue
        shape = bound_launch(func)
        if shape is not None:
            read += 1
            assert shape == (kernel.grid, kernel.block), vname
    assert read > 0


def test_a_repeated_launch_shape_is_dropped_before_it_is_lowered(versions, monkeypatch):
    _, mod, gv, found = versions
    lowered = []

    def counting(func, target, name="kernel"):
        lowered.append(name)
        return prelower(func, target, name=name)

    monkeypatch.setattr(versions_mod, "prelower", counting)
    again = kernel_versions(gv.name_hint, TARGET, scheduled=mod[gv],
                            unscheduled=unscheduled_funcs(mod)[gv.name_hint])
    with_shortcut = len(lowered)
    lowered.clear()
    monkeypatch.setattr(versions_mod, "bound_launch", lambda func: None)  # control: every one lowered
    without = kernel_versions(gv.name_hint, TARGET, scheduled=mod[gv],
                              unscheduled=unscheduled_funcs(mod)[gv.name_hint])
    same = [(v.name, v.source, v.key, v.lowered.grid, v.lowered.block) for v in found]
    assert [(v.name, v.source, v.key, v.lowered.grid, v.lowered.block) for v in again] == same
    assert [(v.name, v.source, v.key, v.lowered.grid, v.lowered.block) for v in without] == same
    assert with_shortcut < len(lowered)  # every case here has schedules that repeat a shape
