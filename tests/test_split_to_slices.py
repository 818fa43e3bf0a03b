"""SplitToSlices keeps the computation and leaves one kernel per part."""

import numpy as np
import tvm
from onnx import TensorProto, helper
from tvm import relax
from tvm.relax.frontend.onnx import from_onnx

from relay_passes.split_to_slices import SplitToSlices

from onnx_builders import run_onnxruntime


def _split_model(splits=None):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 12])
    outs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(3)]
    inits, inputs = [], ["x"]
    if splits is not None:
        inits.append(helper.make_tensor("s", TensorProto.INT64, [3], splits))
        inputs.append("s")
    node = helper.make_node("Split", inputs, [f"y{i}" for i in range(3)], axis=1,
                            **({} if splits is not None else {"num_outputs": 3}))
    graph = helper.make_graph([node], "split", [x], outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model


def _run(mod, x):
    ex = tvm.compile(mod, target="llvm")
    out = relax.VirtualMachine(ex, tvm.cpu())["main"](tvm.runtime.tensor(x))
    return [o.numpy() for o in out]


def test_equal_and_unequal_splits_become_slices_with_the_same_result():
    x = np.random.default_rng(0).standard_normal((2, 12)).astype("float32")
    for splits in (None, [2, 4, 6]):
        model = _split_model(splits)
        mod = SplitToSlices()(from_onnx(model, keep_params_in_input=False))
        text = mod["main"].script()
        assert "R.split" not in text and text.count("R.strided_slice") == 3
        for got, want in zip(_run(mod, x), run_onnxruntime(model, {"x": x})):
            np.testing.assert_array_equal(got, want)
