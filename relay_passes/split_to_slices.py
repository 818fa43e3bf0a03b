"""SplitToSlices: ``R.split`` becomes one ``R.strided_slice`` per part.

TVM legalizes ``split`` into one PrimFunc with several outputs that dlight schedules as several
kernels, which cannot be one rOperator (one thread-block grid). One strided slice per part is one
kernel each, so the parts become rTasks like any other operator; an unrolled LSTM splits its gates
at every step and would otherwise cut its rPrograms at every step.

Input: Relax with high-level ops (run before LegalizeOps). Declines splits whose input shape is not
static along the split axis. Output: the same computation.
"""

import tvm
from tvm import relax, tirx

SPLIT = tvm.ir.Op.get("relax.split")


def _bounds(call):
    """[(begin, end), ...] of the parts, or None when the shape is not static."""
    shape = getattr(call.args[0].ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr):
        return None
    axis = int(call.attrs.axis)
    axis = axis + len(shape.values) if axis < 0 else axis
    extent = shape.values[axis]
    if not isinstance(extent, tirx.IntImm):
        return None
    n = int(extent.value)
    spec = call.attrs.indices_or_sections
    if isinstance(spec, tirx.IntImm):
        sections = int(spec.value)
        if sections <= 0 or n % sections:
            return None
        cuts = [n // sections * k for k in range(1, sections)]
    else:
        cuts = [min(int(c), n) for c in spec]
    edges = [0, *cuts, n]
    return axis, list(zip(edges[:-1], edges[1:]))


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.same_as(SPLIT)):
            return call
        found = _bounds(call)
        if found is None:
            return call
        axis, parts = found
        x = call.args[0]
        return relax.Tuple([relax.op.strided_slice(x, [axis], [b], [e]) for b, e in parts])


@tvm.transform.module_pass(opt_level=0, name="SplitToSlices")
class SplitToSlices:
    """Replace static ``R.split`` calls in every Relax function by strided slices."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()
