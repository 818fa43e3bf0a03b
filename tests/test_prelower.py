"""prelower: dlight-scheduled kernels lowered by TVM's own passes and described as rTasks."""
import pytest
import tvm
import tvm_ffi
from tvm import relax, tirx
from tvm.script import relax as R
from tvm.script import tirx as T

from conftest_tir import MODELS, TARGET, grid3d_block3d, schedule, scheduled_kernel, single_op_module
from tir_templates.prelower import UnsupportedKernel, bound_launch, prelower

# model -> (grid, block, shared_bytes, has_sync) as dlight schedules them for sm_90a
EXPECTED = {
    "matmul": ((4, 8, 1), (8, 16, 1), 6912, True),
    "gemv": ((32, 1, 1), (16, 16, 1), 1024, True),
    "conv2d": ((32, 1, 1), (8, 16, 1), 6912, True),
    "softmax": ((128, 1, 1), (256, 1, 1), 128, True),
    "sum": ((128, 1, 1), (512, 1, 1), 80, True),
    "add": ((64, 1, 1), (1024, 1, 1), 0, False),
    "max_pool2d": ((8, 1, 1), (1024, 1, 1), 0, False),
    "concat": ((24, 1, 1), (1024, 1, 1), 0, False),
    "batch_matmul": ((4, 8, 1), (8, 16, 1), 6912, True),
}


def _thread_extents(stmt) -> list:
    found = []
    tvm_ffi.structural_walk(stmt, (tirx.AttrStmt, lambda n: found.append(n) if n.attr_key == "thread_extent" else None))
    return found


@pytest.fixture(scope="module", params=sorted(MODELS))
def lowered(request):
    return request.param, prelower(scheduled_kernel(request.param), TARGET, request.param)


def test_prelower_strips_every_thread_extent(lowered):
    _, kernel = lowered
    assert _thread_extents(kernel.body) == []
    assert set(kernel.block_vars) <= {"blockIdx.x", "blockIdx.y", "blockIdx.z"}
    assert "blockIdx.x" in kernel.block_vars or "blockIdx.y" in kernel.block_vars


def test_prelower_grid_block_and_shared_memory_match_the_schedule(lowered):
    name, kernel = lowered
    assert (kernel.grid, kernel.block, kernel.shared_bytes, kernel.has_sync) == EXPECTED[name]
    assert kernel.num_rtasks == kernel.grid[0] * kernel.grid[1] * kernel.grid[2]
    assert kernel.shared_bytes % 16 == 0


def test_prelower_params_are_the_call_tir_buffers_in_order(lowered):
    name, kernel = lowered
    op, *shapes = MODELS[name]
    assert len(kernel.params) == len(shapes) + 1
    for param, shape in zip(kernel.params, shapes):
        assert [int(d) for d in param.shape] == list(shape)


def test_prelower_lowers_cross_thread_reduction_to_shuffles():
    kernel = prelower(scheduled_kernel("softmax"), TARGET, "softmax")
    assert "tvm_warp_shuffle_down" in kernel.body.script()
    assert "tvm_storage_sync" in kernel.body.script()


def test_prelower_handles_3d_grid_and_3d_block():
    kernel = prelower(grid3d_block3d, TARGET, "grid3d")
    assert kernel.grid == (4, 3, 2) and kernel.block == (8, 2, 4)
    assert set(kernel.thread_vars) == {"threadIdx.x", "threadIdx.y", "threadIdx.z"}
    assert kernel.shared_bytes == 256 and kernel.has_sync
    assert kernel.num_rtasks == 24 and kernel.threads == 64


def test_prelower_rejects_an_unscheduled_primfunc():
    mod = single_op_module(relax.op.add, (16, 16), (16, 16))
    mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()])(mod)
    func = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)][0]
    with pytest.raises(UnsupportedKernel, match="add_unscheduled: no blockIdx binding"):
        prelower(func, TARGET, "add_unscheduled")


def test_prelower_rejects_symbolic_shapes():
    bb = relax.BlockBuilder()
    x = relax.Var("x", R.Tensor((tirx.Var("n", "int64"), 64), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            out = bb.emit_output(relax.op.add(x, x))
        bb.emit_func_output(out)
    mod = schedule(bb.get())
    func = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)][0]
    with pytest.raises(UnsupportedKernel, match="dyn_add: .*symbolic"):
        prelower(func, TARGET, "dyn_add")


def test_prelower_rejects_non_primfunc():
    with pytest.raises(UnsupportedKernel, match="expected a tirx.PrimFunc"):
        prelower(relax.Var("x"), TARGET, "x")


@T.prim_func(s_tir=True)
def _two_thread_extents(a: T.Buffer((64,), "float32"), b: T.Buffer((64,), "float32")):
    for bx in T.thread_binding(2, thread="blockIdx.x"):
        for tx in T.thread_binding(32, thread="threadIdx.x"):
            b[bx * 32 + tx] = a[bx * 32 + tx]
        for tx2 in T.thread_binding(16, thread="threadIdx.x"):
            b[bx * 32 + tx2] = a[bx * 32 + tx2] * T.float32(2)


@pytest.mark.parametrize("model", sorted(MODELS))
def test_bound_launch_reads_the_launch_prelower_gives(model):
    grid, block, _, _ = EXPECTED[model]
    assert bound_launch(scheduled_kernel(model)) == (grid, block)


def test_bound_launch_declines_what_it_cannot_read():
    # threadIdx.x bound with 32 and with 16: prelower unifies them to one launch of 32 threads,
    # which the loops alone do not say, so no shape is read (the version is lowered)
    kernel = prelower(_two_thread_extents, TARGET, "two_extents")
    assert kernel.block == (32, 1, 1)
    assert bound_launch(_two_thread_extents) is None
    assert bound_launch(grid3d_block3d) is None  # launched by AttrStmts, not thread-binding loops
    mod = single_op_module(relax.op.add, (16, 16), (16, 16))
    mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()])(mod)
    (func,) = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert bound_launch(func) is None  # unscheduled: no blockIdx
