"""RemoveInferenceDropout: ``R.nn.dropout`` becomes its input (inference: dropout is the identity).

TVM legalizes ``dropout`` into one PrimFunc with two outputs (a copy of the input and an all-ones
mask): a kernel that only copies, with two outputs, so it can be no rOperator and cuts the rProgram
around it. Exported models keep their Dropout nodes (ONNX Dropout is the identity at inference), so
every classifier head would pay a launch for it.

Input: Relax with high-level ops (run before LegalizeOps). ``dropout(x)`` becomes
``(x, ones(shape(x)))``: the output is ``x`` itself and the mask a constant that DeadCodeElimination
removes when nothing reads it (as in every exported inference graph). Output: the same inference
computation. Not for training graphs (where dropout is random).
"""

import tvm
from tvm import relax

DROPOUT = tvm.ir.Op.get("relax.nn.dropout")


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not (isinstance(call.op, tvm.ir.Op) and call.op.same_as(DROPOUT)):
            return call
        x = call.args[0]
        shape = getattr(x.ty, "shape", None)
        if isinstance(shape, relax.ShapeExpr):
            mask = relax.op.ones(shape, x.ty.dtype)
        else:
            mask = relax.op.ones_like(x)
        return relax.Tuple([x, mask])


@tvm.transform.module_pass(opt_level=0, name="RemoveInferenceDropout")
class RemoveInferenceDropout:
    """Replace ``R.nn.dropout`` in every Relax function by its input and an all-ones mask."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get()
