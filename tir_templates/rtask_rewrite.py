"""Instantiate one rTask of a lowered kernel inside Rammer's persistent kernel (paper 4.1.3, 4.2).

A vEU is one persistent thread block of ``veu_threads`` threads with a 1-D ``threadIdx.x`` (``tid``).
It runs rTasks of different kernels one after another, so for each rTask we emit the kernel body
(``LoweredKernel.body``, already lowered by ``prelower``) with:

* ``blockIdx.{x,y,z}`` bound to the decomposition of the logical ``rtask_id`` (x fastest), and
  ``threadIdx.{x,y,z}`` bound to the decomposition of ``tid`` (Figure 10's thread remapping);
* early exit: when the kernel needs fewer threads than the vEU has, only ``tid < kernel.threads``
  run the body. Paper 4.1.3 notes that early exit deadlocks a barrier the exited threads never
  reach, so every block barrier of the kernel (``tvm_storage_sync("shared")``) becomes the named
  barrier ``bar.sync barrier_id, kernel.threads`` over the active threads only (``bar.sync`` counts
  whole warps, hence kernels with barriers need a thread count that is a multiple of 32). Warp
  shuffles of lowered allreduces stay correct: the active threads are ``tid < kernel.threads``,
  the same lanes that exist in a launch of ``kernel.threads`` threads (a partial last warp
  included), and the masks come from ``__activemask()`` inside the early-exit branch, which names
  exactly those lanes; the vEU's other lanes wait at the ``__syncthreads`` after the rTask;
* every shared allocation ("shared" or "shared.dyn") turned into a typed view at a 16-byte aligned
  offset of one ``uint8`` pool that the persistent kernel allocates once (sized to its largest rTask;
  dynamic shared memory when that exceeds the 48 KB of static shared memory), accesses shifted by
  the offset exactly like TVM's ``MergeSharedMemoryAllocations`` does;
* the pool touched once as uint8 so TVM's StorageRewrite, which runs again over the persistent
  kernel, cannot retype it to the views' element type (see ``_keep_pool_bytes``);
* every Var defined inside (loop vars, lets, buffers) renamed to a fresh Var, so one persistent
  PrimFunc can hold several instantiations and still pass TVM's well-formedness check.

The result is wrapped in ``AttrStmt(..., "hand_threaded", ...)``: the persistent kernel is lowered
by the full s_tir pipeline again, and its ``ThreadSync`` pass skips hand-threaded regions, which
is what we want since ``prelower`` already placed this body's barriers (ThreadSync would also
refuse or misplace syncs under the early-exit condition).
"""
import tvm
import tvm_ffi
from tvm import tirx
from tvm.backend.cuda.op import cuda_func_call
from tvm.tirx.buffer import buffer_data, is_buffer_var

from .prelower import BLOCK_AXES, SHARED_SCOPES, THREAD_AXES, LoweredKernel, UnsupportedKernel, aligned_bytes

NAMED_BARRIER = "rammer_named_barrier"
# RAMMER_EMULATE: the CPU emulator's named barrier (tvm_rammer/checks/emulator), reporting the caller's line
NAMED_BARRIER_SOURCE = f"""
#ifdef RAMMER_EMULATE
__device__ __forceinline__ void {NAMED_BARRIER}(int id, int nthreads, int line = __builtin_LINE()) {{
  ::rammer_emu::bar_sync(id, nthreads, line);
}}
#else
__device__ __forceinline__ void {NAMED_BARRIER}(int id, int nthreads) {{
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(nthreads) : "memory");
}}
#endif
"""
WARP_SIZE = 32
_SYNC_OP = tvm.ir.Op.get("tirx.tvm_storage_sync")
_ACCESS_PTR_OP = tvm.ir.Op.get("tirx.tvm_access_ptr")


def _dtype(expr) -> str:
    return str(expr.ty.dtype)


def _as(dtype: str, expr):
    """``expr`` cast to ``dtype`` when it is not already of that type."""
    if isinstance(expr, int):
        return tirx.IntImm(dtype, expr)
    return expr if _dtype(expr) == dtype else tirx.Cast(dtype, expr)


