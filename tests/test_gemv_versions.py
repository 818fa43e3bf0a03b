"""GEMV rKernel versions of a decode step's MatMuls (issue 34, ``tir_templates.gemv_templates``):
16-byte weight loads, coalesced column lanes, narrow to wide rTasks; each version checked on llvm
(thread loops serial) against NumPy and on the CPU emulator against TVM's default kernel, each
with the cost model's analytical time, the count bounded by ``max_versions``."""
import re
import shutil

import numpy as np
import pytest
import tvm
from tvm import relax, tirx
from tvm.script import relax as R

from tir_templates.default_schedule import default_rules
from tir_templates.gemm_templates import gemm_form
from tir_templates.gemv_templates import GEMV_SHAPES, gemv_schedules, gemv_vec, schedule_gemv
from tir_templates.prelower import prelower
from tir_templates.serial_run import run_on_cpu, serial_threads
from tvm_rammer.config import RammerConfig
from tvm_rammer.target import rammer_target
from tvm_rammer.tuning.tune import pre_schedule_module

TARGET = "rammer/nvidia-h100"


def gemv(k, n, dtype="float32", out_dtype=None, rows=1):
    """``x[rows, K] @ W[K, N] + b`` as the rammer pipeline hands it to dlight: one PrimFunc, W and
    b its inputs. ``out_dtype`` float32 on float16 inputs: accumulation in float32."""
    out_dtype = out_dtype or dtype
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((rows, k), dtype))
    w = relax.Var("w", R.Tensor((k, n), dtype))
    b = relax.Var("b", R.Tensor((1, n), out_dtype))
    with bb.function("main", [x, w, b]):
        with bb.dataflow():
            y = bb.emit(relax.op.add(relax.op.matmul(x, w, out_dtype=out_dtype), b))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = pre_schedule_module(bb.get(), rammer_target(TARGET), RammerConfig())
    funcs = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert len(funcs) == 1
    return funcs[0]


def gemv_transposed(k, n):
    """``y[0, j] = sum_k x[0, k] * W[j, k]``: W stored ``[N, K]`` (a Gemm with transB as one
    operator), its columns strided."""
    from tvm import te

    x = te.placeholder((1, k), name="x")
    w = te.placeholder((n, k), name="w")
    r = te.reduce_axis((0, k), name="r")
    y = te.compute((1, n), lambda i, j: te.sum(x[i, r] * w[j, r], axis=r), name="y")
    return te.create_prim_func([x, w, y])


def _inputs(func, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal([int(d) for d in p.ty.shape]).astype(str(p.ty.dtype))
            for p in func.params[:-1]]


# GPT-2 small's decode MatMuls: c_attn (N = 2304) and the projections (N = 768), K = 768
@pytest.mark.parametrize("n, dtype, out_dtype", [(2304, "float32", None), (768, "float32", None),
                                                 (2304, "float16", "float32"),
                                                 (768, "float16", "float16")])
def test_gemv_versions_compute_x_at_w_plus_b_with_16_byte_loads(n, dtype, out_dtype):
    """Every version, thread loops run serially on llvm, equals NumPy's x @ W + b (float16
    inputs accumulated in float32 within float32's rounding when the output is float32; a
    float16 output, whose partial sums are float16 as in TVM's own kernel, within 2e-2); each
    thread's weight load is one vector of 16 bytes, its column lanes on threadIdx.x."""
    func = gemv(768, n, dtype, out_dtype)
    vec = 16 // np.dtype(dtype).itemsize
    assert gemv_vec(func) == vec
    versions = gemv_schedules(func)
    assert [v.name for v in versions] == [f"gemv_v{vec}_n{a}_k{b}" for a, b in GEMV_SHAPES]
    x, w, b = _inputs(func)
    want = x.astype(np.float64) @ w.astype(np.float64) + b.astype(np.float64)
    out = np.zeros(want.shape, out_dtype or dtype)
    tol = 1e-5 if (out_dtype or dtype) == "float32" else 2e-2  # float16 out: float16's tolerance
    target = rammer_target(TARGET)
    for version, (threads_n, split_k) in zip(versions, GEMV_SHAPES):
        got = run_on_cpu(serial_threads(version.func), [x, w, b, out.copy()])[-1]
        err = np.abs(got.astype(np.float64) - want).max() / np.abs(want).max()
        assert err <= tol, (version.name, err)
        kernel = prelower(version.func, target, "gemv")
        assert kernel.num_rtasks == n // (vec * threads_n)
        assert kernel.block == (threads_n, split_k, 1)  # column lanes adjacent in a warp
        body = kernel.body.script()
        assert re.search(rf"w_?\d*\[T\.Ramp\([^)]*, 1, {vec}\)\]", body), version.name


