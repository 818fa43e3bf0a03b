"""FoldConstantOps: layout and elementwise ops on constants evaluated at compile time, without
building a kernel for them.

Imported models compute some constants in the graph: TVM's ONNX frontend reshapes every conv bias
(``[C] -> [1, C, 1, 1]``), BatchNorm folding scales weights (``multiply(w, scale)``), float16 casts
weights (``astype``). ``relax.transform.FoldConstant`` folds them after LegalizeOps by building
and running each distinct PrimFunc with LLVM, about 0.3 s a function: 3 of Inception-v3's 4.3 s in
TVM's default pipeline go to eleven reshapes of biases.

Input: Relax with high-level ops (run before LegalizeOps). A call of an op in :data:`FOLDERS` whose
tensor arguments are all constants, with a static result of a known dtype, becomes the constant
numpy computes (reshape / permute_dims / expand_dims / squeeze are views; add, subtract, multiply,
divide, sqrt, negative, astype elementwise with numpy's broadcasting, in the result dtype). Any
other call, and any call whose numpy result does not have the shape and dtype Relax inferred for
it, is left to FoldConstant. Output: the same computation with those calls as constants.
"""
from __future__ import annotations

import numpy as np
import tvm
from tvm import relax


def _shape_of(expr) -> tuple | None:
    shape = getattr(expr, "values", None)
    if shape is None or not all(isinstance(d, tvm.tirx.IntImm) for d in shape):
        return None
    return tuple(int(d) for d in shape)


def _axes(value) -> list | None:
    return None if value is None else [int(a) for a in value]


def _reshape(call, args):
    shape = _shape_of(call.args[1])
    return None if shape is None else args[0].reshape(shape)


def _permute_dims(call, args):
    return np.transpose(args[0], _axes(call.attrs.axes))


def _expand_dims(call, args):
    out = args[0]
    for axis in sorted(a % (out.ndim + len(call.attrs.axis)) for a in _axes(call.attrs.axis)):
        out = np.expand_dims(out, axis)
    return out


def _squeeze(call, args):
    axes = _axes(call.attrs.axis)
    return np.squeeze(args[0], axis=None if axes is None else tuple(axes))


def _binary(fn):
    return lambda call, args: fn(args[0], args[1])


FOLDERS = {
    "relax.reshape": _reshape,
    "relax.permute_dims": _permute_dims,
    "relax.expand_dims": _expand_dims,
    "relax.squeeze": _squeeze,
    "relax.add": _binary(np.add),
    "relax.subtract": _binary(np.subtract),
    "relax.multiply": _binary(np.multiply),
    "relax.divide": _binary(np.divide),
    "relax.sqrt": lambda call, args: np.sqrt(args[0]),
    "relax.negative": lambda call, args: np.negative(args[0]),
    "relax.astype": lambda call, args: args[0].astype(str(call.attrs.dtype)),
}
_TENSOR_ARGS = {"relax.reshape": 1}  # reshape's second argument is the target shape


def _constant_array(expr) -> np.ndarray | None:
    if not isinstance(expr, tvm.ir.expr.Constant):
        return None
    value = expr.value
    return value.numpy() if hasattr(value, "numpy") else None  # a scalar PrimValue: not ours


def fold(call: relax.Call, result_ty) -> np.ndarray | None:
    """The numpy value of ``call`` when it is foldable here, else None."""
    if not isinstance(call.op, tvm.ir.Op) or call.op.name not in FOLDERS:
        return None
    tensors = call.args[: _TENSOR_ARGS.get(call.op.name, len(call.args))]
    arrays = [_constant_array(a) for a in tensors]
    if not arrays or any(a is None for a in arrays):
        return None
    shape, dtype = getattr(result_ty, "shape", None), getattr(result_ty, "dtype", None)
    shape = _shape_of(shape) if shape is not None else None
    if shape is None or not dtype or dtype == "bool":
        return None
    if call.op.name != "relax.astype" and len({a.dtype for a in arrays}) != 1:
        return None  # mixed dtypes: Relax's promotion rules, not numpy's
    with np.errstate(all="ignore"):
        out = FOLDERS[call.op.name](call, arrays)
    if out is None:
        return None
    out = np.asarray(out)
    if tuple(out.shape) != shape or str(out.dtype) != str(dtype):
        return None
    return np.ascontiguousarray(out)


@relax.expr_functor.mutator
class _Folder(relax.PyExprMutator):
    """Folds calls bottom-up; a variable bound to a folded call is replaced by the constant at
    every use (so chains fold too), and its binding is dropped."""

    def __init__(self, mod):
        super().__init__(mod)
        self.folded = {}

    def visit_var_(self, var):
        return self.folded.get(var, var)

    def visit_dataflow_var_(self, var):
        return self.folded.get(var, var)

    def visit_var_binding_(self, binding):
        value = self.visit_expr(binding.value)
        if isinstance(binding.value, relax.Call) and isinstance(value, tvm.ir.expr.Constant):
            self.folded[binding.var] = value
            return
        super().visit_var_binding_(binding)

    def visit_call_(self, call):
        call = super().visit_call_(call)
        value = fold(call, self.builder_.normalize(call).ty)
        return call if value is None else relax.const(value)


@tvm.transform.module_pass(opt_level=0, name="FoldConstantOps")
class FoldConstantOps:
    """Evaluate :data:`FOLDERS` ops on constants with numpy in every Relax function."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        folder = _Folder(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                folder.builder_.update_func(gv, folder.visit_expr(func))
        return folder.builder_.get()