def _fresh(var):
    """A new Var of the same name and type (a new buffer Var for buffer Vars)."""
    if is_buffer_var(var):
        return tirx._ffi_api.BufferVar(var.name, var.ty, None)  # pylint: disable=protected-access
    return tvm.ir.Var(var.name, var.ty)


def _defined_vars(body) -> list:
    """Every Var that ``body`` defines: loop, let/bind and allocated/declared buffer Vars."""
    found = []
    tvm_ffi.structural_walk(body, [
        (tirx.For, lambda n: found.append(n.loop_var)),
        ((tirx.Bind, tirx.LetStmt), lambda n: found.append(n.var)),
        (tirx.Let, lambda n: found.append(n.var)),
        ((tirx.AllocBuffer, tirx.DeclBuffer), lambda n: found.append(n.buffer)),
    ])
    return found


def _index_split(index, extents):
    """Decompose a linear ``index`` into len(extents) coordinates, the first varying fastest."""
    coords, stride = [], 1
    for i, ext in enumerate(extents):
        coord = index if stride == 1 else tirx.floordiv(index, stride)
        outer = 1
        for later in extents[i + 1:]:
            outer *= later
        coords.append(coord if outer == 1 else tirx.floormod(coord, ext))
        stride *= ext
    return coords


def _axis_binds(vars_by_tag: dict, tags, extents, index, rename: dict) -> list:
    """``Bind`` statements giving each present axis Var its coordinate of ``index``."""
    binds = []
    for tag, coord in zip(tags, _index_split(index, extents)):
        if tag in vars_by_tag:
            var = vars_by_tag[tag]
            binds.append(tirx.Bind(rename[var], _as(_dtype(var), coord)))
    return binds


def _check_args(kernel: LoweredKernel, data_vars, veu_threads: int, smem_pool) -> None:
    """Reject argument combinations that would produce wrong or deadlocking code."""
    if len(data_vars) != len(kernel.params):
        raise ValueError(f"{kernel.name}: {len(kernel.params)} data vars expected, got {len(data_vars)}")
    for param, var in zip(kernel.params, data_vars):
        if not is_buffer_var(var) or var.dtype != param.dtype:
            raise TypeError(f"{kernel.name}: data var {var} must be a {param.dtype} buffer Var like {param.name}")
    if veu_threads < kernel.threads:
        raise ValueError(f"{kernel.name}: needs {kernel.threads} threads but the vEU has {veu_threads}")
    if smem_pool is not None:
        if not is_buffer_var(smem_pool) or smem_pool.scope() not in SHARED_SCOPES:
            raise TypeError(f"smem_pool must be a uint8 buffer Var in 'shared' or 'shared.dyn' scope, got {smem_pool}")
        if aligned_bytes(smem_pool) < kernel.shared_bytes:
            raise ValueError(f"{kernel.name}: shared pool smaller than the {kernel.shared_bytes} bytes it needs")


def _check_early_exit(kernel: LoweredKernel, veu_threads: int) -> None:
    """Early exit with a partial warp cannot use ``bar.sync`` (it counts whole warps). Warp
    shuffles are fine: the active lanes are those of a ``kernel.threads``-thread launch."""
    if kernel.threads == veu_threads or kernel.threads % WARP_SIZE == 0:
        return
    if kernel.has_sync:
        raise UnsupportedKernel(f"{kernel.name}: {kernel.threads} threads is not a multiple of {WARP_SIZE}; "
                                f"a named barrier over them is impossible (vEU has {veu_threads} threads)")


def early_exit_problem(kernel: LoweredKernel, veu_threads: int):
    """Why ``kernel`` cannot run in a vEU of ``veu_threads`` threads, or None when it can."""
    try:
        _check_early_exit(kernel, veu_threads)
    except UnsupportedKernel as err:
        return str(err)
    return None


