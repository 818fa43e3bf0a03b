"""The device timer: kernels built in a process pool, checked against TVM's default kernel, timed."""
import os

import pytest
import tvm
from tvm import relax, tirx
from tvm.script import tirx as T

from conftest_tir import TARGET, schedule, scheduled_kernel, single_op_module
from tvm_rammer.gpu import DeviceId, LocalGPU, local_gpu
from tvm_rammer.tuning.measure import CudaDevice, KernelJob, param_specs
from tvm_rammer.tuning.versions import func_key


def _only_kernel(op, *shapes):
    mod = schedule(single_op_module(op, *shapes))
    (func,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


def test_param_specs_name_every_buffer():
    specs = param_specs(scheduled_kernel("matmul"))
    assert [s[1:] for s in specs] == [([128, 256], "float32"), ([256, 512], "float32"),
                                      ([128, 512], "float32")]


@pytest.mark.nvcc
def test_kernels_build_in_parallel_worker_processes_with_their_resources():
    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET, build_workers=2)
    try:
        futures = [device._submit_build(scheduled_kernel(m), True) for m in ("matmul", "gemv", "add")]
        infos = [f.result(timeout=300) for f in futures]
    finally:
        device.close()
    assert all(info["registers"] > 0 and info["spills"] == 0 for info in infos)
    assert len({info["path"] for info in infos}) == 3


@T.prim_func(s_tir=True)
def _unprintable_kernel(a: T.Buffer((64,), "float32")):
    """A GPU kernel TVM's CUDA codegen cannot print (an LLVM intrinsic): its build fails."""
    T.func_attr({"tirx.is_scheduled": True})
    for i in T.thread_binding(64, thread="threadIdx.x"):
        with T.sblock("b"):
            v = T.axis.spatial(64, i)
            a[v] = T.call_llvm_pure_intrin("float32", "llvm.sqrt.f32", T.uint32(1), a[v])


@pytest.mark.nvcc
def test_kernels_build_in_batches_with_each_kernels_own_resources_and_failures():
    """measure_kernels' builds: one library, link and nvcc per batch; each kernel keeps its own
    entry, registers and shared memory (the same as built alone), and a kernel that does not build
    (:func:`_unprintable_kernel`) fails alone while its batch's others still build."""
    kernels = [scheduled_kernel(m) for m in ("matmul", "gemv", "add")]
    broken = _unprintable_kernel
    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET, build_workers=1,
                        batch_size=4)
    try:
        members = device._submit_batches([(kernels[0], True), (broken, True), (kernels[1], True),
                                          (kernels[2], False)])
        assert device.batches == 2 and device._count == 4  # at least two batches per process
        alone = [device._submit_build(k, True).result(timeout=300) for k in kernels[:2]]
        good = [members[i].result(timeout=300) for i in (0, 2, 3)]
        with pytest.raises(RuntimeError):
            members[1].result(timeout=300)
    finally:
        device.close()
    assert len({(g["path"], g["entry"]) for g in good}) == 3
    for built, single in zip(good[:2], alone):
        assert built["registers"] == single["registers"] > 0
        assert built["shared_bytes"] == single["shared_bytes"]
    assert "registers" not in good[2]  # asked without resources: none measured
    # the control: the broken kernel's batch does not build as a whole (each was built alone)
    with pytest.raises(Exception):
        tvm.tirx.build(tvm.IRModule({"a": kernels[0].with_attr("global_symbol", "a"),
                                     "b": broken.with_attr("global_symbol", "b")}),
                       tvm.target.Target(device._target_spec))


@pytest.mark.nvcc
def test_an_operators_versions_and_its_reference_build_whole_as_one_library():
    """The batches measure_kernels makes hold an operator's versions with TVM's default kernel for
    it (kernels made from one PrimFunc, sharing its parameters): such a batch builds whole, one
    library for all (a fallback to kernel-by-kernel builds would give each its own)."""
    from test_versions import CASES, stashed_and_scheduled
    from tir_templates.default_schedule import schedule_like_default
    from tvm_rammer.target import plain_target
    from tvm_rammer.tuning.versions import kernel_versions, unscheduled_funcs

    mod, gv = stashed_and_scheduled(*CASES["matmul"])
    unscheduled = unscheduled_funcs(mod)[gv.name_hint]
    made = kernel_versions(gv.name_hint, TARGET, scheduled=mod[gv], unscheduled=unscheduled)[:3]
    reference = schedule_like_default(unscheduled, plain_target(TARGET))
    assert len(made) == 3 and reference is not None
    device = CudaDevice(LocalGPU(None, DeviceId("none", "sm_90")), TARGET, build_workers=1)
    try:
        items = device._submit_batch([(reference, False)] + [(v.func, True) for v in made]) \
            .result(timeout=300)
    finally:
        device.close()
    assert not any("error" in item for item in items)
    assert len({item["path"] for item in items}) == 1 and len({item["entry"] for item in items}) == 4
    assert all(item["registers"] > 0 for item in items[1:])


@pytest.mark.gpu
def test_a_version_that_computes_something_else_is_invalid_and_a_right_one_valid():
    gpu = local_gpu()
    add = _only_kernel(relax.op.add, (128, 512), (128, 512))
    sub = _only_kernel(relax.op.subtract, (128, 512), (128, 512))
    device = CudaDevice(gpu, TARGET)
    try:
        right, wrong = device.measure_kernels(
            [KernelJob(func_key(add), "add:dlight", add, add, func_key(add), 1),
             KernelJob(func_key(sub), "add:sub", sub, add, func_key(add), 1)], lambda n: None)
    finally:
        device.close()
    assert right["valid"] is True and right["error"] <= 1e-6 and right["kernel_us"] > 0
    assert right["default_us"] > 0
    assert wrong["valid"] is False and "relative error" in wrong["reason"]


@pytest.mark.gpu
def test_the_cache_of_a_gpu_compile_is_reused_by_the_next(tmp_path):
    """Two compiles of one model on the GPU: the second measures nothing (records from the cache)."""
    from tvm_rammer.backend import make_profiler
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.frontend import import_onnx, lower
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.target import resolve_target

    mod = import_onnx(get_model("alexnet", **REDUCED["alexnet"]))
    config = RammerConfig(profile_db=os.path.join(tmp_path, "cache.sqlite"))
    target = resolve_target("rammer/nvidia-h100")
    first = make_profiler(target, config)
    lower(mod, target, config, first)
    assert first.counts["profiled"] > 0
    second = make_profiler(target, config)
    lower(mod, target, config, second)
    assert second.counts["profiled"] == 0 and second.counts["database"] > 0
