"""Early exit on AMDGPU: surplus threads skip the work of an rTask, never its barriers.

A vEU is as wide as its widest rTask; a narrower rTask leaves threads with nothing to do (paper
4.1.3, "early exit"). On CUDA (``tir_templates.rtask_rewrite``) the surplus threads skip the whole
body and the rTask's barriers become named barriers ``bar.sync id, n`` over the active threads. CDNA
has no named barriers: ``s_barrier`` waits for every wave of the workgroup, so a wave that skipped
the body would deadlock the others. Two designs were possible:

1. the vEU as wide as the rTask, rounded to whole waves: impossible, the vEU is one workgroup
   for every rTask of the rProgram, and their widths differ;
2. **every thread executes the rTask's barriers, the surplus threads skip only the work**
   (chosen). The body's statements that hold no barrier are guarded by ``tid < kernel.threads``;
   the statements that hold one (loops, uniform conditions, sequences) are kept and the guard
   pushed into them, so every wave reaches the same barriers in the same order. This needs the
   control flow around a barrier to be thread-invariant, which TVM's ThreadSync already demands of
   the kernel ("Cannot insert syncs inside condition"); a kernel where it is not raises
   ``UnsupportedKernel`` naming the statement.

Within a wave, lanes past ``kernel.threads`` are masked off by the guard exactly as a launch of
``kernel.threads`` threads masks off a partial last wave, so cross-lane operations of lowered
allreduces (``ds_bpermute``, DPP) see the same active lanes as in the kernel's own launch. Values
a barrier-holding statement needs (``Bind``) are still computed by every thread: arithmetic on the
surplus threads' out-of-range thread indices is harmless, a load is guarded
(``if_then_else(active, load, 0)``, lazily evaluated by TVM's LLVM codegen).

Input: the statement ``tir_templates.rtask_rewrite.instantiate`` returns for a vEU exactly as wide
as the kernel (no early exit, no named barriers); output: the same statement for a wider vEU.

Each instantiation also reads its own copy of the thread index through ``rammer_opaque_tid`` (an
empty volatile asm): otherwise LLVM hoists every body's thread-derived addresses out of the vEU's
instruction loop and keeps them all live at once (reduced AlexNet's persistent kernel: 440 VGPRs,
294 with the opaque copy; its rKernels alone use at most 106), and every thread clears each of the
body's thread-local arrays where it is declared (:func:`cleared_locals`): otherwise every body's
accumulators are carried around the instruction loop (reduced SqueezeNet: 512 VGPRs and 956 B of
scratch, 203 VGPRs and none with the clearing).
"""

from __future__ import annotations

import itertools
import math

import tvm
import tvm_ffi
from tvm import tirx

from tir_templates.prelower import SHARED_SCOPES, UnsupportedKernel

from .helpers import OPAQUE_TID_NAME

_SYNC_OP = tvm.ir.Op.get("tirx.tvm_storage_sync")
_DECLARATIONS = (tirx.Bind, tirx.DeclBuffer, tirx.AllocBuffer)
_LOAD = tvm.ir.expr.TensorLoad  # the class tirx.BufferLoad(...) builds
MAX_CLEARED_ELEMENTS = 512  # a larger local array does not fit in registers anyway


def is_block_barrier(expr) -> bool:
    """Whether ``expr`` is ``tvm_storage_sync("shared")`` (a workgroup barrier)."""
    return (isinstance(expr, tvm.ir.Call) and expr.op.same_as(_SYNC_OP)
            and expr.args[0].value in SHARED_SCOPES)


def has_barrier(node) -> bool:
    """Whether a statement or expression contains a workgroup barrier."""
    found = []

    def visit(call):
        if is_block_barrier(call):
            found.append(call)

    tvm_ffi.structural_walk(node, (tvm.ir.Call, visit))
    return bool(found)


def _uses(expr, variant: set) -> bool:
    """Whether ``expr`` reads a thread-variant Var or memory (conservatively variant)."""
    hits = []

    def var(v):
        if v in variant:
            hits.append(v)

    def load(node):
        hits.append(node)

    tvm_ffi.structural_walk(expr, [(tvm.ir.Var, var), (_LOAD, load)])
    return bool(hits)


def _zero(dtype: str):
    return tirx.const(0, dtype) if not dtype.startswith("handle") else tirx.const(0, "int64")


