"""FoldBatchNormToConvBias: ``batch_norm(conv2d(x, W) + b)`` becomes ``conv2d(x, W') + b'``.

TVM's ``relax.transform.FoldBatchnormToConv2D`` folds an inference BatchNormalization into the
weights of a conv2d that feeds it directly. An ONNX Conv with a bias input imports as
``conv2d`` + ``add(reshape(B))``, which that pattern misses; this pass folds that case:

    scale = gamma / sqrt(var + eps)         W' = W * scale[:, None, None, None]
    b'    = (b - mean) * scale + beta       out = conv2d(x, W') + b'[None, :, None, None]

With weights kept apart (``keep_params_in_input=True``, the function's ``num_input`` attribute: its
parameters past it are weights, ``relay_passes.lift_weights``), a weight parameter counts as a
constant, and the bias-free case (``batch_norm(conv2d(x, W))``, TVM's ``FoldBatchnormToConv2D`` for
constants, which runs first) is folded here too: the new weights are then operators on the weight
parameters, which LiftWeightTransforms moves into ``transform_params``.

Input: Relax with high-level ops from an inference model (run before LegalizeOps; BatchNorm with
``training=False``), weights, bias and statistics constant or weight parameters. Declines
anything else: non-constant operands, layouts other than NCHW/OIHW, a BatchNorm axis other than the
channel axis, a bias that is not per channel. The new weights and bias are expressions over
constants that FoldConstant evaluates. Output: the same inference computation.
"""

import tvm
from tvm import relax, tirx
from tvm.relax.dpl import TupleGetItemPattern, is_const, is_op, rewrite_call, wildcard

from .lift_weights import weight_params


def _static_shape(expr):
    shape = getattr(expr.ty, "shape", None)
    if not isinstance(shape, relax.ShapeExpr) or not all(isinstance(d, tirx.IntImm)
                                                          for d in shape.values):
        return None
    return [int(d.value) for d in shape.values]


class _Patterns:
    """``weights``: match any operand (checked in :func:`_fold`: a constant or a weight
    parameter) and the bias-free form too; else constants only, with a bias (the embedded mode)."""

    def __init__(self, weights=False):
        operand = wildcard if weights else is_const
        self.x, self.weight = wildcard(), operand()
        self.conv = is_op("relax.nn.conv2d")(self.x, self.weight)
        self.bias_const = operand()
        reshaped = is_op("relax.reshape")(self.bias_const, wildcard())
        # a wildcard operand would match the reshape's var itself: look through the reshape first
        self.bias = reshaped | self.bias_const if weights else self.bias_const | reshaped
        self.add = is_op("relax.add")(self.conv, self.bias)
        self.gamma, self.beta, self.mean, self.var = operand(), operand(), operand(), operand()
        self.stats = (self.gamma, self.beta, self.mean, self.var)
        self.bn = is_op("relax.nn.batch_norm")(self.add, *self.stats)
        self.pattern = TupleGetItemPattern(self.bn, 0)
        if weights:  # batch_norm(conv2d(x, W)): TVM's FoldBatchnormToConv2D for constants
            self.bn_free = is_op("relax.nn.batch_norm")(self.conv, *self.stats)
            self.pattern = self.pattern | TupleGetItemPattern(self.bn_free, 0)


def _fold(p, expr, matches, weights=frozenset()):
    """The folded expression of one match, or ``expr`` when declined. ``weights``: the function's
    weight parameters, accepted as operands besides constants."""
    bias_free = p.bn not in matches
    conv, bn = matches[p.conv], matches[p.bn_free if bias_free else p.bn]
    operands = [matches[q] for q in (p.weight, *p.stats, *(() if bias_free else (p.bias_const,)))]
    if not all(isinstance(o, tvm.ir.expr.Constant) or o in weights for o in operands):
        return expr
    if conv.attrs.data_layout != "NCHW" or conv.attrs.kernel_layout != "OIHW" or \
            conv.attrs.out_layout != "NCHW" or bool(bn.attrs.training) or int(bn.attrs.axis) != 1:
        return expr
    out_shape = _static_shape(conv)
    if out_shape is None or len(out_shape) != 4:
        return expr
    channels = out_shape[1]
    bias = None if bias_free else matches[p.bias_const]
    if bias is not None and _static_shape(bias) not in ([channels], [1, channels, 1, 1]):
        return expr  # a scalar or non-channel bias: leave it to DecomposeOpsForInference
    dtype = conv.ty.dtype
    eps = relax.const(float(bn.attrs.epsilon), dtype)
    scale = relax.op.divide(matches[p.gamma], relax.op.sqrt(relax.op.add(matches[p.var], eps)))
    centred = relax.op.negative(matches[p.mean]) if bias is None else \
        relax.op.subtract(relax.op.reshape(bias, [channels]), matches[p.mean])
    shift = relax.op.add(relax.op.multiply(centred, scale), matches[p.beta])
    weight = relax.op.multiply(matches[p.weight], relax.op.reshape(scale, [channels, 1, 1, 1]))
    new_conv = relax.Call(conv.op, [matches[p.x], weight], conv.attrs)
    return relax.op.add(new_conv, relax.op.reshape(shift, [1, channels, 1, 1]))


@tvm.transform.module_pass(opt_level=0, name="FoldBatchNormToConvBias")
class FoldBatchNormToConvBias:
    """Fold inference BatchNorms that follow a conv2d + per-channel bias into that conv's weights
    and bias (every Relax function of the module). Run before LegalizeOps, with
    ``relax.transform.FoldBatchnormToConv2D`` for the bias-free case."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        out = mod
        updates = {}
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and not _is_primitive(func):
                weights = frozenset(weight_params(func))
                patterns = _Patterns(bool(weights))
                new = rewrite_call(patterns.pattern,
                                   lambda e, m, p=patterns, w=weights: _fold(p, e, m, w), func)
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