def _pool_offsets(body) -> dict:
    """{shared buffer Var: byte offset in the pool}, each 16-byte aligned, in allocation order
    (static and dynamic shared buffers alike: the pool serves both)."""
    offsets, offset = {}, 0
    allocs, decls = [], []
    tvm_ffi.structural_walk(body, (tirx.AllocBuffer, allocs.append))
    tvm_ffi.structural_walk(body, (tirx.DeclBuffer, decls.append))
    for alloc in allocs:
        if alloc.buffer.scope() in SHARED_SCOPES:
            offsets[alloc.buffer] = offset
            offset += aligned_bytes(alloc.buffer)
    # views StorageRewrite declares on a shared allocation (another dtype or shape on the same
    # memory, e.g. the accumulator tile reusing an operand tile) live at that allocation's offset
    for decl in decls:
        data = decl.data
        base = data.args[0] if isinstance(data, tvm.ir.Call) and len(data.args) == 1 else None
        if base is not None and base in offsets and decl.buffer not in offsets:
            offsets[decl.buffer] = offsets[base]
    return offsets


def _shift(index, elems: int):
    """``index + elems`` for a scalar or Ramp index."""
    if elems == 0:
        return index
    if isinstance(index, tirx.Ramp):
        return tirx.Ramp(index.base + elems, index.stride, index.lanes)
    return index + _as(_dtype(index), elems)


def _into_pool(body, pool):
    """Shared AllocBuffers become views of ``pool`` (DeclBuffer on its data); accesses shifted.

    This is MergeSharedMemoryAllocations' pattern. Views on ``&pool[offset]`` would need no
    index shift, but TVM 0.27's StorageRewrite does not remap a DeclBuffer's data expression
    unless it is exactly ``buffer_data(pool)`` and then fails ("occurred before its declaration").
    """
    offsets = _pool_offsets(body)
    if not offsets:
        return body
    pool_ptr = buffer_data(pool)

    def elems(buf) -> int:
        itemsize = tvm.DataType(str(buf.dtype)).itemsize
        assert offsets[buf] % itemsize == 0, (buf, offsets[buf])
        return offsets[buf] // itemsize

    def alloc(node):
        return tirx.DeclBuffer(node.buffer, data=pool_ptr) if node.buffer in offsets else node

    def load(node):
        if node.source not in offsets:
            return node
        return tirx.BufferLoad(node.source, [_shift(node.indices[0], elems(node.source))])

    def store(node):
        if node.buffer not in offsets:
            return node
        return tirx.BufferStore(node.buffer, node.value, [_shift(node.indices[0], elems(node.buffer))])

    def cp_async(call):
        # cp_async_raw(dst.data, dst_offset, src.data, src_offset, size[, predicate]): TVM's code
        # generation scales dst_offset by the element size of dst's data, which is the uint8 pool's
        # here; the offset becomes bytes, shifted to the view's place in the pool
        dst, off = call.args[0], call.args[1]
        buf = dst.args[0] if isinstance(dst, tvm.ir.Call) and len(dst.args) == 1 else None
        if buf is None or buf not in offsets:
            return call
        itemsize = tvm.DataType(str(buf.dtype)).itemsize
        byte_off = off * _as(_dtype(off), itemsize) + _as(_dtype(off), offsets[buf])
        return tvm.ir.Call(call.op, [dst, byte_off, *call.args[2:]], call.attrs, call.ty_args, call.span,
                           ret_ty=call.ty)

    def call_(call):
        return cp_async(call) if call.op.same_as(_CP_ASYNC_OP) else access_ptr(call)

    def access_ptr(call):
        # tvm_access_ptr(T, view, offset, ...) -> &view[offset + shift]: the address LowerIntrin would
        # make of it, but through the view, so that the pool's element type does not matter (an
        # access_ptr is checked against the type of the buffer it resolves to: the uint8 pool)
        buf = _access_ptr_buffer(call)
        if buf is None or buf not in offsets:
            return call
        if _dtype(call.args[0]) != str(buf.dtype):
            raise UnsupportedKernel(f"tvm_access_ptr of {_dtype(call.args[0])} into the {buf.dtype} buffer {buf.name}")
        return tirx.address_of(tirx.BufferLoad(buf, [_shift(call.args[2], elems(buf))]))

    return tvm_ffi.structural_map(body, [
        (tirx.AllocBuffer, alloc), (tvm.ir.TensorLoad, load), (tirx.BufferStore, store), (tvm.ir.Call, call_),
    ])


