"""Which elements of a Relax tensor are compile-time constants, and their values.

``known_elements(expr, lookup) -> (values, known) | None``: ``values`` a numpy array of the
tensor's static shape, ``known`` a boolean array of the same shape; where ``known`` is True the
element equals ``values`` for every value of the function's inputs (a proof over the few operators
below, not a sample), elsewhere it depends on them (``values`` there is meaningless). ``lookup(var)``
gives the value a dataflow variable is bound to (a ``PyExprMutator``'s ``lookup_binding``) or None.

Exact elementwise: constants; shapes of static tensors (``shape_of``, ``shape_to_tensor``);
add, subtract, multiply (a known 0 makes an integer product known: a float 0 times inf is
NaN), less / greater / equal / less_equal / greater_equal, where (a known condition picks its
branch; equal known branches decide it anyway), astype; layout: reshape, broadcast_to,
expand_dims, permute_dims, strided_slice (constant bounds). Anything else, or a
tensor of non-static shape: nothing known (``None`` for a non-static shape). Pure: reads the
expressions, builds nothing. Used by ``cache_write.CacheSlotWrite`` to prove that a scatter's
leading index components are the iterator's own coordinates (an exported ``cache[:, :, p] = new``).
"""

from __future__ import annotations

import numpy as np
import tvm
from tvm import relax, tirx

_MAX_ELEMENTS = 1 << 16  # index tensors are small; a bigger tensor is not traced


def is_op(expr, name: str) -> bool:
    """Whether ``expr`` is a call of the Relax operator ``relax.<name>``."""
    return (isinstance(expr, relax.Call) and isinstance(expr.op, tvm.ir.Op)
            and expr.op.same_as(tvm.ir.Op.get(f"relax.{name}")))


def static_dims(expr):
    """A tensor expression's static dims as a list of ints, or None."""
    shape = static_shape(expr.ty)
    return None if shape is None else list(shape)


def static_shape(ty):
    """The tensor type's dims as ints, or None when not a tensor of static shape."""
    shape = getattr(ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr):
        return None
    if not all(isinstance(v, tirx.IntImm) for v in shape.values):
        return None
    return tuple(int(v.value) for v in shape.values)


def int_values(tuple_expr):
    """A relax Tuple / ShapeExpr / list of PrimValue or IntImm -> list of ints (None if symbolic)."""
    items = getattr(tuple_expr, "fields", None) or getattr(tuple_expr, "values", None)
    if items is None:
        items = list(tuple_expr)
    out = []
    for item in items:
        item = getattr(item, "value", item)
        if not isinstance(item, (tirx.IntImm, int)):
            return None
        out.append(int(item))
    return out


def _unknown(shape, dtype="int64"):
    return np.zeros(shape, dtype), np.zeros(shape, bool)


def known_elements(expr, lookup):
    """See the module docstring."""
    memo = {}

    def known(e):
        if e not in memo:  # a where reads its operand three times: each traced once
            memo[e] = _known(e, lookup, known)
        return memo[e]

    try:
        return known(expr)
    except RecursionError:  # a chain too deep to trace: nothing proven
        return None


def _known(expr, lookup, known):
    shape = static_shape(getattr(expr, "ty", None))
    if shape is None or int(np.prod(shape)) > _MAX_ELEMENTS:
        return None
    if isinstance(expr, tvm.ir.expr.Constant):
        value = expr.value.numpy()
        return value, np.ones(value.shape, bool)
    if isinstance(expr, relax.Var):
        bound = lookup(expr)
        if bound is None:
            return _unknown(shape, str(expr.ty.dtype))
        return known(bound)
    if not (isinstance(expr, relax.Call) and hasattr(expr.op, "name")):
        return _unknown(shape)
    try:
        found = _call(expr, known)
    except (ValueError, TypeError, IndexError):  # numpy rejects what Relax accepted: not traced
        found = None
    if found is None:
        return _unknown(shape)
    values, mask = found
    if tuple(values.shape) != shape:
        return _unknown(shape)
    return values, mask


def _arg(call, i, known):
    return known(call.args[i])


_ARITH = {"relax.add": np.add, "relax.subtract": np.subtract, "relax.less": np.less,
          "relax.greater": np.greater, "relax.equal": np.equal,
          "relax.less_equal": np.less_equal, "relax.greater_equal": np.greater_equal}


def _call(call, known):  # pylint: disable=too-many-return-statements
    name = call.op.name
    if name == "relax.shape_to_tensor":
        dims = int_values(call.args[0].ty.values) if isinstance(call.args[0].ty, relax.ShapeType) \
            and call.args[0].ty.values is not None else None
        if dims is None:
            return None
        return np.array(dims, np.int64), np.ones(len(dims), bool)
    if name in _ARITH or name == "relax.multiply":
        a, b = _arg(call, 0, known), _arg(call, 1, known)
        if a is None or b is None:
            return None
        (va, ka), (vb, kb) = a, b
        if name == "relax.multiply":  # a known 0 decides an integer product (not 0 * inf)
            exact = ka & kb
            if "int" in str(call.ty.dtype) or str(call.ty.dtype) == "bool":
                exact = exact | (ka & (va == 0)) | (kb & (vb == 0))
            return np.multiply(va, vb), exact
        return _ARITH[name](va, vb), np.broadcast_to(ka & kb, np.broadcast_shapes(ka.shape, kb.shape))
    if name == "relax.where":
        parts = [_arg(call, i, known) for i in range(3)]
        if any(p is None for p in parts):
            return None
        (vc, kc), (va, ka), (vb, kb) = parts
        vc = vc.astype(bool)
        value = np.where(vc, va, vb)
        picked = kc & np.where(vc, ka, kb)
        agreed = ka & kb & (va == vb)
        return value, picked | agreed
    if name == "relax.astype":
        a = _arg(call, 0, known)
        return None if a is None else (a[0].astype(str(call.attrs.dtype)), a[1])
    return _layout(call, name, static_shape(call.ty), known)


def _layout(call, name, shape, known):
    """Operators that move elements: applied to the values and the known mask alike."""
    a = _arg(call, 0, known)
    if a is None:
        return None
    if name in ("relax.reshape", "relax.broadcast_to", "relax.expand_dims"):
        move = (np.broadcast_to if name == "relax.broadcast_to" else np.reshape)
        return tuple(np.ascontiguousarray(move(x, shape)) for x in a)
    if name == "relax.permute_dims":
        axes = None if call.attrs.axes is None else [int(x) for x in call.attrs.axes]
        return tuple(np.transpose(x, axes) for x in a)
    if name == "relax.strided_slice" and len(call.args) >= 4:
        axes, begin, end = (int_values(call.args[i]) for i in (1, 2, 3))
        strides = int_values(call.args[4]) if len(call.args) > 4 else [1] * len(axes or [])
        if None in (axes, begin, end, strides):
            return None
        index = [slice(None)] * a[0].ndim
        for ax, b, e, s in zip(axes, begin, end, strides):
            index[ax] = slice(b, e, s)
        return tuple(x[tuple(index)] for x in a)
    return None