def test_gemv_versions_decline_what_is_not_a_contiguous_gemv():
    """Controls: W stored [N, K] (columns strided: no vector load), 8 rows, and N not a multiple
    of the vector (GPT-2's vocabulary, 50257, is odd) get no GEMV version (the other templates
    still apply to them)."""
    assert gemm_form(gemv_transposed(256, 128)).b_inner == "K"
    assert gemv_schedules(gemv_transposed(256, 128)) == []
    assert gemv_schedules(gemv(256, 128, rows=8)) == []
    assert gemv_schedules(gemv(256, 97)) == []
    assert schedule_gemv(gemv(256, 128), 8, 8, 32) is None  # float32's vector is 4, not 8
    assert schedule_gemv(gemv(256, 128), 4, 3, 32) is None  # lanes must tile a warp


def test_gemv_versions_are_kept_under_the_version_cap_with_analytical_times():
    """kernel_versions puts them right after the pipeline's own schedule: with max_versions = 3
    they are still there; every version has a finite analytical time from the cost model (the
    policy's choice among them once measured), narrow rTasks predicted faster than wide ones on
    the H100 preset for N = 768 (more vEUs streaming the weights)."""
    from tvm.s_tir import dlight as dl

    from tvm_rammer.scheduling import rkernels
    from tvm_rammer.tuning.versions import VersionOptions, kernel_versions, named_versions

    func = gemv(768, 768)
    target = rammer_target(TARGET)
    with target:
        scheduled = dl.ApplyDefaultSchedule(*default_rules())(tvm.IRModule({"main": func}))["main"]
    versions = kernel_versions("gemv", target, scheduled=scheduled, unscheduled=func,
                               options=VersionOptions(max_versions=3))
    names = [v.name for v in versions]
    assert len(versions) <= 3 and names[0] == "dlight" and names[1].startswith("gemv_v4_"), names
    config = RammerConfig(num_sms=132)
    vdevice = rkernels.vdevice_for(target, config)
    every = kernel_versions("gemv", target, scheduled=scheduled, unscheduled=func)
    assert len(every) <= VersionOptions().max_versions
    times = {v.name: rkernels.predicted_version_us(v.func, v.lowered, config, vdevice)
             for v in every}
    assert all(t is not None and 0 < t < 1e3 for t in times.values()), times
    assert times["gemv_v4_n2_k64"] < times["gemv_v4_n32_k8"], times
    alone = named_versions("gemv", target, [("gemv_v4_n8_k32", "template")],
                           scheduled=scheduled, unscheduled=func)  # made by its name alone
    made = next(v for v in every if v.name == "gemv_v4_n8_k32")
    assert alone is not None and alone[0].key == made.key


def test_gemv_versions_match_tvm_default_on_the_emulator():
    """Every GEMV version of a float32 and a float16 (float32-accumulating) GEMV on the CPU
    emulator against TVM's default kernel for the operator (one joint g++ build)."""
    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        pytest.skip("the emulator builds kernels with a C++ compiler (none on PATH)")
    from tir_templates.default_schedule import schedule_like_default
    from tvm_rammer.checks.emulator.versions import check_versions
    from tvm_rammer.target import plain_target, resolve_target
    from tvm_rammer.tuning.measure import KernelJob
    from tvm_rammer.tuning.versions import func_key

    target = resolve_target(TARGET)
    jobs = []
    for name, func in (("f32", gemv(256, 256)), ("f16", gemv(256, 512, "float16", "float32"))):
        reference = schedule_like_default(func, plain_target(target))
        jobs += [KernelJob(key=func_key(v.func), label=f"{name}:{v.name}", func=v.func,
                           reference=reference, reference_key=func_key(reference), num_outputs=1,
                           operator=name) for v in gemv_schedules(func)]
    assert len(jobs) == 2 * len(GEMV_SHAPES)
    records = check_versions(jobs, target)
    bad = [(job.label, rec) for job, rec in zip(jobs, records) if rec["valid"] is not True]
    assert len(records) == len(jobs) and not bad, bad


@pytest.mark.nvcc
def test_gemv_versions_build_for_sm90a_without_spills():
    """Every GEMV version of a float32 and a float16 (float32-accumulating) GPT-2-shaped GEMV,
    each in a persistent wrapper of 256 threads, compiles with nvcc in one module without spills
    (the float32x8 accumulators of float16 weights included)."""
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not on PATH")
    from conftest_tir import persistent_wrapper
    from tir_templates.cuda_resources import compile_cuda_resources
    from tir_templates.rtask_rewrite import instantiate

    target = rammer_target(TARGET)
    funcs = {}
    for func in (gemv(768, 768), gemv(768, 2304, "float16", "float32")):
        for version in gemv_schedules(func):
            kernel = prelower(version.func, target, "gemv")
            symbol = f"rammer_v{len(funcs)}"
            funcs[symbol] = persistent_wrapper(kernel, 256, instantiate).with_attr(
                "global_symbol", symbol)
    assert len(funcs) == 2 * len(GEMV_SHAPES)
    module = tvm.tirx.build(tvm.IRModule(funcs), TARGET)
    usage = compile_cuda_resources(str(module.imports[0].inspect_source()), "sm_90a")
    assert usage["spills"] == 0 and usage["stack_bytes"] == 0, usage