def _keep_pool_bytes(pool, body):
    """Pin the pool's uint8 element type through StorageRewrite (see module docstring).

    StorageRewrite's pointer-type rewrite retypes an allocation whose accesses (views included)
    all share one element type T, keeping the element count: a uint8[n] pool seen only through
    float32 views becomes float32[n], 4x the shared memory. One uint8 access (an address taken
    and discarded, removed later by RemoveNoOp) makes the access types mixed: the pool stays uint8.
    """
    anchor = tirx.address_of(tirx.BufferLoad(pool, [tirx.const(0, "int32")]))
    return _seq([tirx.Evaluate(anchor), body])


_CP_ASYNC_OP = tvm.ir.Op.get("tirx.s_tir.cp_async_raw")


def _access_ptr_buffer(call):
    """The buffer Var a ``tvm_access_ptr`` call addresses, else None."""
    if not call.op.same_as(_ACCESS_PTR_OP):
        return None
    src = call.args[1]
    return src.args[0] if isinstance(src, tvm.ir.Call) and len(src.args) == 1 else src


def _named_barriers(body, barrier_id: int, nthreads: int):
    """Block barriers become ``bar.sync barrier_id, nthreads`` over the active threads only."""

    def rewrite(call):
        if call.op.same_as(_SYNC_OP) and call.args[0].value in SHARED_SCOPES:
            return cuda_func_call(NAMED_BARRIER, tirx.const(barrier_id, "int32"), tirx.const(nthreads, "int32"),
                                  source_code=NAMED_BARRIER_SOURCE)
        return call

    return tvm_ffi.structural_map(body, (tvm.ir.Call, rewrite))


def _seq(stmts) -> tirx.Stmt:
    """Flattened SeqStmt (a single statement stays as is)."""
    flat = []
    for stmt in stmts:
        flat.extend(stmt.seq if isinstance(stmt, tirx.SeqStmt) else [stmt])
    return flat[0] if len(flat) == 1 else tirx.SeqStmt(flat)


def instantiate(kernel: LoweredKernel, data_vars, rtask_id, tid, veu_threads: int, smem_pool=None,
                barrier_id: int = 1) -> tirx.Stmt:
    """Statement running rTask ``rtask_id`` of ``kernel`` on the vEU thread ``tid`` (see module doc).

    ``data_vars[i]`` (a buffer Var of the persistent kernel) replaces ``kernel.params[i]``;
    ``smem_pool`` is a uint8 shared buffer Var of at least ``kernel.shared_bytes`` bytes (with
    ``None`` the shared allocations stay inside the statement, one static allocation per call).
    """
    _check_args(kernel, data_vars, veu_threads, smem_pool)
    _check_early_exit(kernel, veu_threads)
    early_exit = kernel.threads < veu_threads
    rename = {var: _fresh(var) for var in _defined_vars(kernel.body)}
    for var in list(kernel.block_vars.values()) + list(kernel.thread_vars.values()):
        rename[var] = _fresh(var)
    rename.update(zip(kernel.params, data_vars))
    body = tvm_ffi.structural_map(kernel.body, (tvm.ir.Var, lambda v: rename.get(v, v)))
    if smem_pool is not None and kernel.shared_bytes:
        body = _keep_pool_bytes(smem_pool, _into_pool(body, smem_pool))
    if early_exit and kernel.has_sync:
        body = _named_barriers(body, barrier_id, kernel.threads)
    threads = _axis_binds(kernel.thread_vars, THREAD_AXES, kernel.block, tid, rename)
    body = _seq(threads + [body])
    if early_exit:
        body = tirx.IfThenElse(tid < _as(_dtype(tid), kernel.threads), body, None)
    blocks = _axis_binds(kernel.block_vars, BLOCK_AXES, kernel.grid, rtask_id, rename)
    return tirx.AttrStmt(tirx.const(0, "int32"), "hand_threaded", 0, _seq(blocks + [body]))
