"""float16 inference and tensor-core rKernels (``tir_templates.mma_templates``).

CPU checks: ``precision="float16"`` converts the model with ToMixedPrecision; the tensor-core versions
of float16 convs/matmuls have the expected rTask shape, go through ``prelower`` (warp fragments
lowered to registers, dynamic shared memory in the pool), build for sm_90a without spills and their
SASS uses HMMA (tensor-core) and LDSM (ldmatrix) instructions; tuning uses the rTask thread cap. The
GPU test runs each version and compares it with the operator built for the CPU.
"""
import math

import numpy as np
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import relax as R

from conftest_tir import TARGET, fresh_buffer
from test_fast_rkernels import OPS, _cpu_reference, compile_versions
from tir_templates.cuda_resources import compile_cuda_sass, find_tool, sass_functions, sass_opcodes
from tir_templates.gemm_templates import gemm_form
from tir_templates.mma_templates import MMA_CONFIGS, mma_schedules, schedule_gemm_mma, shared_bytes, supports_mma
from tir_templates.prelower import prelower
from tir_templates.rtask_rewrite import instantiate
from tir_templates.templates import fast_schedules
from tvm_rammer.cli import build_parser
from tvm_rammer.config import RammerConfig
from tvm_rammer.driver.pipeline import rammer_passes
from tvm_rammer.target import rammer_target
from tvm_rammer.tuning.tune import extract_tasks, pre_schedule_module

FP16 = RammerConfig(precision="float16")
SASS = pytest.mark.skipif(find_tool("cuobjdump") is None or find_tool("nvdisasm") is None,
                          reason="needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump "
                                 "nvidia-cuda-nvdisasm)")
MMA_OPS = ["conv_s2", "conv_11x11_s4", "conv_1x1", "grouped", "matmul", "dense_b8"]


def fused16(name):
    """OPS[name] + bias + ReLU through the float16 pipeline prefix: its one float16 GEMM PrimFunc."""
    op, *shapes = OPS[name]
    bb = relax.BlockBuilder()
    args = [relax.Var(f"x{i}", R.Tensor(s, "float32")) for i, s in enumerate(shapes)]
    with bb.function("main", args):
        with bb.dataflow():
            y = bb.emit(op(*args))
            shape = [int(d) for d in y.ty.shape]
            bias = np.linspace(-1, 1, shape[1], dtype="float32").reshape([1, shape[1]] + [1] * (len(shape) - 2))
            out = bb.emit_output(bb.emit(relax.op.nn.relu(relax.op.add(y, relax.const(bias)))))
        bb.emit_func_output(out)
    mod = pre_schedule_module(bb.get(), rammer_target(TARGET), FP16)
    funcs = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc) and gemm_form(f) is not None]
    assert len(funcs) == 1, len(funcs)
    return funcs[0]


def test_precision_is_validated_and_reaches_the_pipeline_and_the_cli():
    with pytest.raises(ValueError, match="precision='bfloat16'.*float32.*float16"):
        RammerConfig(precision="bfloat16")
    assert RammerConfig().precision == "float32"
    names = [p.info.name for p in rammer_passes(rammer_target(TARGET), FP16)]
    mixed = [i for i, n in enumerate(names) if "ToMixedPrecision" in n]
    assert len(mixed) == 1 and mixed[0] < names.index("MemoLegalizeOps"), names  # before legalizing
    assert not any("ToMixedPrecision" in n for n in
                   (p.info.name for p in rammer_passes(rammer_target(TARGET), RammerConfig())))
    args = build_parser().parse_args(["inspect", "m.onnx", "--precision", "float16"])
    assert args.precision == "float16"


def test_float16_gemms_accumulate_in_float32():
    form = gemm_form(fused16("conv_s2"))
    assert (form.in_dtype, form.out_dtype) == ("float16", "float32")
    assert (form.m, form.n, form.k) == (64, 32, 144)


