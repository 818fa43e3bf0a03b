"""DecodeAttentionStepRow: the decode attention reads the step's own q, k and v from the projection's
row, and the KV caches beside their writes, so it waits for the projection only.

After ``DecodeAttentionSplit`` a GPT-2-style layer is, per step (one token)::

    row  = x @ W_qkv + b                                   [B, 1, N]
    q, k, v = split(row, axis=-1)   (or strided_slice)     one token's heads, each [B, 1, H * D]
    q4   = permute_dims(reshape(q, [B, 1, H, D]), [0, 2, 1, 3])        (same for k4, v4)
    K    = scatter_nd(Kc, kidx, k4)                         Kc a parameter: the cache, slot p
    V    = scatter_nd(Vc, vidx, v4)
    part = call_tir(decode_attention_partial, [q4, K, V, pos])

(Llama: three projections, each row ``[B, 1, H * D]`` of its own, and q4, k4 rotated first,
HF's ``x * cos + cat(-x[.., D/2:], x[.., :D/2]) * sin``), so the partial waits for the cache
writes, which wait for the row (and the rotation): one dependent step (and a barrier-rTask) more
per layer than the data needs. Here the partial becomes ``call_tir(partial', [qrow, Kc, Vc, pos,
krow, kidx, vrow, vidx(, cos, sin)])`` (``tir_templates.decode_attention``'s ``q_row`` /
``k_row`` / ``v_row`` / ``rope_rank``; GPT-2 passes its one row three times): it reads q from its
row (rotating it), the caches as they were, and at the slot each write stores (``kidx``'s,
normalized as the write normalizes it) the row's k (rotated) / v instead. The writes stay (they
are ``main``'s results) but nothing waits for them; ``CacheSlotWrite`` still writes in place: the
partial's PrimFunc declares the caches it reads beside a write (``cache_write.BESIDE_WRITE_ATTR``),
which it and ``DataflowGraph`` accept as the cache's one other reader. Whether the partial runs
before, after or beside a write, it computes the same: the one slot that changes is never read
from the cache. The partial rotates in float32 where the graph rounds each step to its dtype (the
written cache keeps the graph's rounding): results differ by rounding only.

What is proven, each piece from the graph:

* a view: ``x`` [B, h, 1, D] is ``permute_dims(reshape(part, [B, 1, h, D]), [0, 2, 1, 3])`` or
  ``reshape(part, [B, h, 1, D])`` of ``part`` [B, 1, h * D], which is item ``i`` of a ``split`` of
  a row [B, 1, N] along its last axis or a ``strided_slice`` of it on that axis (step 1), or the
  row itself: element ``(b, j, 0, d)`` is ``row[b, 0, offset + j * D + d]`` (one token: the axes
  of length 1 move, the elements keep their order);
* a rotation: ``add(multiply(x, cos), multiply(concat([negative(x[.., D/2:D]), x[.., 0:D/2]],
  axis=-1), sin))`` (any operand order of the adds and multiplies; the halves ``strided_slice``s
  of the same view ``x`` on its last axis), cos and sin ``[1, .., 1, D]`` tensors of one float
  dtype (any producer: the tables gathered at the position);
* a cache write: ``scatter_nd(Kc, kidx, k4)`` that ``CacheSlotWrite`` makes a one-slot write along
  axis 2 (``match_slot_write``: indices ``[B, Hkv, 1, 3]`` or ``[B, Hkv, 3]``, components 0 and 1
  proven to be (b, kv head)), ``Kc`` a parameter of the function, ``k4`` a view of a row or its
  rotation, ``v4`` a view (never rotated), of the cache's dtype, no cast between;
* q a view of a row (GPT-2), or rotated by the same cos and sin tensors as k (Llama); where k is
  not rotated and q is, or q is no view, q stays the graph's tensor (k rotated, q not: declined).

A GQA repeat of the written cache is no obstacle: ``DecodeAttentionSplit`` already hands the
partial the repeat's source (the scatter), and the rows' k / v hold the kv heads (head h reads kv
head ``h // (H / Hkv)``, at ``k_off + (h // (H / Hkv)) * D``). Declined (the call left as it is):
anything else, e.g. a ScatterElements write, casts inside the views or the rotation. Input: Relax
with high-level ops, after ``DecodeAttentionSplit``, before ``SplitToSlices`` and
``CacheSlotWrite``. Output: the same computation.
"""
from __future__ import annotations

import dataclasses

import tvm
from tvm import relax

from tir_templates.decode_attention import WRITTEN_CACHE_PARAMS, made_here, partial_func

from .cache_write import BESIDE_WRITE_ATTR, match_slot_write
from .decode_attention import without_uncalled
from .known_values import int_values as _ints
from .known_values import is_op as _is_op
from .known_values import static_dims as _shape
from .unused_bindings import remove_unused_bindings

__all__ = ["DecodeAttentionStepRow"]

