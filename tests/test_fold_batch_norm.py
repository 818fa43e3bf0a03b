"""FoldBatchNormToConvBias folds BN after conv2d + bias into the conv; declines what it cannot."""

import numpy as np
import tvm
from tvm import relax

from relay_passes.fold_batch_norm import FoldBatchNormToConvBias

from exported_cnns import ExportStyleGraph
from onnx_builders import run_onnxruntime, run_tvm_cpu

C = 4
RNG = np.random.default_rng(0)
W = RNG.standard_normal((C, 3, 3, 3)).astype("float32")
B = RNG.standard_normal(C).astype("float32")
GAMMA, BETA, MEAN = (RNG.standard_normal(C).astype("float32") for _ in range(3))
VAR = RNG.uniform(0.5, 2.0, C).astype("float32")


def _before(weight=None, training=False, bias_shape=(1, C, 1, 1), reshape_bias=True):
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 3, 8, 8), "float32"))
    params = [x] if weight is None else [x, weight]
    with bb.function("main", params):
        with bb.dataflow():
            w = relax.const(W) if weight is None else weight
            conv = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
            bias = bb.emit(relax.op.reshape(relax.const(B), bias_shape)) if reshape_bias \
                else relax.const(B[:int(np.prod(bias_shape))].reshape(bias_shape))
            added = bb.emit(relax.op.add(conv, bias))
            bn = bb.emit(relax.op.nn.batch_norm(added, relax.const(GAMMA), relax.const(BETA),
                                                relax.const(MEAN), relax.const(VAR), axis=1,
                                                epsilon=1e-5, training=training))
            y = bb.emit(relax.TupleGetItem(bn, 0))
            out = bb.emit_output(relax.op.nn.relu(y))
        bb.emit_func_output(out)
    return bb.get()


def _expected():
    """conv2d(x, W * scale) + ((B - mean) * scale + beta), in the pass's binding order."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 3, 8, 8), "float32"))
    with bb.function("main", [x]):
        with bb.dataflow():
            plus_eps = bb.emit(relax.op.add(relax.const(VAR), relax.const(1e-5, "float32")))
            scale = bb.emit(relax.op.divide(relax.const(GAMMA), bb.emit(relax.op.sqrt(plus_eps))))
            w = bb.emit(relax.op.multiply(relax.const(W), bb.emit(relax.op.reshape(scale,
                                                                                   [C, 1, 1, 1]))))
            conv = bb.emit(relax.op.nn.conv2d(x, w, padding=1))
            centred = bb.emit(relax.op.subtract(bb.emit(relax.op.reshape(relax.const(B), [C])),
                                                relax.const(MEAN)))
            shift = bb.emit(relax.op.add(bb.emit(relax.op.multiply(centred, scale)),
                                         relax.const(BETA)))
            added = bb.emit(relax.op.add(conv, bb.emit(relax.op.reshape(shift, [1, C, 1, 1]))))
            out = bb.emit_output(relax.op.nn.relu(added))
        bb.emit_func_output(out)
    return bb.get()


def test_bn_after_conv_and_reshaped_bias_folds_into_weights_and_bias():
    tvm.ir.assert_structural_equal(FoldBatchNormToConvBias()(_before()), _expected())


def test_declines_non_constant_weights_training_bn_and_scalar_bias():
    weight = relax.Var("w", relax.TensorType((C, 3, 3, 3), "float32"))
    for before in (_before(weight=weight), _before(training=True),
                   _before(bias_shape=(1, 1, 1, 1), reshape_bias=False)):
        tvm.ir.assert_structural_equal(FoldBatchNormToConvBias()(before), before)


def test_folded_onnx_conv_with_bias_matches_onnxruntime():
    for opset in (7, 15):  # BatchNormalization-7 (spatial) and -15
        g = ExportStyleGraph("conv_bias_bn", opset, seed=1)
        y = g.relu(g.bn(g.conv("input", 3, 8, 3, bias=True), 8))
        model = g.model([1, 3, 8, 8], y, batch=1)
        mod = FoldBatchNormToConvBias()(relax.frontend.onnx.from_onnx(
            model, keep_params_in_input=False))
        assert "batch_norm" not in mod["main"].script()
        x = np.random.default_rng(2).standard_normal((1, 3, 8, 8)).astype("float32")
        np.testing.assert_allclose(run_tvm_cpu(mod, {"input": x})[0],
                                   run_onnxruntime(model, {"input": x})[0], rtol=1e-5, atol=1e-5)