@pytest.mark.parametrize("name", ["conv_s2", "grouped", "matmul", "dense_b8"])
@pytest.mark.parametrize("config", [(2, 2, 2, 2, 32), (1, 1, 2, 2, 64), (1, 1, 1, 1, 64)])
def test_tensor_core_rtasks(name, config):
    """One rTask per output tile, 32 lanes x warps threads, two shared stages of the A and B tiles
    (the accumulator tile may reuse them: at most shared_bytes()), the warp fragments lowered to
    per-thread registers and the work done by ldmatrix + mma.sync."""
    wm, wn, fm, fn, tk = config
    func = fused16(name)
    scheduled = schedule_gemm_mma(func, *config)
    if scheduled is None:
        pytest.skip(f"{name}: config {config} is mostly padding")  # covered by other configs
    form = gemm_form(func)
    tm, tn = wm * fm * 16, wn * fn * 16
    kernel = prelower(scheduled, TARGET, name)
    assert kernel.num_rtasks == form.batch * math.ceil(form.m / tm) * math.ceil(form.n / tn)
    assert kernel.block == (32, wm * wn, 1)
    assert 2 * (tm + tn) * (tk + 8) * 2 <= kernel.shared_bytes <= shared_bytes(*config)
    scopes = []
    tvm_ffi.structural_walk(kernel.body, (tirx.AllocBuffer, lambda n: scopes.append(n.buffer.scope())))
    assert "warp" not in scopes and "local" in scopes
    text = kernel.body.script()
    assert "ptx_legacy.ldmatrix" in text and "ptx_legacy.mma" in text


def test_batch1_dense_in_float16_is_a_gemv_for_the_small_batch_template():
    """One row: a tensor core would compute 16 (and the weights are streamed once either way)."""
    func = fused16("dense_b1")
    assert mma_schedules(func, TARGET) == []
    names = [t.name for t in fast_schedules(func, TARGET)]
    assert names and all(n.startswith("small_batch_") for n in names), names


