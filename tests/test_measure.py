"""The device timer: kernels built in a process pool, checked against TVM's default kernel, timed."""
import os

import pytest
from tvm import relax, tirx

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
