"""Fast rKernel templates: implicit-GEMM conv2d (grouped too), matmul/dense, small-batch dense and
depthwise conv2d (``tir_templates.gemm_templates``, ``tir_templates.conv_templates``).

CPU checks: the GEMM form read from each operator, the rTask shape (grid, block, shared memory) each
schedule must give, that ``prelower`` accepts every version, and that every version builds for sm_90a
inside a persistent vEU without spills or local-memory stack (one nvcc call per operator). The GPU
tests run each version and compare it with the unscheduled operator built for the CPU.
"""
import math

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import relax as R

from conftest_tir import TARGET, persistent_wrapper, single_op_module
from tir_templates.conv_templates import schedule_depthwise_conv2d
from tir_templates.cuda_resources import compile_cuda_resources
from tir_templates.gemm_templates import gemm_form, schedule_gemm_small_batch, schedule_gemm_tiled
from tir_templates.prelower import prelower
from tir_templates.rtask_rewrite import instantiate
from tir_templates.templates import fast_schedules, operator_kind, template_schedules
from tvm_rammer.config import RammerConfig
from tvm_rammer.target import rammer_target
from tvm_rammer.tuning.tune import pre_schedule_module

VEU_THREADS = 256
SMEM_STATIC = 48 * 1024


def conv(**kw):
    return lambda x, w: relax.op.nn.conv2d(x, w, **kw)


# name -> (op, input shapes); every op is followed by a bias add and a ReLU, fused like the pipeline does
OPS = {
    "conv_s2": (conv(strides=2, padding=1), (1, 16, 15, 15), (32, 16, 3, 3)),
    "conv_11x11_s4": (conv(strides=4, padding=2), (1, 3, 35, 35), (32, 3, 11, 11)),
    "conv_1x1": (conv(), (1, 64, 8, 8), (96, 64, 1, 1)),
    "grouped": (conv(padding=1, groups=4), (1, 32, 8, 8), (128, 8, 3, 3)),
    "depthwise": (conv(padding=1, groups=32), (1, 32, 20, 20), (32, 1, 3, 3)),
    "dense_b1": (relax.op.matmul, (1, 256), (256, 128)),
    "dense_b8": (relax.op.matmul, (8, 96), (96, 40)),
    "matmul": (relax.op.matmul, (64, 128), (128, 96)),
}


def fused(name, dtype="float32"):
    """The operator + bias + ReLU as the rammer pipeline prefix hands it to dlight (one PrimFunc)."""
    op, *shapes = OPS[name]
    bb = relax.BlockBuilder()
    args = [relax.Var(f"x{i}", R.Tensor(s, dtype)) for i, s in enumerate(shapes)]
    with bb.function("main", args):
        with bb.dataflow():
            y = bb.emit(op(*args))
            shape = [int(d) for d in y.ty.shape]
            bias = np.linspace(-1, 1, shape[1], dtype=dtype).reshape([1, shape[1]] + [1] * (len(shape) - 2))
            y = bb.emit(relax.op.nn.relu(relax.op.add(y, relax.const(bias))))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    mod = pre_schedule_module(bb.get(), rammer_target(TARGET), RammerConfig())
    funcs = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert len(funcs) == 1, [str(g) for g in mod.functions]
    return funcs[0]


def _allocs(body, scope):
    found = []
    tvm_ffi.structural_walk(body, (tirx.AllocBuffer, lambda n: found.append(n.buffer)
                                   if n.buffer.scope() == scope else None))
    return found


def _elems(buf):
    return math.prod(int(d) for d in buf.shape)


# ---------------------------------------------------------------------------------------------- form

@pytest.mark.parametrize("name, expected", [
    ("conv_s2", (1, 64, 32, 144, "I", "K", "I")),
    ("conv_11x11_s4", (1, 64, 32, 363, "I", "K", "I")),
    ("conv_1x1", (1, 64, 96, 64, "I", "K", "I")),
    ("grouped", (4, 64, 32, 72, "I", "K", "I")),
    ("dense_b8", (1, 8, 40, 96, "K", "J", "J")),
])
def test_gemm_form_reads_convolutions_as_implicit_gemms(name, expected):
    """batch (groups), M = output pixels / rows, N = output channels / columns, K = C*KH*KW, and
    which axis is contiguous in A, B and the output."""
    form = gemm_form(fused(name))
    assert (form.batch, form.m, form.n, form.k, form.a_inner, form.b_inner, form.c_inner) == expected


