"""instantiate: one rTask of a lowered kernel inside a persistent vEU, through TVM's full build."""
import re

import pytest
import tvm
import tvm_ffi
from tvm import tirx

from conftest_tir import (MODELS, TARGET, fresh_buffer, grid3d_block3d, persistent_wrapper, scheduled_kernel,
                          veu_threads_for, cuda_source)
from tir_templates.cuda_resources import compile_cuda_resources, parse_ptxas_info
from tir_templates.prelower import UnsupportedKernel, prelower
from tir_templates.rtask_rewrite import NAMED_BARRIER, instantiate

KERNELS = sorted(MODELS) + ["grid3d"]


def _kernel(name):
    func = grid3d_block3d if name == "grid3d" else scheduled_kernel(name)
    return prelower(func, TARGET, name)


@pytest.fixture(scope="module", params=KERNELS)
def built(request):
    """(kernel, vEU threads, CUDA source of the one-kernel persistent wrapper)."""
    kernel = _kernel(request.param)
    veu = veu_threads_for(kernel)
    return kernel, veu, cuda_source(persistent_wrapper(kernel, veu, instantiate))


def _instantiated(kernel, veu):
    data = [fresh_buffer(p) for p in kernel.params]
    pool = tirx.decl_buffer((max(kernel.shared_bytes, 16),), "uint8", name="pool", scope="shared")
    rtask, tid = tirx.Var("r", "int32"), tirx.Var("tid", "int32")
    return instantiate(kernel, data, rtask, tid, veu, smem_pool=pool), data


def _kernel_source(src: str) -> str:
    return src[src.index('extern "C" __global__'):]


@pytest.mark.parametrize("name", KERNELS)
def test_instantiate_leaves_no_thread_extent_and_no_kernel_param(name):
    kernel = _kernel(name)
    stmt, data = _instantiated(kernel, veu_threads_for(kernel))
    assert isinstance(stmt, tirx.AttrStmt) and stmt.attr_key == "hand_threaded"
    seen = []
    tvm_ffi.structural_walk(stmt, [
        (tirx.AttrStmt, lambda n: seen.append(n.attr_key)),
        (tvm.ir.Var, lambda v: seen.append(v)),
    ])
    assert "thread_extent" not in seen
    assert not any(isinstance(v, tvm.ir.Var) and any(v.same_as(p) for p in kernel.params) for v in seen)
    assert any(isinstance(v, tvm.ir.Var) and any(v.same_as(d) for d in data) for v in seen)


def test_instantiate_twice_defines_fresh_vars():
    kernel = _kernel("softmax")
    first, _ = _instantiated(kernel, 320)
    second, _ = _instantiated(kernel, 320)
    defs = ([], [])
    for stmt, out in zip((first, second), defs):
        tvm_ffi.structural_walk(stmt, [(tirx.AllocBuffer, lambda n, o=out: o.append(n.buffer)),
                                       (tirx.For, lambda n, o=out: o.append(n.loop_var))])
    assert defs[0] and not any(a.same_as(b) for a in defs[0] for b in defs[1])


def test_full_build_uses_blockidx_only_as_the_veu_index(built):
    kernel, _, src = built
    body = _kernel_source(src)
    assert re.findall(r"blockIdx\.[yz]", body) == []
    assert f"__launch_bounds__({veu_threads_for(kernel)})" in body


def test_full_build_replaces_syncthreads_by_named_barrier_under_early_exit(built):
    kernel, veu, src = built
    body = _kernel_source(src)
    early_exit = kernel.threads < veu
    if early_exit:
        assert f"if (((int)threadIdx.x) < {kernel.threads})" in body
        assert "__syncthreads()" not in body
    if kernel.has_sync and early_exit:
        assert f"{NAMED_BARRIER}(1, {kernel.threads});" in body
        assert "bar.sync %0, %1;" in src
    else:
        assert f"{NAMED_BARRIER}(" not in body


def test_full_build_keeps_syncthreads_when_kernel_fills_the_veu():
    kernel = _kernel("grid3d")
    src = _kernel_source(cuda_source(persistent_wrapper(kernel, kernel.threads, instantiate)))
    assert "__syncthreads()" in src and f"{NAMED_BARRIER}(" not in src


def test_full_build_pool_is_one_uint8_allocation_of_the_kernel_size(built):
    kernel, _, src = built
    pools = re.findall(r"__shared__ alignas\(\d+\) (\w+) rammer_smem_ptr\[(\d+)\];", src)
    expected = [("uchar", str(kernel.shared_bytes))] if kernel.shared_bytes else []
    assert pools == expected
    assert len(re.findall(r"__shared__", _kernel_source(src))) == len(expected)


def test_two_rtasks_of_one_kernel_in_one_function_build():
    kernel = _kernel("softmax")
    src = cuda_source(persistent_wrapper(kernel, 320, instantiate, copies=2))
    assert _kernel_source(src).count(f"{NAMED_BARRIER}(1, 256);") == 2 * _kernel_source(
        cuda_source(persistent_wrapper(kernel, 320, instantiate))).count(f"{NAMED_BARRIER}(1, 256);")


def test_instantiate_refuses_barriers_over_a_partial_warp():
    kernel = _kernel("grid3d")
    narrow = type(kernel)(**{**kernel.__dict__, "block": (8, 2, 3)})
    with pytest.raises(UnsupportedKernel, match="48 threads is not a multiple of 32"):
        _instantiated(narrow, 64)


def test_instantiate_refuses_a_veu_narrower_than_the_kernel():
    kernel = _kernel("softmax")
    with pytest.raises(ValueError, match="needs 256 threads but the vEU has 128"):
        _instantiated(kernel, 128)


def test_instantiate_refuses_a_too_small_pool():
    kernel = _kernel("matmul")
    data = [fresh_buffer(p) for p in kernel.params]
    pool = tirx.decl_buffer((64,), "uint8", name="pool", scope="shared")
    with pytest.raises(ValueError, match="shared pool smaller than the 6912 bytes"):
        instantiate(kernel, data, tirx.Var("r", "int32"), tirx.Var("t", "int32"), 256, smem_pool=pool)


def test_parse_ptxas_info_reads_registers_smem_and_spills():
    log = ("ptxas info    : Function properties for k\n    8 bytes stack frame, 4 bytes spill stores, "
           "4 bytes spill loads\nptxas info    : Used 40 registers, used 2 barriers, 6912 bytes smem\n")
    assert parse_ptxas_info(log) == {"registers": 40, "shared_bytes": 6912, "spills": 8, "stack_bytes": 8}


@pytest.mark.nvcc
@pytest.mark.nvcc
def test_persistent_wrapper_compiles_to_an_sm90a_cubin(built):
    kernel, _, src = built
    res = compile_cuda_resources(src, "sm_90a")
    assert res["shared_bytes"] == kernel.shared_bytes
    assert 0 < res["registers"] <= 255
    assert res["spills"] == 0
