"""Float16Accumulation: a float16 model's matmuls accumulate in float32.

An ONNX export of a float16 model (``torch_dtype=torch.float16``: ``tvm-rammer model gpt2_decode
--param dtype=float16``) imports as float16 ``matmul`` calls whose ``out_dtype`` is float16, so
the GEMVs TVM schedules for them sum in float16 (dlight's reduction buffers take the output's
dtype); PyTorch's float16 matmul sums in float32 (issue 34: "accumulation in fp32 either way").

Input: Relax with high-level ops (before LegalizeOps). When ``main`` takes or returns a float16
tensor (a float16 model's caches, logits, hidden state), each matmul or convolution of float16
operands with a float16 result, in every Relax function, becomes the same call with
``out_dtype="float32"`` followed by a cast back to float16 (the form
``relax.transform.ToMixedPrecision(out_dtype="float32")`` gives such a call, what
``RammerConfig(precision="float16")`` runs on a float32 model). Nothing else changes: a part the
export computes in float32 on purpose (HF Llama's rotary angles ``inv_freq.float() @
positions.float()``, an upcast RMSNorm or softmax) stays float32, where ToMixedPrecision would
cast a float32 matmul's operands to float16 (position 2049 read as 2048). Any other module is
returned as it is.
"""

import inspect

import tvm
from tvm import relax

__all__ = ["Float16Accumulation", "ToMixedPrecisionChecked", "is_float16_model"]

_ACCUMULATING = tuple(tvm.ir.Op.get(f"relax.{name}") for name in (
    "matmul", "nn.conv1d", "nn.conv2d", "nn.conv3d", "nn.conv1d_transpose", "nn.conv2d_transpose"))


def _has_float16(ty) -> bool:
    if isinstance(ty, relax.TupleType):
        return any(_has_float16(field) for field in ty.fields)
    return isinstance(ty, relax.TensorType) and str(ty.dtype) == "float16"


def is_float16_model(mod: tvm.IRModule) -> bool:
    """Whether ``mod``'s ``main`` takes or returns a float16 tensor (False without a main)."""
    if "main" not in [gv.name_hint for gv in mod.get_global_vars()]:
        return False
    main = mod["main"]
    if not isinstance(main, relax.Function):
        return False
    return any(_has_float16(p.ty) for p in main.params) or _has_float16(main.ret_ty)


def _float16_sum(call) -> bool:
    """Whether ``call`` is a matmul or convolution of float16 operands with a float16 result."""
    return (isinstance(call, relax.Call) and isinstance(call.op, tvm.ir.Op)
            and any(call.op.same_as(op) for op in _ACCUMULATING)
            and isinstance(call.ty, relax.TensorType) and str(call.ty.dtype) == "float16"
            and all(isinstance(a.ty, relax.TensorType) and str(a.ty.dtype) == "float16"
                    for a in call.args))


def _accumulating_in_float32(call):
    """``call`` rebuilt with ``out_dtype="float32"`` (the other attributes kept)."""
    if call.op.same_as(_ACCUMULATING[0]):
        return relax.op.matmul(*call.args, out_dtype="float32")
    build = getattr(relax.op.nn, call.op.name.split(".")[-1])
    kept = [name for name in inspect.signature(build).parameters
            if name not in ("data", "weight", "out_dtype") and hasattr(call.attrs, name)]
    return build(*call.args, **{name: getattr(call.attrs, name) for name in kept},
                 out_dtype="float32")


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    """Each float16 sum (:func:`_float16_sum`) -> the float32-accumulating call, cast back."""

    def __init__(self, mod):
        super().__init__(mod)
        self.changed = False

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if not _float16_sum(call):
            return call
        self.changed = True
        wide = self.builder_.emit(_accumulating_in_float32(call))
        return relax.op.astype(wide, "float16")


@tvm.transform.module_pass(opt_level=0, name="Float16Accumulation")
class Float16Accumulation:
    """Float16 matmuls and convolutions of a float16 model accumulate in float32 (module
    docstring); any other module, nothing."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not is_float16_model(mod):
            return mod
        rewriter = _Rewriter(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function):
                rewriter.builder_.update_func(gv, rewriter.visit_expr(func))
        return rewriter.builder_.get() if rewriter.changed else mod


@tvm.transform.module_pass(opt_level=0, name="ToMixedPrecisionChecked")
class ToMixedPrecisionChecked:
    """``relax.transform.ToMixedPrecision(out_dtype="float32")`` (``precision="float16"``: float16
    storage, matmuls and convolutions accumulating in float32); a module TVM's pass cannot
    convert (it raises on some shape computations, e.g. ONNX Range of float inputs) is a
    ValueError of one line saying so and to compile at float32 precision, not TVM's traceback."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        try:
            return relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
        except (RuntimeError, TypeError, ValueError) as err:  # TVM's errors
            first = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
            raise ValueError(f"precision float16: TVM's ToMixedPrecision cannot convert this "
                             f"model ({first}); compile it with --precision float32 "
                             f"(RammerConfig(precision='float32'))") from None
