"""ExactPowers: ``pow`` in the kernels written so that CUDA's fast math computes it right.

TVM compiles every CUDA module with ``--use_fast_math`` (``tvm/support/nvcc.py``: always under
NVRTC, under nvcc unless ``TVM_CUDA_NVCC_NO_FAST_MATH`` is set). Fast math turns ``powf(x, y)`` into
``__powf(x, y)`` = ``ex2.approx(y * lg2.approx(x))`` (``nvcc -ptx --use_fast_math``: ``lg2.approx.ftz``,
``add``, ``ex2.approx.ftz`` for ``powf(x, 2.0f)``), which is NaN for every ``x < 0``, whatever ``y``:
``powf(-3, 2)`` is 9 in exact math and NaN on the GPU. ONNX models square things all the time
(``Pow(x, 2)``; TVM's ONNX frontend writes MeanVarianceNormalization as
``mean(x^2) - mean(x)^2`` with ``relax.op.power``): one negative element made a whole channel NaN.

Input: an IRModule after legalization (Relax functions and the PrimFuncs they call). Output: the
same module with every ``tirx.pow(x, y)`` of a floating-point type of at most 32 bits (the types
fast math approximates; ``double`` pow is exact under it) in a PrimFunc rewritten:

* ``y`` a constant integer ``k`` with ``|k| <=`` :data:`MAX_MULTIPLIED`: ``x`` multiplied by itself
  (square-and-multiply: ``x * x`` for 2), ``1 / x^|k|`` for ``k < 0``, ``1`` for ``k = 0``: exact
  as exact math has it, and cheaper than a pow;
* ``y`` another constant integer: ``pow(|x|, y)``, negated when ``x < 0`` and ``y`` is odd;
* ``y`` not a constant: the same sign rule when ``y`` is an integer at run time, ``pow(x, y)``
  otherwise (a negative ``x`` gives NaN there in exact math too), and ``1`` when ``y == 0``
  (``__powf(0, 0)`` is NaN, ``powf(0, 0)`` is 1);
* ``y`` a constant that is not an integer (LRN's 0.75): left alone, for the same reason.

Declines nothing: a module without pow comes out unchanged. Where it sits: after legalization
(``MemoLegalizeOps``), before fusion reads the PrimFuncs, so every kernel built from them (rKernels,
their versions, kernels left outside rPrograms) gets the rewritten form.
"""

from __future__ import annotations

import math

import tvm
import tvm_ffi
from tvm import tirx

__all__ = ["ExactPowers", "exact_pow", "MAX_MULTIPLIED"]

MAX_MULTIPLIED = 8  # at most three squarings and three multiplications per power
_POW = tvm.ir.Op.get("tirx.pow")


def _approximated(dtype) -> bool:
    """Whether fast math computes pow of ``dtype`` with ``__powf`` (float types of <= 32 bits)."""
    t = tvm.DataType(str(dtype))
    return t.type_code in (tvm.DataTypeCode.FLOAT, tvm.DataTypeCode.BFLOAT) and t.bits <= 32


def _constant(y):
    """The value of a constant exponent, None for any other expression."""
    if isinstance(y, (tirx.FloatImm, tirx.IntImm)):
        return float(y.value)
    return None


def _multiplied(x, k: int):
    """``x ** k`` for ``1 <= k``, by square-and-multiply."""
    result, square = None, x
    while True:
        if k & 1:
            result = square if result is None else result * square
        k >>= 1
        if not k:
            return result
        square = square * square


def _pow(base, y, dtype: str):
    """A plain ``pow`` call (``tirx.pow`` itself warns about every constant exponent >= 3)."""
    return tirx.call_intrin(dtype, "tirx.pow", base, y)


def _signed_pow(x, y, integral, odd, dtype: str):
    """``pow`` with exact math's sign rule for a negative base: ``pow(|x|, y)``, negated for an odd
    ``y``, when ``y`` is an integer. ``integral``, ``odd``: boolean PrimExprs, or Python bools
    for a constant ``y``."""
    negative = x < tirx.const(0, dtype)
    if integral is True:
        base = tirx.abs(x)
    else:
        base = tirx.Select(tirx.all(negative, integral), -x, x)
    magnitude = _pow(base, y, dtype)
    if odd is False:
        return magnitude
    flip = negative if odd is True else tirx.all(negative, odd)
    return magnitude * tirx.Select(flip, tirx.const(-1, dtype), tirx.const(1, dtype))


def exact_pow(x, y):
    """The rewrite of ``pow(x, y)`` (see the module docstring); ``x``, ``y``: PrimExprs of one
    dtype. Returns a PrimExpr of that dtype."""
    dtype = str(x.ty.dtype)
    value = _constant(y)
    if value is not None:
        if not _integer(value):
            return _pow(x, y, dtype)  # NaN for x < 0 in exact math as well
        k = int(value)
        if k == 0:
            return tirx.const(1, dtype)
        if abs(k) <= MAX_MULTIPLIED:
            power = _multiplied(x, abs(k))
            return power if k > 0 else tirx.const(1, dtype) / power
        return _signed_pow(x, y, True, k % 2 == 1, dtype)
    half = y * tirx.const(0.5, dtype)
    integral = tirx.floor(y) == y
    odd = tirx.all(integral, tirx.floor(half) != half)
    return tirx.Select(y == tirx.const(0, dtype), tirx.const(1, dtype),
                       _signed_pow(x, y, integral, odd, dtype))


def _integer(value: float) -> bool:
    return math.isfinite(value) and value == int(value)


def _rewrite(call):
    if not (call.op.same_as(_POW) and _approximated(call.ty.dtype)):
        return call
    value = _constant(call.args[1])
    if value is not None and not _integer(value):
        return call  # left as it is (see exact_pow)
    return exact_pow(call.args[0], call.args[1])


def rewrite_func(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """``func`` with every approximated pow rewritten (``func`` itself when it has none)."""
    body = tvm_ffi.structural_map(func.body, (tvm.ir.Call, _rewrite))
    return func if body.same_as(func.body) else func.with_body(body)


@tvm.transform.module_pass(opt_level=0, name="ExactPowers")
class ExactPowers:
    """Module pass: every PrimFunc of the module through :func:`rewrite_func`; Relax functions and
    PrimFuncs without pow are left as they are."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        functions = dict(mod.functions_items())
        changed = False
        for gvar, func in functions.items():
            if isinstance(func, tirx.PrimFunc):
                new = rewrite_func(func)
                changed = changed or not new.same_as(func)
                functions[gvar] = new
        if not changed:
            return mod
        return tvm.IRModule(functions, attrs=mod.attrs, global_infos=mod.global_infos)
