"""FoldBatchNormToConvBias: ``batch_norm(conv2d(x, W) + b)`` becomes ``conv2d(x, W') + b'``.

TVM's ``relax.transform.FoldBatchnormToConv2D`` folds an inference BatchNormalization into the
weights of a conv2d that feeds it directly. An ONNX Conv with a bias input imports as
``conv2d`` + ``add(reshape(B))``, which that pattern misses; this pass folds that case:

    scale = gamma / sqrt(var + eps)         W' = W * scale[:, None, None, None]
    b'    = (b - mean) * scale + beta       out = conv2d(x, W') + b'[None, :, None, None]

Input: Relax with high-level ops from an inference model (run before LegalizeOps; BatchNorm with
``training=False``), weights, bias and statistics constant (``keep_params_in_input=False``). Declines
anything else: non-constant operands, layouts other than NCHW/OIHW, a BatchNorm axis other than the
channel axis, a bias that is not per channel. The new weights and bias are expressions over
constants that FoldConstant evaluates. Output: the same inference computation.
"""

import tvm
from tvm import relax, tirx
from tvm.relax.dpl import TupleGetItemPattern, is_const, is_op, rewrite_call, wildcard


def _static_shape(expr):
    shape = getattr(expr.ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr) or not all(isinstance(d, tirx.IntImm)
                                                          for d in shape.values):
        return None
    return [int(d.value) for d in shape.values]


class _Patterns:
    def __init__(self):
        self.x, self.weight = wildcard(), is_const()
        self.conv = is_op("relax.nn.conv2d")(self.x, self.weight)
        self.bias_const = is_const()
        self.bias = self.bias_const | is_op("relax.reshape")(self.bias_const, wildcard())
        self.add = is_op("relax.add")(self.conv, self.bias)
        self.gamma, self.beta, self.mean, self.var = is_const(), is_const(), is_const(), is_const()
        self.bn = is_op("relax.nn.batch_norm")(self.add, self.gamma, self.beta, self.mean, self.var)
        self.pattern = TupleGetItemPattern(self.bn, 0)


def _fold(p, expr, matches):
    conv, bn = matches[p.conv], matches[p.bn]
    if conv.attrs.data_layout != "NCHW" or conv.attrs.kernel_layout != "OIHW" or \
            conv.attrs.out_layout != "NCHW" or bool(bn.attrs.training) or int(bn.attrs.axis) != 1:
        return expr
    out_shape, bias = _static_shape(conv), matches[p.bias_const]
    if out_shape is None or len(out_shape) != 4:
        return expr
    channels = out_shape[1]
    if _static_shape(bias) not in ([channels], [1, channels, 1, 1]):
        return expr  # a scalar or non-channel bias: leave it to DecomposeOpsForInference
    dtype = conv.ty.dtype
    eps = relax.const(float(bn.attrs.epsilon), dtype)
    scale = relax.op.divide(matches[p.gamma], relax.op.sqrt(relax.op.add(matches[p.var], eps)))
    shift = relax.op.add(relax.op.multiply(
        relax.op.subtract(relax.op.reshape(bias, [channels]), matches[p.mean]), scale),
        matches[p.beta])
    weight = relax.op.multiply(matches[p.weight], relax.op.reshape(scale, [channels, 1, 1, 1]))
    new_conv = relax.Call(conv.op, [matches[p.x], weight], conv.attrs)
    return relax.op.add(new_conv, relax.op.reshape(shift, [1, channels, 1, 1]))


@tvm.transform.module_pass(opt_level=0, name="FoldBatchNormToConvBias")
class FoldBatchNormToConvBias:
    """Fold inference BatchNorms that follow a conv2d + per-channel bias into that conv's weights
    and bias (every Relax function of the module). Run before LegalizeOps, with
    ``relax.transform.FoldBatchnormToConv2D`` for the bias-free case."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        patterns = _Patterns()
        out = mod
        updates = {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and not _is_primitive(func):
                new = rewrite_call(patterns.pattern, lambda e, m: _fold(patterns, e, m), func)
                if not new.same_as(func):
                    updates[gv] = new
        if not updates:
            return mod
        out = mod.clone()
        for gv, func in updates.items():
            out[gv] = func
        return out


def _is_primitive(func) -> bool:
    return func.attrs is not None and "Primitive" in func.attrs and int(func.attrs["Primitive"]) != 0