def test_tensor_cores_need_sm80_and_float16():
    func = fused16("matmul")
    assert supports_mma(tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
    assert not supports_mma(tvm.target.Target({"kind": "cuda", "arch": "sm_70"}))
    assert mma_schedules(func, tvm.target.Target({"kind": "cuda", "arch": "sm_70"})) == []
    assert [n for n, _ in mma_schedules(func, TARGET)]
    from test_fast_rkernels import fused
    assert mma_schedules(fused("matmul"), TARGET) == []  # float32: the SIMT templates
    # versions of a float16 GEMM: tensor-core ones first, within 48 KB unless the target allows more
    names = [t.name for t in fast_schedules(func, TARGET)]
    assert names[0].startswith("mma_") and any(n.startswith("gemm_") for n in names)
    big = mma_schedules(func, TARGET, max_shared_bytes=200 * 1024)
    assert len(big) > len(mma_schedules(func, TARGET))


def _mma_kernels(func, name, limit=None):
    return [prelower(f, TARGET, f"{name}_{n}") for n, (_, f) in enumerate(mma_schedules(func, TARGET)[:limit])]


@pytest.mark.nvcc
@SASS
@pytest.mark.parametrize("name", MMA_OPS)
def test_tensor_core_versions_build_without_spills_and_use_hmma(name):
    kernels = _mma_kernels(fused16(name), name, limit=3)
    assert kernels, name
    usage, sass = compile_versions_sass(kernels)
    assert usage["spills"] == 0 and usage["stack_bytes"] == 0, usage
    per_kernel = sass_functions(sass)
    assert len(per_kernel) == len(kernels)
    for kname, text in per_kernel.items():
        ops = sass_opcodes(text)
        assert ops.get("HMMA", 0) > 0 and ops.get("LDSM", 0) > 0, (kname, ops)


def compile_versions_sass(kernels, arch="sm_90a", pool_scope="shared"):
    """(resources, SASS) of the kernels, each in a persistent wrapper, in one CUDA module."""
    funcs = {}
    for n, kernel in enumerate(kernels):
        funcs[f"rammer_v{n}"] = _wrapper(kernel, pool_scope).with_attr("global_symbol", f"rammer_v{n}")
    module = tvm.tirx.build(tvm.IRModule(funcs), TARGET)
    return compile_cuda_sass(str(module.imports[0].inspect_source()), arch)


def _wrapper(kernel, pool_scope, veu_threads=256):
    params = [fresh_buffer(p, f"{p.name}_{i}") for i, p in enumerate(kernel.params)]
    veu, tid = tirx.Var("veu", "int32"), tirx.Var("tid", "int32")
    pool = tirx.decl_buffer((kernel.shared_bytes,), "uint8", name="rammer_smem", scope=pool_scope)
    body = tirx.SeqStmt([tirx.AllocBuffer(pool), instantiate(kernel, params, veu, tid, veu_threads, smem_pool=pool)])
    stmt = tirx.AttrStmt(tirx.IterVar(None, tid, 1, "threadIdx.x"), "thread_extent", veu_threads, body)
    stmt = tirx.AttrStmt(tirx.IterVar(None, veu, 1, "blockIdx.x"), "thread_extent", kernel.num_rtasks, stmt)
    return tirx.PrimFunc(params, stmt).with_attrs({"tirx.noalias": True})


@pytest.mark.nvcc
def test_a_pool_beyond_48kb_is_dynamic_shared_memory():
    """The 128x128 tile needs 104 KB: the rTask's views live in a "shared.dyn" pool, which the CUDA
    source declares extern (sized at launch), and the cubin has no static shared memory."""
    config = (2, 2, 4, 4, 32)
    kernel = prelower(schedule_gemm_mma(fused16("conv_1x1"), *config), TARGET, "big")
    assert kernel.shared_bytes > 48 * 1024
    func = _wrapper(kernel, "shared.dyn").with_attr("global_symbol", "big")
    source = str(tvm.tirx.build(tvm.IRModule({"big": func}), TARGET).imports[0].inspect_source())
    assert "extern __shared__" in source
    from tir_templates.cuda_resources import compile_cuda_resources
    usage = compile_cuda_resources(source, "sm_90a")
    assert usage["shared_bytes"] == 0 and usage["spills"] == 0


def test_the_persistent_kernel_makes_a_large_pool_dynamic():
    from tvm_rammer.codegen.persistent import (Binding, DispatchEntry, PersistentKernelSpec, TensorSlot,
                                               build_persistent_func)

    def pool_scope(config, outlined=False):  # outlined bodies: the pool is always dynamic
        kernel = prelower(schedule_gemm_mma(fused16("conv_1x1"), *config), TARGET, "k")
        tensors = tuple(TensorSlot(p.name, tuple(int(d) for d in p.shape), str(p.dtype)) for p in kernel.params)
        spec = PersistentKernelSpec("p", tensors, len(tensors) - 1,
                                    (DispatchEntry(kernel, tuple(Binding(i) for i in range(len(tensors)))),),
                                    veu_threads=256, rkernel_functions=outlined)
        func = build_persistent_func(spec, num_veus=2, table_len=16, with_barriers=False, instantiate=instantiate)
        found = []
        tvm_ffi.structural_walk(func.body, (tirx.AllocBuffer, lambda n: found.append(n.buffer.scope())
                                            if n.buffer.name == "rammer_smem" else None))
        return found

    assert pool_scope((2, 2, 4, 4, 32)) == ["shared.dyn"]
    assert pool_scope((2, 2, 2, 2, 32)) == ["shared"]
    assert pool_scope((2, 2, 2, 2, 32), outlined=True) == ["shared.dyn"]


def test_tuning_uses_the_rtask_cap_and_the_float16_model():
    from tvm_rammer.models import REDUCED, get_model
    from tvm_rammer.driver.frontend import import_onnx

    mod = import_onnx(get_model("alexnet", **REDUCED["alexnet"]))
    config = RammerConfig(max_rtask_threads=64, precision="float16")
    tasks = extract_tasks(mod, rammer_target(TARGET), config)
    assert tasks
    assert all(int(t.target.attrs["max_threads_per_block"]) == 64 for t in tasks)
    dtypes = {str(p.dtype) for t in tasks for f in t.dispatched for g in [f] for p in
              [q for fn in g.functions.values() if isinstance(fn, tirx.PrimFunc) for q in fn.params]}
    assert "float16" in dtypes


# ------------------------------------------------------------------- the two Table-1 CNNs in fp16

@pytest.mark.nvcc
@SASS
@pytest.mark.parametrize("model, sizes", [
    ("alexnet", dict(image_size=67, width=0.25, fc_width=64)),
    ("resnext29", dict(cardinality=2, bottleneck_width=16, base_channels=16, blocks_per_stage=1, image_size=16)),
])
def test_every_conv_and_matmul_of_the_table1_cnns_gets_a_tensor_core_version_in_fp16(model, sizes):
    """float16 AlexNet / ResNeXt-29 (reduced): every conv2d and every dense with more than one row
    has a tensor-core version, the batch-1 dense layers (GEMVs) a small-batch one; the first of each
    builds for sm_90a without spills and the tensor-core ones' SASS has HMMA (one nvcc call)."""
    from test_fast_rkernels import model_operators
    ops = model_operators(model, FP16, **sizes)
    assert len(ops) >= 6
    firsts, gemv = [], []
    for name, func in sorted(ops.items()):
        form = gemm_form(func)
        assert form.in_dtype == "float16", name
        if form.m == 1:
            versions = fast_schedules(func, TARGET)
            assert versions and versions[0].name.startswith("small_batch_"), name
            gemv.append(prelower(versions[0].func, TARGET, name))
            continue
        kernels = _mma_kernels(func, name, limit=1)
        assert kernels, f"{model}: no tensor-core version for {name}"
        firsts.append(kernels[0])
    assert firsts and gemv
    usage, sass = compile_versions_sass(firsts + gemv)
    assert usage["spills"] == 0 and usage["stack_bytes"] == 0, usage
    hmma = {k: sass_opcodes(v).get("HMMA", 0) for k, v in sass_functions(sass).items()}
    assert len(hmma) == len(firsts) + len(gemv)
    assert all(hmma[f"rammer_v{n}_kernel"] for n in range(len(firsts))), hmma


# --------------------------------------------------------------------------------- GPU: numerics

@pytest.mark.gpu
@pytest.mark.parametrize("name", MMA_OPS)
def test_every_tensor_core_version_matches_the_operator_on_the_gpu(name):
    """fp16 inputs, fp32 accumulation: the tolerance is that of float16 storage (rtol 1e-2)."""
    func = fused16(name)
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal([int(d) for d in p.shape]).astype(str(p.dtype)) for p in func.params[:-1]]
    expected = _cpu_reference(func, inputs)
    dev = tvm.cuda(0)
    for vname, version in mma_schedules(func, TARGET, max_shared_bytes=200 * 1024):
        lib = tvm.compile(tvm.IRModule({"main": version}), target=TARGET)
        args = [tvm.runtime.tensor(x, dev) for x in inputs]
        out = tvm.runtime.tensor(np.zeros_like(expected), dev)
        lib["main"](*args, out)
        np.testing.assert_allclose(out.numpy().astype("float32"), expected.astype("float32"),
                                   rtol=1e-2, atol=1e-2, err_msg=vname)


def test_bench_runs_the_tvm_baseline_at_the_same_precision_and_states_the_tolerance():
    from tvm_rammer.benchmarks.systems import TVM_DEFAULT, TVMSystem, tolerance_for
    from tvm_rammer.driver.frontend import import_onnx
    from tvm_rammer.models import get_model

    mod = import_onnx(get_model("two_branch", rows=4, k=16, n_out=8))
    dtypes = {}
    for precision in ("float32", "float16"):
        system = TVMSystem(TVM_DEFAULT, rammer_target(TARGET), RammerConfig(precision=precision))
        lowered = system.lower(mod)
        dtypes[precision] = {str(p.dtype) for f in lowered.functions.values()
                             if isinstance(f, tirx.PrimFunc) for p in f.params}
    assert "float16" in dtypes["float16"] and "float16" not in dtypes["float32"]
    assert tolerance_for("float16") == 1e-2 and tolerance_for("float32") == 1e-3
    with pytest.raises(ValueError, match="precision='int8'"):
        tolerance_for("int8")
