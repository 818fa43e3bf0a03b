"""SplitMatMulOverConcat: ``matmul(concat([a, b, ...]), W)`` becomes ``matmul(a, W_a) + matmul(b, W_b) + ...``.

An unrolled LSTM step computes its gates as ``[x_t, h] @ W``: the Concat makes the input half wait
for the recurrent state and the recurrent half wait for the layer below, so every GEMV sits on the
wavefront's critical path. With W split by rows at compile time, ``x_t @ W_x`` depends on the layer
below only and runs in an earlier wave; only ``h @ W_h`` and the Add joining the halves stay on the
recurrent path (the Add then fuses into the cell's elementwise tail, see SplitTailFusion). The FLOPs
and the weight bytes are the same; the summation order of the reduction changes (float rounding).

Input: Relax with high-level ops (run before LegalizeOps, so that FoldConstant afterwards folds a
half whose input is a constant, e.g. ``zeros @ W_h`` at the first step). Rewrites a ``relax.matmul``
whose second argument is a 2-D Constant ``W`` of static shape ``[K, N]`` and whose first argument is
a dataflow var bound to ``relax.concat`` along its last axis of two or more parts with static widths
summing to K. A constant bias added to the result, ``matmul(concat([x, h]), W) + bias``, moves onto
the first part's term, ``(x @ W_x + bias) + h @ W_h``, where it fuses into that matmul as an
epilogue (the first part is an RNN step's input; the recurrent state comes last). Each ``W`` is
split once per set of widths: the steps sharing a weight share its halves (no copy per step). Declines everything else (a W that is not a constant, concat along
another axis, symbolic widths, batched weights). Output: the same computation; a concat that has no
other use is removed.

A weight parameter (past the function's ``num_input``: weights kept apart from the library,
``relay_passes.lift_weights``) counts as a constant: its row blocks are ``strided_slice`` bindings
on it, which LiftWeightTransforms later moves into ``transform_params``.
"""

import numpy as np
import tvm
from tvm import relax

from .lift_weights import weight_params
from .unused_bindings import remove_unused_bindings

MATMUL = tvm.ir.Op.get("relax.matmul")
ADD = tvm.ir.Op.get("relax.add")
CONCAT = tvm.ir.Op.get("relax.concat")
CONSTANT = tvm.ir.expr.Constant


def _is_op(expr, op):
    return isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op) and expr.op.same_as(op)


def _static_shape(expr):
    """Dims of a tensor expr as ints, or None when the shape is not static."""
    shape = getattr(expr.ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr):
        return None
    dims = []
    for d in shape.values:
        if not isinstance(d, tvm.tirx.IntImm):
            return None
        dims.append(int(d.value))
    return dims


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Splits matmuls over concats; caches the split weights by (weight, widths)."""

    def __init__(self, mod):
        super().__init__(mod)
        self.halves = {}
        self.rewrites = 0
        self.sums = []  # (the sum expression emitted for a split matmul, its terms)
        self.weights = set()  # the weight parameters of the function being visited

    def _is_weight(self, expr):
        return isinstance(expr, CONSTANT) or expr in self.weights

    def _concat_parts(self, x):
        """The parts of the concat `x` is bound to, when it concatenates along its last axis."""
        if not isinstance(x, relax.Var):
            return None
        value = self.lookup_binding(x)
        if not _is_op(value, CONCAT):
            return None
        tup = value.args[0]
        if isinstance(tup, relax.Var):
            tup = self.lookup_binding(tup)
        if not isinstance(tup, relax.Tuple) or len(tup.fields) < 2:
            return None
        rank = len(_static_shape(x) or ())
        axis = int(value.attrs.axis) if value.attrs.axis is not None else 0
        if rank == 0 or axis % rank != rank - 1:
            return None
        shapes = [_static_shape(p) for p in tup.fields]
        if any(s is None or len(s) != rank for s in shapes):
            return None
        return list(tup.fields), [s[-1] for s in shapes]

    def _weight_parts(self, weight, widths):
        """W's row blocks for `widths` (constants shared by every matmul of the same W)."""
        key = (weight, tuple(widths))
        if key not in self.halves and not isinstance(weight, CONSTANT):  # a weight parameter
            edges = np.cumsum([0, *widths])
            self.halves[key] = [self.builder_.emit(relax.op.strided_slice(
                weight, axes=[0], begin=[int(lo)], end=[int(hi)])) for lo, hi in
                zip(edges[:-1], edges[1:])]
        if key not in self.halves:
            data = weight.value.numpy()
            edges = np.cumsum([0, *widths])
            self.halves[key] = [relax.const(np.ascontiguousarray(data[lo:hi]), str(data.dtype))
                                for lo, hi in zip(edges[:-1], edges[1:])]
        return self.halves[key]

    def _split_terms(self, x):
        """The terms of the split matmul `x` is bound to, or None."""
        if not isinstance(x, relax.Var):
            return None
        value = self.lookup_binding(x)
        return next((terms for total, terms in self.sums if total.same_as(value)), None)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if _is_op(call, ADD) and self._is_weight(call.args[1]):
            return self._move_bias(call)
        if not _is_op(call, MATMUL) or not self._is_weight(call.args[1]):
            return call
        weight = call.args[1]
        w_shape = _static_shape(weight)
        found = self._concat_parts(call.args[0])
        if found is None or w_shape is None or len(w_shape) != 2:
            return call
        parts, widths = found
        if sum(widths) != w_shape[0]:
            return call
        self.rewrites += 1
        out_dtype = call.attrs.out_dtype
        terms = [self.builder_.emit(relax.op.matmul(part, w_part, out_dtype=out_dtype))
                 for part, w_part in zip(parts, self._weight_parts(weight, widths))]
        return self._sum(terms)

    def _sum(self, terms):
        """((t0 + t1) + t2) + ...: the last add is returned unbound (the binding being rewritten)."""
        total = terms[0]
        for term in terms[1:-1]:
            total = self.builder_.emit(relax.op.add(total, term))
        result = self.builder_.normalize(relax.op.add(total, terms[-1]))
        self.sums.append((result, terms))
        return result

    def _move_bias(self, call):
        """``split_sum + bias`` -> ``(t0 + bias) + t1 + ...``: the bias becomes an epilogue of the
        first part's matmul (the input half of an RNN step) instead of a step on the path."""
        terms = self._split_terms(call.args[0])
        if terms is None:
            return call
        first = self.builder_.emit(relax.op.add(terms[0], call.args[1]))
        return self._sum([first, *terms[1:]])


@tvm.transform.module_pass(opt_level=0, name="SplitMatMulOverConcat")
class SplitMatMulOverConcat:
    """Split every ``matmul(concat(parts), constant W)`` into one matmul per part (see module doc)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                before = rewriter.rewrites
                rewriter.weights = set(weight_params(func))
                new = rewriter.visit_expr(func)
                if rewriter.rewrites > before:
                    rewriter.builder_.update_func(gv, remove_unused_bindings(new))
        return rewriter.builder_.get() if rewriter.rewrites else mod