class _Guard:
    """Pushes ``active`` (``tid < n``) into a statement down to its barrier-free parts."""

    def __init__(self, tid, active, name: str):
        self.variant = {tid}
        self.active = active
        self.name = name

    def stmt(self, node):
        if not has_barrier(node):
            return tirx.IfThenElse(self.active, node, None)
        if isinstance(node, tirx.Evaluate) and is_block_barrier(node.value):
            return node
        if isinstance(node, tirx.SeqStmt):
            return self.seq(list(node.seq))
        if isinstance(node, tirx.AttrStmt):
            return tirx.AttrStmt(node.node, node.attr_key, node.value, self.stmt(node.body))
        if isinstance(node, tirx.For):
            self._invariant(node.min, "a loop around a barrier starts")
            self._invariant(node.extent, "a loop around a barrier runs")
            return tirx.For(node.loop_var, node.min, node.extent, node.kind, self.stmt(node.body),
                            node.thread_binding, node.annotations, node.step)
        if isinstance(node, tirx.IfThenElse):
            self._invariant(node.condition, "a condition around a barrier")
            other = None if node.else_case is None else self.stmt(node.else_case)
            return tirx.IfThenElse(node.condition, self.stmt(node.then_case), other)
        if isinstance(node, tirx.While):
            self._invariant(node.condition, "a while loop around a barrier")
            return tirx.While(node.condition, self.stmt(node.body))
        raise UnsupportedKernel(f"{self.name}: a barrier inside {type(node).__name__} cannot be "
                                "reached by the surplus threads of a wider vEU")

    def seq(self, items):
        """Declarations stay in the sequence (they scope what follows); each run of barrier-free
        statements between them becomes one guarded block."""
        out, run = [], []

        def flush():
            if run:
                out.append(tirx.IfThenElse(self.active, _seq(run), None))
                run.clear()

        for item in items:
            if isinstance(item, _DECLARATIONS):
                flush()
                out.append(self.declaration(item))
            elif has_barrier(item):
                flush()
                out.append(self.stmt(item))
            else:
                run.append(item)
        flush()
        return _seq(out)

    def declaration(self, item):
        if not isinstance(item, tirx.Bind):
            return item
        if _uses(item.value, self.variant):
            self.variant.add(item.var)
            if _has_load(item.value):  # a load at a surplus thread's index may be out of bounds
                dtype = str(item.var.ty.dtype)
                return tirx.Bind(item.var, tirx.if_then_else(self.active, item.value,
                                                             _zero(dtype)))
        return item

    def _invariant(self, expr, what: str):
        if _uses(expr, self.variant):
            raise UnsupportedKernel(f"{self.name}: {what} depends on the thread ({expr}); the "
                                    "surplus threads of a wider vEU could not follow it")


def _has_load(expr) -> bool:
    hits = []
    tvm_ffi.structural_walk(expr, (_LOAD, hits.append))
    return bool(hits)


def _seq(stmts):
    flat = []
    for stmt in stmts:
        flat.extend(stmt.seq if isinstance(stmt, tirx.SeqStmt) else [stmt])
    return flat[0] if len(flat) == 1 else tirx.SeqStmt(flat)


def guard_work(stmt, tid, threads: int, name: str = "kernel"):
    """``stmt`` (one rTask for ``threads`` threads) for a vEU where ``tid >= threads`` exist: their
    work skipped, every barrier kept (module docstring). Raises ``UnsupportedKernel`` when a
    barrier sits under thread-dependent control flow."""
    active = tid < tirx.const(threads, str(tid.ty.dtype))
    return _Guard(tid, active, name).stmt(stmt)


def instantiate(default, kernel, data_vars, rtask_id, tid, veu_threads: int, smem_pool=None,
                barrier_id: int = 1):  # pylint: disable=unused-argument
    """``tir_templates.rtask_rewrite.instantiate`` (``default``) with AMDGPU's early exit: the
    body built for exactly ``kernel.threads`` threads, then :func:`guard_work` for the rest of
    the vEU. ``barrier_id`` is unused (no named barriers)."""
    if veu_threads < kernel.threads:
        raise ValueError(f"{kernel.name}: needs {kernel.threads} threads but the vEU has "
                         f"{veu_threads}")
    here = tirx.Var("tid_in_rtask", str(tid.ty.dtype))
    stmt = default(kernel, data_vars, rtask_id, here, kernel.threads, smem_pool)
    if kernel.threads < veu_threads:
        stmt = guard_work(stmt, here, kernel.threads, kernel.name)
    # the body's own copy of the thread index, opaque to LLVM (helpers.OPAQUE_TID_NAME): what
    # the body derives from it stays in the body instead of being hoisted out of the vEU's loop
    return _seq([tirx.Bind(here, tirx.call_extern(str(tid.ty.dtype), OPAQUE_TID_NAME, tid)),
                 cleared_locals(stmt)])


def _local_zero(buf):
    """Stores of zero into every element of the thread-local buffer ``buf`` (row-major order),
    or None when its shape is not constant or it is too large to live in registers."""
    if not all(isinstance(extent, tirx.IntImm) for extent in buf.shape):
        return None
    shape = [int(extent.value) for extent in buf.shape]
    if not 0 < math.prod(shape) <= MAX_CLEARED_ELEMENTS:
        return None
    dtype = tvm.DataType(str(buf.dtype))
    scalar = tirx.const(0, str(dtype.with_lanes(1)))
    zero = scalar if dtype.lanes == 1 else tirx.Broadcast(scalar, dtype.lanes)
    return [tirx.BufferStore(buf, zero, [tirx.const(i, "int32") for i in index])
            for index in itertools.product(*map(range, shape))]


def cleared_locals(stmt):
    """``stmt`` with every thread-local array (``alloc_local``) set to zero right where it is
    declared, by every thread, before any (guarded) use.

    TVM's LLVM codegen places each such array's ``alloca`` in the kernel's entry block, so in the
    persistent kernel it lives across the vEU's whole instruction loop; a body that initialises it
    only under a condition (early exit's ``tid < n``, a kernel's own bounds checks) leaves LLVM
    the previous iteration's contents as a possible value: after register promotion every body's
    accumulators become loop-carried values, live through every other body at once (reduced
    SqueezeNet's first rProgram: 18 conv accumulators of 16 floats plus 8 vectors of 16, 512 VGPRs
    and 956 B of scratch). Cleared unconditionally, the incoming value is dead on every path and
    LLVM drops the loop-carried copies: each array is live only inside its own body."""

    def visit(seq):
        items, changed = [], False
        for item in seq.seq:
            items.append(item)
            if isinstance(item, tirx.AllocBuffer) and item.buffer.scope() == "local":
                stores = _local_zero(item.buffer)
                if stores:
                    items.extend(stores)
                    changed = True
        return tirx.SeqStmt(items) if changed else seq

    return tvm_ffi.structural_map(stmt, (tirx.SeqStmt, visit))
