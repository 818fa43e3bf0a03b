"""``schedule_spatial`` with several outputs per thread computes what the operator does.

Each thread of ``spatial_t{threads}x{per}`` computes ``per`` consecutive outputs of the flattened
output. Their write-back once sat under the thread loop, so TVM's region analysis gave it the
bounding box of those outputs in the output's own dimensions: whole rows or planes whenever ``per``
does not divide the innermost extent (4 outputs of a 7x7 pooling plane), and every thread stored the
other threads' outputs too, from its own uninitialised local buffer (AlexNet's
``max_pool2d:spatial_t128x4``, rel err 0.68 in the CUDA emulator). These tests run the scheduled
PrimFunc on the CPU with its thread loops made serial (``conftest_tir.serial_threads``) against the
unscheduled PrimFunc, on shapes whose output planes do and do not divide by ``per``.

A second defect of the same write-back, found by ``scripts/version_sweep.py`` (seq2seq's 3x64
matmul, ``spatial_t256x1``: heap corruption on the CPU): with one thread block of more threads than
outputs, TVM gave the write-back a domain past the output's last row and no predicate, so idle
threads stored out of bounds. Running that would corrupt memory, so its test checks the TIR: no
block's domain indexes past the buffer it writes.
"""
import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from conftest_tir import TARGET, cuda_source, serial_threads, single_op_module
from tir_templates.serial_run import stores_past_the_end
from tir_templates.templates import schedule_spatial


def unscheduled(op, *shapes):
    """The one PrimFunc of ``op`` after LegalizeOps (what the templates start from)."""
    mod = relax.transform.LegalizeOps()(single_op_module(op, *shapes))
    (func,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    return func


def run_cpu(func, seed=0):
    """Every buffer of ``func`` after running it on llvm; inputs seeded, outputs pre-filled with NaN
    (an output the function never writes stays NaN)."""
    rng = np.random.default_rng(seed)
    lib = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")
    args = []
    for i, param in enumerate(func.params):
        shape = [int(d) for d in param.ty.shape]
        data = rng.standard_normal(shape) if i < len(func.params) - 1 else np.full(shape, np.nan)
        args.append(tvm.runtime.tensor(data.astype("float32")))
    lib["main"](*args)
    return [a.numpy() for a in args]


def pool(x):
    return relax.op.nn.max_pool2d(x, pool_size=2, strides=2)


CASES = {
    # name: (op, input shapes); output plane and whether 4 divides it
    "pool_7x7": (pool, [(1, 12, 14, 14)]),          # 49 per plane: the AlexNet defect
    "pool_3x5_odd_total": (pool, [(1, 19, 6, 10)]),  # 15 per plane, 285 outputs: a partial thread
    "pool_8x8": (pool, [(1, 12, 16, 16)]),          # 64 per plane: was already right
    "matmul_n30": (relax.op.matmul, [(16, 64), (64, 30)]),  # rows of 30
    "mean_rows_of_7": (lambda x: relax.op.mean(x, axis=[3]), [(4, 12, 7, 7)]),  # sum, then divide
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("threads, per", [(32, 4), (128, 4), (64, 3)])
def test_spatial_versions_compute_the_operator(case, threads, per):
    op, shapes = CASES[case]
    func = unscheduled(op, *shapes)
    scheduled = schedule_spatial(func, threads, per)
    if scheduled is None:
        pytest.skip("the template declines this shape (most threads would idle)")
    want = run_cpu(func)[-1]
    got = run_cpu(serial_threads(scheduled))[-1]
    assert not np.isnan(got).any(), "outputs never written"
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_each_thread_writes_only_its_own_outputs():
    """The CUDA of ``spatial_t128x4`` on a 7x7 plane keeps one accumulator per thread (not a whole
    plane in local memory) and stores one output per step of its 4."""
    func = schedule_spatial(unscheduled(pool, (1, 12, 14, 14)), 128, 4)
    source = cuda_source(func.with_attr("global_symbol", "pool"), TARGET)
    assert "pool_max_local_ptr[1];" in source
    stores = [line for line in source.splitlines() if "pool_max_ptr[" in line and "=" in line]
    assert len(stores) == 1 and stores[0].strip().endswith("= pool_max_local_ptr[0];")


@pytest.mark.parametrize("threads, per", [(256, 1), (128, 1), (64, 4)])
def test_idle_threads_of_a_single_block_store_nothing(threads, per):
    """3 x 64 = 192 outputs: one block of 256 threads leaves 64 idle (their output row 3 does not
    exist); the write-back must not range over it."""
    func = unscheduled(relax.op.matmul, (3, 16), (16, 64))
    scheduled = schedule_spatial(func, threads, per)
    assert stores_past_the_end(scheduled) == []
    np.testing.assert_allclose(run_cpu(serial_threads(scheduled))[-1], run_cpu(func)[-1],
                               rtol=1e-6, atol=1e-6)


def test_the_domain_check_sees_a_store_past_the_end():
    """Negative control: a block whose domain is one row longer than the buffer it writes."""
    @tvm.script.tirx.prim_func(s_tir=True)
    def too_long(a: tvm.script.tirx.Buffer((3, 4), "float32")):  # noqa: F821  (TVMScript dtype)
        for i, j in tvm.script.tirx.grid(4, 4):
            with tvm.script.tirx.sblock("store"):
                vi, vj = tvm.script.tirx.axis.remap("SS", [i, j])
                a[vi, vj] = 1.0

    assert stores_past_the_end(too_long) == [("store", "a", 0)]
