"""Rebase an instantiated rTask's tensor onto a byte arena at a (possibly run-time) element offset.

Operators that share one rKernel (TVM gives identical operators one PrimFunc) share one kernel body
in the persistent kernel when the tensors that differ between them live in an arena: the
rProgram's intermediate tensors in one uint8 work buffer, its constant weights in one uint8 blob.
The body then reads ``arena_view[offset + i]`` where ``offset`` comes from the program table.

Pattern as in ``rtask_rewrite._into_pool`` (TVM's MergeSharedMemoryAllocations): the flat views
that prelower's FlattenBuffer declared on the parameter (``DeclBuffer(flat, data=buffer_data(p))``)
are re-declared on the arena's data and every access through them is shifted.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx
from tvm.tirx.buffer import buffer_data

_ACCESS_PTR_OP = tvm.ir.Op.get("tirx.tvm_access_ptr")


def _points_at(data, buf) -> bool:
    """Whether ``data`` is ``buffer_data(buf)``."""
    return isinstance(data, tvm.ir.Call) and len(data.args) == 1 and data.args[0].same_as(buf)


def _like(expr, offset):
    dtype = str(expr.ty.dtype)
    return offset if str(offset.ty.dtype) == dtype else tirx.Cast(dtype, offset)


def _shift(index, offset):
    """``index + offset`` for a scalar, Ramp or other vector index."""
    if isinstance(index, tirx.Ramp):
        return tirx.Ramp(index.base + _like(index.base, offset), index.stride, index.lanes)
    dtype = tvm.DataType(str(index.ty.dtype))
    if dtype.lanes > 1:  # e.g. a gathered vector of indices: add the offset to every lane
        scalar = str(dtype.with_lanes(1))
        lane = offset if str(offset.ty.dtype) == scalar else tirx.Cast(scalar, offset)
        return index + tirx.Broadcast(lane, dtype.lanes)
    return index + _like(index, offset)


def rebase(stmt, placeholder, arena, offset) -> tirx.Stmt:
    """``stmt`` with every access to ``placeholder`` (a parameter buffer Var) moved to ``arena``
    (a uint8 buffer Var) at element offset ``offset`` (int32 PrimExpr, in the placeholder's dtype).

    Raises ValueError when ``placeholder`` is accessed other than through flat views.
    """
    views = set()

    def decl(node):
        if _points_at(node.data, placeholder):
            views.add(node.buffer)
            return tirx.DeclBuffer(node.buffer, data=buffer_data(arena))
        return node

    stmt = tvm_ffi.structural_map(stmt, (tirx.DeclBuffer, decl))

    direct = []

    def on_load(node):
        if node.source.same_as(placeholder):
            direct.append(node)

    def on_store(node):
        if node.buffer.same_as(placeholder):
            direct.append(node)

    tvm_ffi.structural_walk(stmt, [(tvm.ir.TensorLoad, on_load), (tirx.BufferStore, on_store)])
    if direct:
        raise ValueError(f"{placeholder.name} is accessed without a flat view; cannot rebase it")

    def load(node):
        if node.source not in views:
            return node
        return tirx.BufferLoad(node.source, [_shift(node.indices[0], offset)])

    def store(node):
        if node.buffer not in views:
            return node
        return tirx.BufferStore(node.buffer, node.value, [_shift(node.indices[0], offset)])

    def access_ptr(call):
        if not call.op.same_as(_ACCESS_PTR_OP):
            return call
        src = call.args[1]
        buf = src.args[0] if isinstance(src, tvm.ir.Call) and len(src.args) == 1 else src
        if buf not in views:
            return call
        args = list(call.args)
        args[2] = _shift(args[2], offset)
        return tvm.ir.Call(call.op, args, call.attrs, call.ty_args, call.span, ret_ty=call.ty)

    return tvm_ffi.structural_map(stmt, [(tvm.ir.TensorLoad, load), (tirx.BufferStore, store),
                                         (tvm.ir.Call, access_ptr)])
