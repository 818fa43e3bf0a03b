"""fold_shape_subgraphs: shape computations on static shapes become constants (so TVM's ONNX frontend
imports what torch.onnx writes for view/chunk), and nothing else changes."""

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tvm_rammer.driver.frontend import import_onnx
from tvm_rammer.onnx_prep.onnx_fold import fold_shape_subgraphs
from tvm_rammer.onnx_prep.shapes import bind_shapes

from onnx_builders import run_onnxruntime, run_tvm_cpu


def _shuffle_model(opset=13):
    """channel shuffle as torch.onnx writes ``x.view(n, 2, c // 2, h, w)`` with a symbolic n:
    Shape -> Gather -> Unsqueeze -> Concat -> Reshape, Transpose, and a Reshape back the same way."""
    def const(name, values):
        return numpy_helper.from_array(np.array(values, dtype="int64"), name)

    def unsq(src, dst):
        if opset < 13:
            return helper.make_node("Unsqueeze", [src], [dst], axes=[0])
        return helper.make_node("Unsqueeze", [src, "zero1"], [dst])

    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
        unsq("n", "n1"),
        helper.make_node("Concat", ["n1", "split_dims"], ["view"], axis=0),
        helper.make_node("Reshape", ["x", "view"], ["v"]),
        helper.make_node("Transpose", ["v"], ["t"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Shape", ["t"], ["shape2"]),
        helper.make_node("Gather", ["shape2", "zero"], ["n2"], axis=0),
        unsq("n2", "n3"),
        helper.make_node("Concat", ["n3", "flat_dims"], ["back"], axis=0),
        helper.make_node("Reshape", ["t", "back"], ["y"]),
        helper.make_node("Relu", ["y"], ["out"]),
    ]
    inits = [const("zero", 0), const("zero1", [0]), const("split_dims", [2, 4, 3, 3]),
             const("flat_dims", [8, 3, 3])]
    graph = helper.make_graph(
        nodes, "shuffle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 3, 3])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 8, 3, 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7
    onnx.checker.check_model(model)
    return model


def _ops(model):
    return [n.op_type for n in model.graph.node]


def test_static_shape_subgraphs_fold_to_constants_with_the_same_result():
    for opset in (11, 13):
        model = bind_shapes(_shuffle_model(opset), batch=2)
        folded = fold_shape_subgraphs(model)
        assert _ops(folded) == ["Reshape", "Transpose", "Reshape", "Relu"]
        x = np.random.default_rng(0).standard_normal((2, 8, 3, 3)).astype("float32")
        want = run_onnxruntime(model, {"x": x})[0]
        np.testing.assert_array_equal(run_onnxruntime(folded, {"x": x})[0], want)
        np.testing.assert_array_equal(run_tvm_cpu(import_onnx(model), {"x": x})[0], want)


def test_symbolic_shapes_and_graphs_without_shape_ops_are_left_alone():
    symbolic = _shuffle_model()
    assert fold_shape_subgraphs(symbolic) is symbolic  # Shape of an N x 8 x 3 x 3 tensor: unknown
    plain = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])]))
    assert fold_shape_subgraphs(plain) is plain
