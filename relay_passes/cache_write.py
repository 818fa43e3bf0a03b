"""CacheSlotWrite: a scatter into a cache at one slot along an axis -> one injective kernel.

A static KV cache's update (an exported ``cache[:, :, p] = new``: ONNX ScatterND with indices
``(b, h, p)``; or ``cache.index_copy_(2, p, new)``: ScatterElements on axis 2) is legalized by TVM
into two kernels (the whole cache copied to the output, then the slots written), which have no
rTask decomposition and so split every decoder layer's rPrograms. Here it becomes ONE injective
PrimFunc over the cache's shape::

    out[x] = updates[u(x)] if norm(indices[i(x)]) == x[axis] else data[x]

(``norm``: a negative index plus the axis' extent), which dlight schedules as one kernel and the
back end places as rTasks like any elementwise operator; the whole cache is read and written. With
``inplace=True`` (the rammer pipeline's default, ``RammerConfig.inplace_cache``) a cache that is a
parameter nothing else reads is written in place instead, only the slot (:func:`slot_write_inplace`;
the back end places it in the rProgram and aliases its output to the caller's cache, DESIGN.md).

Input: Relax with high-level ops (run before LegalizeOps), static shapes. Rewritten, with ONNX's
semantics kept exactly (duplicates are impossible in both forms):

* ``scatter_nd(data, indices, updates)``, reduction "update", indices ``[D0, .., D(a-1), 1, a+1]``
  (or without the 1) whose components ``0 .. a-1`` are PROVEN to be the indices' own coordinates
  (``known_values``: constants, shapes and the frontend's negative-index arithmetic; the last
  component may depend on the inputs): each ``(d0 .. d(a-1))`` writes one slot along axis ``a``;
* ``scatter_elements(data, indices, updates, axis)``, reduction "update", indices and updates of
  data's shape except 1 along ``axis``: each element writes one slot along ``axis``.

Declined (left to TVM's legalization untouched): other reductions, other index shapes, leading
components not proven, symbolic shapes. Output: the same computation.
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, te, tirx

from .known_values import known_elements, static_shape

SCATTER_ND = tvm.ir.Op.get("relax.scatter_nd")
SCATTER_ELEMENTS = tvm.ir.Op.get("relax.scatter_elements")
SHAPE_OF = tvm.ir.Op.get("relax.shape_of")
CALL_TIR = tvm.ir.Op.get("relax.call_tir")
KERNEL_NAME = "cache_write"
BESIDE_WRITE_ATTR = "rammer.beside_write"  # [[cache param, indices param], ...] of a PrimFunc


def beside_write_params(func) -> list:
    """``[(cache, indices), ...]``: parameter positions at which a PrimFunc reads a cache beside
    a one-slot write of it at the slot its ``indices`` argument names, never reading that slot
    from the cache (its :data:`BESIDE_WRITE_ATTR`; ``decode_attention_row`` makes such readers):
    it computes the same before, during or after the write. [] for any other function."""
    attrs = getattr(func, "attrs", None)
    if attrs is None or BESIDE_WRITE_ATTR not in attrs:
        return []
    return [(int(c), int(i)) for c, i in attrs[BESIDE_WRITE_ATTR]]


def slot_write(data: te.Tensor, indices: te.Tensor, updates: te.Tensor, axis: int, nd: bool,
               kept_one: bool) -> te.Tensor:
    """The injective kernel (TE): ``data`` with one slot along ``axis`` replaced by ``updates``.
    ``nd``: ScatterND's indices (the slot is component ``axis`` of ``indices[x[:axis] (, 0)]``,
    ``kept_one``: the indices' batch dims end with a 1); else ScatterElements' (the slot is
    ``indices[x with x[axis] = 0]``)."""
    extent = data.shape[axis]

    def body(*x):
        int_t, idx_t = str(x[0].ty), str(indices.dtype)
        zero = tirx.const(0, int_t)
        if nd:
            lead = list(x[:axis]) + ([zero] if kept_one else [])
            index = indices[tuple(lead + [tirx.const(axis, int_t)])]
            update = updates[tuple(lead + list(x[axis + 1:]))]
        else:
            at = list(x)
            at[axis] = zero
            index = indices[tuple(at)]
            update = updates[tuple(at)]
        slot = tirx.Select(index < 0, index + extent.astype(idx_t), index)
        return tirx.Select(slot == x[axis].astype(idx_t), update, data[x])

    return te.compute(data.shape, body, name="T_cache_write")


def slot_write_inplace(data_ty, indices_ty, updates_ty, axis: int, nd: bool,
                       kept_one: bool) -> tirx.PrimFunc:
    """The in-place kernel: ``(data, indices, updates)`` -> nothing; for every element of
    ``updates`` (its rTasks cover the update, not the cache), ``data`` at the slot ``index``
    along ``axis`` (read as :func:`slot_write` reads it) is overwritten; an index out of
    ``[0, extent)`` writes nothing. ``indices`` must be normalized already (the pass emits
    :func:`normalized` of them): an index stored as it is read keeps the block's write region
    one element wide wherever TVM derives it again (FuseTIR, a schedule), where the negative-
    index ``Select`` would make it the hull ``[index, index + extent]`` (the cost model would
    charge the whole cache). For ``R.call_tir_inplace(..., inplace_indices=0)``."""
    from tvm.script.ir_builder import IRBuilder  # pylint: disable=import-outside-toplevel
    from tvm.script.ir_builder import tirx as T  # pylint: disable=import-outside-toplevel

    # int64 dims and loops, as TVM's legalized kernels have them: FuseTIR maps a producer's
    # output buffer onto ``updates`` only when both have the same type
    shapes = [[tirx.IntImm("int64", d) for d in static_shape(ty)]
              for ty in (data_ty, indices_ty, updates_ty)]
    extent = shapes[0][axis]
    with IRBuilder() as builder:
        with T.prim_func(private=True, s_tir=True):
            T.func_name(KERNEL_NAME + "_inplace")
            T.func_attr({"tirx.noalias": True})
            data, indices, updates = (
                T.arg(name, T.Buffer(shape, str(ty.dtype))) for name, shape, ty in
                zip(("data", "indices", "updates"), shapes, (data_ty, indices_ty, updates_ty)))
            with T.grid(*shapes[2]) as loops:
                with T.sblock("T_cache_write"):
                    v = [T.axis.spatial(e, loop) for e, loop in zip(shapes[2], loops)]
                    if nd:
                        lead = v[:axis + 1] if kept_one else v[:axis]
                        at = lead + [axis]
                        rest = v[axis + 1:] if kept_one else v[axis:]
                    else:
                        at, rest = v, v[axis + 1:]
                    slot = indices[tuple(at)].astype("int64")
                    target = v[:axis] + [slot] + rest
                    T.reads(indices[tuple(at)], updates[tuple(v)])
                    T.writes(data[tuple(target)])  # one element at a data-dependent slot
                    with T.If(tirx.all(slot >= 0, slot < extent)):
                        with T.Then():
                            T.buffer_store(data, updates[tuple(v)], target)
    return builder.get()


def normalized(indices: relax.Expr, extent: int) -> relax.Expr:
    """``where(indices < 0, indices + extent, indices)``: ONNX's negative indices made slots
    (only the slot component of ScatterND's is read by the in-place kernel)."""
    dtype = str(indices.ty.dtype)
    return relax.op.where(relax.op.less(indices, relax.const(0, dtype)),
                          relax.op.add(indices, relax.const(extent, dtype)), indices)


def match_slot_write(call: relax.Call, lookup) -> dict | None:
    """``slot_write``'s keyword arguments for a scatter call this pass rewrites, else None.
    ``lookup``: a dataflow variable's bound value (``PyExprMutator.lookup_binding``)."""
    if not isinstance(call.op, tvm.ir.Op) or len(call.args) != 3:
        return None
    if not (call.op.same_as(SCATTER_ND) or call.op.same_as(SCATTER_ELEMENTS)):
        return None
    if str(call.attrs.reduction) != "update":
        return None
    shapes = [static_shape(arg.ty) for arg in call.args]
    if any(s is None for s in shapes) or "int" not in str(call.args[1].ty.dtype):
        return None
    if call.op.same_as(SCATTER_ELEMENTS):
        return _match_elements(call, *shapes)
    return _match_nd(call, lookup, *shapes)


def _match_elements(call, data, indices, updates):
    axis = int(call.attrs.axis)
    axis = axis + len(data) if axis < 0 else axis
    expected = tuple(1 if j == axis else d for j, d in enumerate(data))
    if not 0 <= axis < len(data) or indices != expected or updates != expected:
        return None
    return {"axis": axis, "nd": False, "kept_one": False}


def _match_nd(call, lookup, data, indices, updates):
    if not indices:
        return None
    axis = indices[-1] - 1  # the last index component picks the slot along this axis
    batch = indices[:-1]
    if not 0 <= axis < len(data):
        return None
    kept_one = batch == data[:axis] + (1,)
    if not kept_one and batch != data[:axis]:
        return None
    if updates != batch + data[axis + 1:]:
        return None
    if axis and not _leading_are_coordinates(call.args[1], lookup, batch, data, axis):
        return None
    return {"axis": axis, "nd": True, "kept_one": kept_one}


def _leading_are_coordinates(indices, lookup, batch, data, axis):
    """True when ``indices[c, j] == c[j]`` (or ``c[j] - data[j]``) for every batch coordinate c
    and every component ``j < axis``, whatever the function's inputs."""
    found = known_elements(indices, lookup)
    if found is None:
        return False
    values, known = found
    coords = np.indices(batch)
    for j in range(axis):
        comp, want = values[..., j], coords[j]
        if not known[..., j].all() or not ((comp == want) | (comp == want - data[j])).all():
            return False
    return True


@relax.expr_functor.visitor
class _Uses(relax.PyExprVisitor):
    """How many times each variable is read in a function (its bindings' values, the body);
    ``shape_of`` reads no element and is not counted (the ONNX frontend takes the cache's shape
    for its negative-index arithmetic). A read by a ``call_tir`` of a PrimFunc that reads that
    argument beside a one-slot write (:func:`beside_write_params`) is counted,
    and also listed in ``beside[var]`` with the indices argument it names."""

    def __init__(self, mod=None):
        super().__init__()
        self.mod = mod
        self.count = {}
        self.beside = {}

    def visit_call_(self, call):
        if isinstance(call.op, tvm.ir.Op) and call.op.same_as(SHAPE_OF):
            return
        if call.op.same_as(CALL_TIR) and self.mod is not None \
                and isinstance(call.args[0], tvm.ir.GlobalVar) and call.args[0] in self.mod.functions \
                and isinstance(call.args[1], relax.Tuple):
            args = call.args[1].fields
            for cache, indices in beside_write_params(self.mod[call.args[0]]):
                self.beside.setdefault(args[cache], []).append(args[indices])
        super().visit_call_(call)

    def visit_var_(self, var):
        self.count[var] = self.count.get(var, 0) + 1

    def visit_dataflow_var_(self, var):
        self.count[var] = self.count.get(var, 0) + 1


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, mod, inplace):
        super().__init__(mod)
        self.inplace = inplace
        self.uses = {}
        self.beside = {}
        self.params = ()  # the current function's parameters: the only caches written in place

    def visit_call_(self, call):
        original = call
        call = super().visit_call_(call)
        spec = match_slot_write(call, self.lookup_binding)
        if spec is None:
            return call
        data = original.args[0]
        beside = self.beside.get(data, [])  # readers that never read the slot written
        if self.inplace and any(data.same_as(p) for p in self.params) \
                and self.uses.get(data) == 1 + len(beside) \
                and all(i.same_as(original.args[1]) for i in beside):
            func = slot_write_inplace(*(arg.ty for arg in call.args), **spec)
            gv = self.builder_.add_func(func, KERNEL_NAME + "_inplace")
            extent = static_shape(call.args[0].ty)[spec["axis"]]
            indices = self.builder_.emit(normalized(call.args[1], extent))
            args = [call.args[0], indices, call.args[2]]
            return relax.op.call_tir_inplace(gv, relax.Tuple(args), [0], call.ty)
        return self.builder_.call_te(slot_write, *call.args, primfunc_name_hint=KERNEL_NAME,
                                     **spec)


@tvm.transform.module_pass(opt_level=0, name="CacheSlotWrite")
class CacheSlotWrite:
    """Replace one-slot cache scatters in every Relax function by one PrimFunc: the injective
    copy-and-select kernel (the default here; the rammer pipeline's with ``inplace_cache=False``), or with
    ``inplace=True`` ``R.call_tir_inplace`` of :func:`slot_write_inplace` (only the slot
    written, the output aliasing the cache: the caller's buffer) where the cache is a parameter
    of the function that nothing else reads; elsewhere the injective kernel. Only a parameter: a
    variable bound in the function may be a view of another tensor (``reshape`` is one in the VM)
    that is read elsewhere, which writing in place would change."""

    def __init__(self, inplace: bool = False):
        self.inplace = inplace

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod, self.inplace)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                uses = _Uses(mod)
                uses.visit_expr(func)
                rewriter.uses, rewriter.params = uses.count, tuple(func.params)
                rewriter.beside = uses.beside
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()