@pytest.mark.parametrize("op, shapes", [
    (lambda x: relax.op.nn.max_pool2d(x, pool_size=3, strides=2), [(1, 8, 9, 9)]),
    (relax.op.nn.softmax, [(4, 64)]),
    (lambda x: relax.op.sum(x, axis=[1]), [(4, 64)]),
])
def test_templates_decline_what_is_neither_gemm_nor_depthwise(op, shapes):
    mod = pre_schedule_module(single_op_module(op, *shapes), rammer_target(TARGET), RammerConfig())
    (func,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert gemm_form(func) is None
    assert fast_schedules(func) == []
    assert schedule_depthwise_conv2d(func, 8, 32, 4) is None


def test_depthwise_is_not_a_gemm_and_gemms_are_not_depthwise():
    assert gemm_form(fused("depthwise")) is None
    assert schedule_gemm_tiled(fused("depthwise"), 64, 64, 4, 4, 16) is None
    assert schedule_depthwise_conv2d(fused("conv_s2"), 8, 32, 4) is None


# ------------------------------------------------------------------------------------- rTask shape

@pytest.mark.parametrize("name", ["conv_s2", "conv_11x11_s4", "conv_1x1", "grouped", "matmul"])
@pytest.mark.parametrize("tile", [(64, 64, 4, 4, 16), (32, 32, 4, 4, 16), (64, 16, 4, 2, 16)])
def test_tiled_gemm_rtasks_tile_the_output_and_stage_k_in_shared(name, tile):
    """One rTask per (group, M tile, N tile); (tm/thm) x (tn/thn) threads, each with a thm x thn
    register accumulator; two shared stages of k-major A and B tiles, rows padded to 4 mod 32 floats
    (bank-conflict-free, 16-byte aligned)."""
    tm, tn, thm, thn, tk = tile
    func = fused(name)
    form = gemm_form(func)
    kernel = prelower(schedule_gemm_tiled(func, *tile), TARGET, name)
    assert kernel.num_rtasks == form.batch * math.ceil(form.m / tm) * math.ceil(form.n / tn)
    assert kernel.block == ((tm // thm) * (tn // thn), 1, 1)
    row = lambda n: n + (4 - n) % 32  # noqa: E731
    assert kernel.shared_bytes == 2 * tk * (row(tm) + row(tn)) * 4
    assert kernel.has_sync
    accumulators = [b for b in _allocs(kernel.body, "local") if _elems(b) == thm * thn]
    assert accumulators, [(b.name, b.shape) for b in _allocs(kernel.body, "local")]


def test_tiled_gemm_declines_tiles_that_would_be_mostly_padding():
    assert schedule_gemm_tiled(fused("dense_b8"), 64, 64, 4, 4, 16) is None  # 8 rows
    assert schedule_gemm_tiled(fused("matmul"), 64, 64, 4, 4, 16) is not None
    assert schedule_gemm_tiled(fused("matmul"), 64, 64, 3, 4, 16) is None  # 3 does not divide 64
    assert schedule_gemm_tiled(fused("matmul"), 128, 128, 4, 4, 16) is None  # 1024 threads > cap


@pytest.mark.parametrize("name", ["dense_b1", "dense_b8"])
@pytest.mark.parametrize("vec, threads_n, split_k", [(4, 8, 8), (1, 8, 32), (2, 16, 16)])
def test_small_batch_dense_splits_k_over_neighbouring_lanes(name, vec, threads_n, split_k):
    """Each thread keeps all rows of vec columns; the split of k is threadIdx.x, summed with warp
    shuffles (no shared memory, no block barrier)."""
    func = fused(name)
    form = gemm_form(func)
    kernel = prelower(schedule_gemm_small_batch(func, vec, threads_n, split_k), TARGET, name)
    assert kernel.num_rtasks == math.ceil(form.n / (vec * threads_n))
    assert kernel.block == (split_k, threads_n, 1)
    assert kernel.shared_bytes == 0 and not kernel.has_sync
    assert "tvm_warp_shuffle_down" in kernel.body.script()
    assert schedule_gemm_small_batch(fused("matmul"), vec, threads_n, split_k) is None  # 64 rows


@pytest.mark.parametrize("tile", [(8, 32, 4), (16, 16, 2), (4, 16, 1)])
def test_depthwise_rtasks_stage_the_input_tile_and_its_halo(tile):
    th, tw, per = tile
    kernel = prelower(schedule_depthwise_conv2d(fused("depthwise"), *tile), TARGET, "depthwise")
    assert kernel.num_rtasks == 32 * math.ceil(20 / th) * math.ceil(20 / tw)
    assert kernel.block == (th * tw // per, 1, 1)
    halo = (min(th, 20) + 2) * (min(tw, 20) + 2) * 4  # 3x3 window, stride 1, clipped to the image
    assert kernel.shared_bytes == (halo + 15) // 16 * 16
    assert [b for b in _allocs(kernel.body, "local") if _elems(b) == 9]  # the channel's weights


def test_convolutions_get_tiled_versions_and_no_naive_one():
    for name in ("conv_s2", "grouped", "depthwise"):
        names = [t.name for t in template_schedules(fused(name))]
        assert names and not any(n.startswith("spatial") for n in names), (name, names)
        assert all(n.startswith(("gemm_", "depthwise_")) for n in names), names
    pool = pre_schedule_module(single_op_module(lambda x: relax.op.nn.max_pool2d(x, pool_size=2),
                                                (1, 8, 8, 8)), rammer_target(TARGET), RammerConfig())
    (func,) = [f for f in pool.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert operator_kind(func) == "depthwise_conv2d"  # by its loop nest; a pooling, not a conv
    assert [t.name for t in template_schedules(func)][0].startswith("spatial")


def test_gemm_configs_with_the_least_padding_come_first():
    names = [t.name for t in fast_schedules(fused("conv_s2"))]  # M = 64, N = 32
    assert names[0] in ("gemm_m64n32_t4x4_k16", "gemm_m32n32_t4x4_k16"), names


# ------------------------------------------------------------------------------ nvcc: all versions

def compile_versions(kernels, arch="sm_90a"):
    """Resources of every prelowered kernel, each in its own persistent wrapper of VEU_THREADS
    threads, all in one CUDA module (one nvcc call)."""
    funcs = {}
    for n, kernel in enumerate(kernels):
        func = persistent_wrapper(kernel, VEU_THREADS, instantiate)
        symbol = f"rammer_v{n}"
        funcs[symbol] = func.with_attr("global_symbol", symbol)
    module = tvm.tirx.build(tvm.IRModule(funcs), TARGET)
    return compile_cuda_resources(str(module.imports[0].inspect_source()), arch)


@pytest.mark.nvcc
@pytest.mark.parametrize("name", sorted(OPS))
def test_fast_versions_build_for_sm90a_without_spills(name):
    """The first three versions of each operator (the ones kernel_versions keeps first)."""
    versions = fast_schedules(fused(name))
    assert versions, name
    kernels = [prelower(v.func, TARGET, f"{name}_{n}") for n, v in enumerate(versions)]
    assert all(k.threads <= VEU_THREADS and k.shared_bytes <= SMEM_STATIC for k in kernels)
    usage = compile_versions(kernels[:3])
    assert usage["spills"] == 0 and usage["stack_bytes"] == 0, usage
    assert usage["shared_bytes"] <= SMEM_STATIC


def model_operators(name, config=RammerConfig(), **overrides):
    """{PrimFunc name: unscheduled PrimFunc} of every conv2d / matmul of a zoo model (reduced)."""
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.models import REDUCED, get_model
    from tir_templates.conv_templates import depthwise_axes
    from tvm.s_tir.dlight.gpu.matmul import get_reduction_blocks
    from tvm.s_tir.dlight.analysis import get_root_block

    mod = import_onnx(get_model(name, **{**REDUCED[name], **overrides}))
    mod = pre_schedule_module(mod, rammer_target(TARGET), config)
    found = {}
    for gv, func in mod.functions_items():
        if not isinstance(func, tirx.PrimFunc):
            continue
        sch = tvm.s_tir.Schedule(func)
        blocks = get_reduction_blocks(sch, sch.get_child_blocks(get_root_block(sch)))
        if blocks and (gemm_form(func) is not None or depthwise_axes(sch.get(blocks[0])) is not None):
            found[gv.name_hint] = func
    return found


@pytest.mark.nvcc
@pytest.mark.parametrize("model", ["alexnet", "resnext29"])
def test_every_conv_and_matmul_of_the_table1_cnns_gets_a_fast_version(model):
    """AlexNet and ResNeXt-29 (reduced): every conv2d and dense has tiled versions that prelower,
    and the first of each builds for sm_90a without spills (one nvcc call for the model)."""
    ops = model_operators(model)
    kinds = {operator_kind(f) for f in ops.values()}
    assert len(ops) >= 8 and {"conv2d", "gemv"} <= kinds, (sorted(ops), kinds)
    firsts = []
    for name, func in sorted(ops.items()):
        versions = fast_schedules(func)
        assert versions, f"{model}: no fast version for {name}"
        kernels = [prelower(v.func, TARGET, name) for v in versions]
        assert all(k.threads <= VEU_THREADS for k in kernels)
        firsts.append(kernels[0])
    usage = compile_versions(firsts)
    assert usage["spills"] == 0 and usage["stack_bytes"] == 0, usage


# --------------------------------------------------------------------------------- GPU: numerics

def _cpu_reference(func, inputs):
    """The unscheduled operator built for the CPU (TVM's own semantics of the PrimFunc)."""
    lib = tvm.compile(tvm.IRModule({"main": func}), target="llvm")
    args = [tvm.runtime.tensor(x) for x in inputs]
    out = tvm.runtime.tensor(np.zeros([int(d) for d in func.params[-1].shape], str(func.params[-1].dtype)))
    lib["main"](*args, out)
    return out.numpy()


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(OPS))
def test_every_fast_version_matches_the_operator_on_the_gpu(name):
    func = fused(name)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype)) for p in func.params[:-1]]
    expected = _cpu_reference(func, inputs)
    dev = tvm.cuda(0)
    for version in fast_schedules(func):
        # a version is a private PrimFunc: without a global symbol TVM makes no host wrapper for it
        # ("BufferType does not have a corresponding C Type", all 8 cases on the H200, 2026-11-25)
        mod = tvm.IRModule({"main": version.func.with_attr("global_symbol", "main")})
        lib = tvm.compile(mod, target=TARGET)
        args = [tvm.runtime.tensor(x, dev) for x in inputs]
        out = tvm.runtime.tensor(np.zeros_like(expected), dev)
        lib["main"](*args, out)
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-4, atol=1e-4, err_msg=version.name)


