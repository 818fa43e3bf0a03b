"""RemoveInferenceDropout: dropout becomes its input; the mask a constant nobody needs."""

import numpy as np
import onnx
import tvm
from onnx import TensorProto, helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx
from tvm.script import ir as I
from tvm.script import relax as R

from relay_passes.inference_dropout import RemoveInferenceDropout

from onnx_builders import run_onnxruntime, run_tvm_cpu


@I.ir_module
class Before:
    @R.function
    def main(x: R.Tensor((2, 4), "float32")) -> R.Tensor((2, 4), "float32"):
        with R.dataflow():
            t = R.nn.dropout(x, rate=0.2)
            y = t[0]
            z = R.nn.relu(y)
            R.output(z)
        return z


@I.ir_module
class Expected:
    @R.function
    def main(x: R.Tensor((2, 4), "float32")) -> R.Tensor((2, 4), "float32"):
        with R.dataflow():
            mask = R.ones(R.shape([2, 4]), "float32")
            t = (x, mask)
            y = t[0]
            z = R.nn.relu(y)
            R.output(z)
        return z


@I.ir_module
class ExpectedAfterCleanup:
    @R.function
    def main(x: R.Tensor((2, 4), "float32")) -> R.Tensor((2, 4), "float32"):
        with R.dataflow():
            z = R.nn.relu(x)
            R.output(z)
        return z


def test_dropout_becomes_its_input_and_a_ones_mask():
    tvm.ir.assert_structural_equal(RemoveInferenceDropout()(Before), Expected)


def test_unused_mask_disappears_with_canonicalize_and_dce():
    cleanup = tvm.transform.Sequential([RemoveInferenceDropout(),
                                        relax.transform.CanonicalizeBindings(),
                                        relax.transform.DeadCodeElimination()])
    tvm.ir.assert_structural_equal(cleanup(Before), ExpectedAfterCleanup)


def test_module_without_dropout_is_unchanged():
    tvm.ir.assert_structural_equal(RemoveInferenceDropout()(ExpectedAfterCleanup),
                                   ExpectedAfterCleanup)


def test_onnx_dropout_with_mask_output_matches_onnxruntime():
    for opset in (9, 13):  # ratio as an attribute, then as an input
        ratio = [] if opset < 12 else ["r"]
        nodes = [helper.make_node("Dropout", ["x", *ratio], ["y", "mask"],
                                  **({"ratio": 0.3} if opset < 12 else {})),
                 helper.make_node("Relu", ["y"], ["z"])]
        inits = [] if opset < 12 else [helper.make_tensor("r", TensorProto.FLOAT, [], [0.3])]
        graph = helper.make_graph(nodes, "dropout", [helper.make_tensor_value_info(
            "x", TensorProto.FLOAT, [2, 5])], [helper.make_tensor_value_info(
                "z", TensorProto.FLOAT, [2, 5])], initializer=inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 7
        onnx.checker.check_model(model)
        mod = RemoveInferenceDropout()(from_onnx(model, keep_params_in_input=False))
        assert "dropout" not in mod["main"].script()
        x = np.random.default_rng(0).standard_normal((2, 5)).astype("float32")
        np.testing.assert_array_equal(run_tvm_cpu(mod, {"x": x})[0],
                                      run_onnxruntime(model, {"x": x})[0])
