"""Shared helpers for the tir_templates tests: small Relax models -> dlight-scheduled kernels,
and a throw-away one-kernel persistent wrapper (grid = rTasks, block = vEU threads)."""
import tvm
from tvm import relax, tirx
from tvm.s_tir import dlight as dl
from tvm.script import relax as R
from tvm.script import tirx as T

from tir_templates.serial_run import serial_threads  # noqa: F401  (the tests' import)
from tvm_rammer.codegen import resources

TARGET = tvm.target.Target({"kind": "cuda", "arch": "sm_90a"})
MAX_THREADS = 1024


def schedule(mod: tvm.IRModule, target=TARGET) -> tvm.IRModule:
    """LegalizeOps + AnnotateTIROpPattern + dlight default schedule under ``target``."""
    mod = tvm.transform.Sequential([relax.transform.LegalizeOps(), relax.transform.AnnotateTIROpPattern()])(mod)
    with target:
        return dl.ApplyDefaultSchedule(dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(),
                                       dl.gpu.GeneralReduction(), dl.gpu.Fallback())(mod)


def single_op_module(op, *shapes, dtype="float32"):
    """Relax module ``main(x0, x1, ...) = op(x0, x1, ...)``."""
    bb = relax.BlockBuilder()
    args = [relax.Var(f"x{i}", R.Tensor(shape, dtype)) for i, shape in enumerate(shapes)]
    with bb.function("main", args):
        with bb.dataflow():
            out = bb.emit_output(op(*args))
        bb.emit_func_output(out)
    return bb.get()


MODELS = {
    "matmul": (relax.op.matmul, (128, 256), (256, 512)),
    "gemv": (relax.op.matmul, (1, 256), (256, 512)),
    "conv2d": (lambda x, w: relax.op.nn.conv2d(x, w, padding=1), (1, 16, 32, 32), (32, 16, 3, 3)),
    "softmax": (relax.op.nn.softmax, (128, 512)),
    "sum": (lambda x: relax.op.sum(x, axis=[1]), (128, 512)),
    "add": (relax.op.add, (128, 512), (128, 512)),
    "max_pool2d": (lambda x: relax.op.nn.max_pool2d(x, pool_size=2, strides=2), (1, 32, 32, 32)),
    "concat": (lambda a, b: relax.op.concat([a, b], axis=1), (64, 128), (64, 256)),
    "batch_matmul": (relax.op.matmul, (4, 128, 256), (4, 256, 128)),
}


def scheduled_kernel(model: str):
    """The one scheduled PrimFunc of MODELS[model]."""
    op, *shapes = MODELS[model]
    mod = schedule(single_op_module(op, *shapes))
    funcs = [f for f in mod.functions.values() if isinstance(f, tirx.PrimFunc)]
    assert len(funcs) == 1, funcs
    return funcs[0]


@T.prim_func(s_tir=True)
def grid3d_block3d(a: T.Buffer((2, 3, 4, 4, 2, 8), "float32"), b: T.Buffer((2, 3, 4, 4, 2, 8), "float32")):
    """A hand-launched 3-D grid x 3-D block kernel with a shared buffer and a barrier."""
    bx = T.launch_thread("blockIdx.x", 4)
    by = T.launch_thread("blockIdx.y", 3)
    bz = T.launch_thread("blockIdx.z", 2)
    s = T.alloc_shared((64,), "float32")
    tx = T.launch_thread("threadIdx.x", 8)
    ty = T.launch_thread("threadIdx.y", 2)
    tz = T.launch_thread("threadIdx.z", 4)
    s[tz * 16 + ty * 8 + tx] = a[bz, by, bx, tz, ty, tx]
    T.tvm_storage_sync("shared")
    b[bz, by, bx, tz, ty, tx] = s[63 - (tz * 16 + ty * 8 + tx)]


def veu_threads_for(kernel) -> int:
    """A vEU wider than the kernel (exercises early exit) unless the kernel is already maximal."""
    return min(MAX_THREADS, kernel.threads + 64)


def fresh_buffer(param, name=None):
    """A new buffer Var with the type of ``param``."""
    return tirx._ffi_api.BufferVar(name or param.name, param.ty, None)  # pylint: disable=protected-access


def persistent_wrapper(kernel, veu_threads, instantiate, copies=1):
    """Test-only persistent PrimFunc: vEU ``v`` runs rTask ``v`` of ``kernel`` ``copies`` times."""
    params = [fresh_buffer(p, f"{p.name}_{i}") for i, p in enumerate(kernel.params)]
    veu, tid = tirx.Var("veu", "int32"), tirx.Var("tid", "int32")
    pool = tirx.decl_buffer((max(kernel.shared_bytes, 16),), "uint8", name="rammer_smem", scope="shared")
    body = [tirx.AllocBuffer(pool)] if kernel.shared_bytes else []
    body += [instantiate(kernel, params, veu, tid, veu_threads, smem_pool=pool) for _ in range(copies)]
    stmt = tirx.AttrStmt(tirx.IterVar(None, tid, 1, "threadIdx.x"), "thread_extent", veu_threads,
                         tirx.SeqStmt(body) if len(body) > 1 else body[0])
    stmt = tirx.AttrStmt(tirx.IterVar(None, veu, 1, "blockIdx.x"), "thread_extent", kernel.num_rtasks, stmt)
    func = tirx.PrimFunc(params, stmt)
    return func.with_attrs({"global_symbol": f"rammer_{kernel.name}", "tirx.noalias": True})


def cuda_source(func, target=TARGET) -> str:
    """CUDA source of ``func`` after TVM's full default (s_tir) build."""
    return resources.cuda_source(func, target)