_CALL_TIR = tvm.ir.Op.get("relax.call_tir")


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Rewrites every partial call that reads views of one row through its caches' writes."""

    def __init__(self, mod, params=()):
        super().__init__(mod)
        self.mod = mod
        self.params = params
        self.rewrites = 0

    def _bound(self, expr, name):
        if not isinstance(expr, relax.Var):
            return None
        value = self.lookup_binding(expr)
        return value if _is_op(value, name) else None

    def _part_of_row(self, part, width):
        """(row, offset) when ``part`` [B, 1, width] is a split item or a slice of a row [B, 1,
        N] along its last axis; else None (then ``part`` is a row of its own: Llama's separate
        q, k, v projections)."""
        value = self.lookup_binding(part) if isinstance(part, relax.Var) else None
        if isinstance(value, relax.TupleGetItem):
            split = self._bound(value.tuple_value, "split")
            if split is None:
                return None
            row = split.args[0]
            shape = _shape(row)
            if shape is None or len(shape) != 3 or int(split.attrs.axis) not in (2, -1):
                return None
            sections = split.attrs.indices_or_sections
            if isinstance(sections, tvm.tirx.IntImm):
                n = int(sections)
                if n < 1 or shape[2] % n:
                    return None
                bounds = [shape[2] // n * j for j in range(n + 1)]
            else:
                cuts = _ints(sections)
                if cuts is None:
                    return None
                bounds = [0] + [min(max(c, 0), shape[2]) for c in cuts] + [shape[2]]
            j = int(value.index)
            if not 0 <= j < len(bounds) - 1 or bounds[j + 1] - bounds[j] != width:
                return None
            return row, bounds[j]
        if _is_op(value, "strided_slice") and len(value.args) in (4, 5):
            row = value.args[0]
            shape = _shape(row)
            axes, begin, end = (_ints(a) for a in value.args[1:4])
            strides = _ints(value.args[4]) if len(value.args) == 5 else [1]
            if shape is None or len(shape) != 3 or None in (axes, begin, end, strides) \
                    or len(axes) != 1 or axes[0] not in (2, -1) or strides != [1] \
                    or not 0 <= begin[0] < shape[2]:
                return None
            return (row, begin[0]) if min(end[0], shape[2]) - begin[0] == width else None
        return None

    def _view(self, x, heads, dim):
        """(row, offset) when ``x`` [B, heads, 1, dim] is one token's heads viewed from a row
        (module docstring); else None."""
        shape = _shape(x)
        if shape is None or len(shape) != 4 or shape[1:] != [heads, 1, dim]:
            return None
        batch = shape[0]
        perm = self._bound(x, "permute_dims")
        if perm is not None:
            if perm.attrs.axes is None or _ints(perm.attrs.axes) != [0, 2, 1, 3]:
                return None
            x, want = perm.args[0], [batch, 1, heads, dim]
        else:
            want = [batch, heads, 1, dim]
        reshape = self._bound(x, "reshape")
        if reshape is None or _shape(x) != want:
            return None
        part = reshape.args[0]
        if _shape(part) != [batch, 1, heads * dim] or part.ty.dtype != x.ty.dtype:
            return None
        return self._part_of_row(part, heads * dim) or (part, 0)  # else the row is the part

    def _half(self, expr, x, dim, low):
        """Whether ``expr`` is ``strided_slice(x, axes=[-1], begin, end)`` taking the low (or
        high) half of the head dim (step 1)."""
        value = self._bound(expr, "strided_slice")
        if value is None or not value.args[0].same_as(x) or len(value.args) not in (4, 5):
            return False
        axes, begin, end = (_ints(a) for a in value.args[1:4])
        strides = _ints(value.args[4]) if len(value.args) == 5 else [1]
        if None in (axes, begin, end, strides) or len(axes) != 1 or axes[0] not in (3, -1) \
                or strides != [1]:
            return False
        want = (0, dim // 2) if low else (dim // 2, dim)
        return (begin[0], min(end[0], dim)) == want

    def _rotary(self, expr, heads, dim):
        """(row, offset, cos, sin) when ``expr`` [B, heads, 1, dim] is HF's rotary embedding
        ``x * cos + cat(-x[.., D/2:], x[.., :D/2]) * sin`` (either operand order of each add and
        multiply) of a view ``x`` of a row (:meth:`_view`), cos and sin ``[1, .., 1, D]`` tensors
        of one float dtype; else None."""
        add = self._bound(expr, "add")
        if add is None or dim % 2:
            return None
        for first, second in (add.args, reversed(add.args)):
            plain, turned = self._bound(first, "multiply"), self._bound(second, "multiply")
            if plain is None or turned is None:
                continue
            for x, cos in (plain.args, reversed(plain.args)):
                view = self._view(x, heads, dim)
                if view is None:
                    continue
                for cat, sin in (turned.args, reversed(turned.args)):
                    concat = self._bound(cat, "concat")
                    if concat is None or int(concat.attrs.axis) not in (3, -1) \
                            or not isinstance(concat.args[0], relax.Tuple) \
                            or len(concat.args[0].fields) != 2:
                        continue
                    neg, low = concat.args[0].fields
                    negative = self._bound(neg, "negative")
                    if negative is None or not self._half(negative.args[0], x, dim, False) \
                            or not self._half(low, x, dim, True):
                        continue
                    tables = [_shape(cos), _shape(sin)]
                    if any(t is None or not 1 <= len(t) <= 4 or t[-1] != dim
                           or any(n != 1 for n in t[:-1]) for t in tables) \
                            or tables[0] != tables[1] or str(cos.ty.dtype) != str(sin.ty.dtype) \
                            or str(cos.ty.dtype) not in ("float32", "float16"):
                        continue
                    return view[0], view[1], cos, sin
        return None

    def _source(self, expr, heads, dim):
        """(row, offset, rope) of one token's heads: a view of a row (rope None) or its rotary
        embedding (rope ``(cos, sin)``); else None."""
        view = self._view(expr, heads, dim)
        if view is not None:
            return view[0], view[1], None
        rotary = self._rotary(expr, heads, dim)
        return None if rotary is None else (rotary[0], rotary[1], rotary[2:])

    def _write(self, cache, shape):
        """(cache parameter, indices, row, offset, idx rank, rope) when ``cache`` is a one-slot
        write along axis 2 of a parameter with a :meth:`_source` of a row; else None."""
        scatter = self._bound(cache, "scatter_nd")
        if scatter is None or not any(scatter.args[0].same_as(p) for p in self.params):
            return None
        spec = match_slot_write(scatter, self.lookup_binding)
        if spec is None or spec["axis"] != 2 or not spec["nd"]:
            return None
        indices = scatter.args[1]
        want = [shape.batch, shape.kv_heads] + ([1] if spec["kept_one"] else []) + [3]
        if _shape(indices) != want or str(indices.ty.dtype) not in ("int32", "int64"):
            return None
        source = self._source(scatter.args[2], shape.kv_heads, shape.head_dim)
        if source is None or str(source[0].ty.dtype) != shape.kv_dtype:
            return None
        return (scatter.args[0], indices, source[0], source[1], 4 if spec["kept_one"] else 3,
                source[2])

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not (isinstance(call, relax.Call) and call.op.same_as(_CALL_TIR)
                and isinstance(call.args[0], tvm.ir.GlobalVar)
                and call.args[0] in self.mod.functions and len(call.args[1].fields) == 4):
            return call
        found = made_here(self.mod[call.args[0]])
        if found is None or found[0] != "partial" or found[1].k_row or found[1].q_row:
            return call
        shape = found[1]
        q, k, v, pos = call.args[1].fields
        kw, vw = self._write(k, shape), self._write(v, shape)
        if kw is None or vw is None or vw[5] is not None or kw[4] != vw[4] \
                or str(kw[1].ty.dtype) != str(vw[1].ty.dtype):
            return call
        rope = kw[5]
        fields = dict(k_row=_shape(kw[2])[2], k_off=kw[3], v_row=_shape(vw[2])[2], v_off=vw[3],
                      idx_rank=kw[4], idx_dtype=str(kw[1].ty.dtype))
        q_source = self._source(q, shape.heads, shape.head_dim)
        if q_source is not None and str(q_source[0].ty.dtype) != shape.q_dtype:
            q_source = None
        if rope is not None:  # q and k rotated alike, or the partial would mix two embeddings
            if q_source is None or q_source[2] is None \
                    or not all(a.same_as(b) for a, b in zip(q_source[2], rope)):
                return call
            fields.update(rope_rank=len(_shape(rope[0])), rope_dtype=str(rope[0].ty.dtype))
        elif q_source is not None and q_source[2] is not None:
            q_source = None  # q rotated, k not: q stays the graph's tensor
        if q_source is not None:
            q = q_source[0]
            fields.update(q_row=_shape(q)[2], q_off=q_source[1])
        new = dataclasses.replace(shape, **fields)
        gv = self.builder_.add_func(
            partial_func(new).with_attr(BESIDE_WRITE_ATTR, [list(p) for p in WRITTEN_CACHE_PARAMS]),
            "decode_attention_partial")
        self.rewrites += 1
        args = [q, kw[0], vw[0], pos, kw[2], kw[1], vw[2], vw[1], *(rope or ())]
        return relax.call_tir(gv, args, call.ty)


@tvm.transform.module_pass(opt_level=0, name="DecodeAttentionStepRow")
class DecodeAttentionStepRow:
    """Make each decode attention partial read the step's q, k, v from the projection's row and
    the caches beside their writes (module docstring). Run after ``DecodeAttentionSplit``, before
    ``SplitToSlices`` and ``CacheSlotWrite``."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        changed = False
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function):
                continue
            rewriter.params = tuple(func.params)
            before = rewriter.rewrites
            new = rewriter.visit_expr(func)
            if rewriter.rewrites > before:
                rewriter.builder_.update_func(gv, remove_unused_bindings(new))
                changed = True
        return without_uncalled(rewriter.builder_.get(), "partial") if changed else mod