def test_every_fast_version_matches_the_operator_on_the_emulator():
    """The GPU test above without a GPU: every fast version of every operator runs on the CPU
    emulator against TVM's default kernel for the operator (one joint g++ build), none unchecked."""
    from tir_templates.default_schedule import schedule_like_default
    from tvm_rammer.checks.emulator.versions import check_versions
    from tvm_rammer.target import plain_target, resolve_target
    from tvm_rammer.tuning.measure import KernelJob
    from tvm_rammer.tuning.versions import func_key

    target = resolve_target(TARGET)
    jobs = []
    for name in sorted(OPS):
        func = fused(name)
        reference = schedule_like_default(func, plain_target(target))
        jobs += [KernelJob(key=func_key(v.func), label=f"{name}:{v.name}", func=v.func,
                           reference=reference, reference_key=func_key(reference), num_outputs=1,
                           operator=name) for v in fast_schedules(func)]
    records = check_versions(jobs, target)
    assert len(records) == len(jobs) >= 2 * len(OPS)
    bad = [(job.label, rec) for job, rec in zip(jobs, records) if rec["valid"] is not True]
    assert not bad, bad


def test_a_grouped_conv_is_a_gemm_not_a_depthwise_stencil():
    """Its input channels are a reduction that shifts no image axis: only GEMM versions."""
    func = fused("grouped")
    assert schedule_depthwise_conv2d(func, 8, 32, 4) is None
    assert all(t.name.startswith("gemm_") for t in fast_schedules(func))
