"""Float16Accumulation: a float16 model's matmuls accumulate in float32.

An ONNX export of a float16 model (``torch_dtype=torch.float16``: ``tvm-rammer model gpt2_decode
--param dtype=float16``) imports as float16 ``matmul`` calls whose ``out_dtype`` is float16, so
the GEMVs TVM schedules for them sum in float16 (dlight's reduction buffers take the output's
dtype); PyTorch's float16 matmul sums in float32 (issue 34: "accumulation in fp32 either way").

Input: Relax with high-level ops (before LegalizeOps). When ``main`` takes or returns a float16
tensor (a float16 model's caches, logits, hidden state) and has a float16 matmul or convolution,
the module goes through ``relax.transform.ToMixedPrecision(out_dtype="float32")``, what
``RammerConfig(precision="float16")`` runs on a float32 model: each matmul reads float16,
accumulates and writes float32, and a cast back to float16 follows it; on an already float16
graph it adds only those casts of the matmuls' [1, N] results (no cast of a cache). Any other
module is returned as it is, and so is one ToMixedPrecision fails on (it raises on some shape
computations, e.g. the ONNX node test ``test_range_float16_type_positive_delta``; such a module
keeps float16 sums rather than failing to compile).
"""

import tvm
from tvm import relax

__all__ = ["Float16Accumulation", "is_float16_model"]

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


def _sums_in_float16(func: relax.Function) -> bool:
    """Whether ``func`` has a matmul or convolution of float16 operands."""
    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and any(expr.op.same_as(op) for op in _ACCUMULATING) \
                and any(_has_float16(arg.ty) for arg in expr.args):
            found.append(expr)

    relax.analysis.post_order_visit(func.body, visit)
    return bool(found)


@tvm.transform.module_pass(opt_level=0, name="Float16Accumulation")
class Float16Accumulation:
    """ToMixedPrecision(out_dtype="float32") for a float16 model (module docstring), else
    nothing."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        if not is_float16_model(mod) or not _sums_in_float16(mod["main"]):
            return mod
        try:
            return relax.transform.ToMixedPrecision(out_dtype="float32")(mod)
        except (RuntimeError, TypeError, ValueError):  # TVM's errors: left with its float16 sums
            return mod
