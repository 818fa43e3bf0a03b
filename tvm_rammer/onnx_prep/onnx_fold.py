"""Fold an ONNX graph's shape computations into constants once its input shapes are static.

``torch.onnx`` writes ``x.view(n, 2, c // 2, h, w)``, ``x.chunk(2, 1)`` and friends as small
subgraphs over ``Shape`` (``Shape -> Gather -> Div -> Unsqueeze -> Concat -> Reshape``). TVM 0.27's
ONNX frontend imports some of them and fails on others (a ``Gather`` of a ``Shape`` that it turned
into a Relax shape: "shape_of expects a tensor input"). Once the inputs are bound
(:mod:`tvm_rammer.onnx_prep.shapes`), ONNX shape inference knows every tensor's shape, so each ``Shape`` of a
statically shaped tensor is a constant, and so is every node computed from such constants only.

:func:`fold_shape_subgraphs` evaluates those nodes with ``onnx.reference`` and replaces them by
initializers. It folds only ``Shape``/``Size`` nodes and nodes of :data:`FOLDABLE` ops whose inputs
are all constants and at least one of which came from a folded node: weights and the rest of the
model are untouched.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

FOLDABLE = frozenset({
    "Add", "Cast", "Ceil", "Concat", "ConstantOfShape", "Div", "Equal", "Expand", "Floor", "Gather",
    "Identity", "Less", "Greater", "Max", "Min", "Mod", "Mul", "Neg", "Range", "ReduceProd",
    "Reshape", "Slice", "Squeeze", "Sub", "Unsqueeze", "Where",
})


def _static_shapes(proto: onnx.ModelProto) -> dict:
    """{tensor name: tuple of ints} for every tensor whose inferred shape is fully static."""
    light = onnx.ModelProto()  # weights as typed inputs: inference needs their shapes only
    light.ir_version, light.producer_name = proto.ir_version, proto.producer_name
    light.opset_import.extend(proto.opset_import)
    light.graph.name = proto.graph.name
    light.graph.node.extend(proto.graph.node)
    light.graph.output.extend(proto.graph.output)
    light.graph.value_info.extend(proto.graph.value_info)
    inputs = {v.name for v in proto.graph.input}
    light.graph.input.extend(proto.graph.input)
    for init in proto.graph.initializer:
        if np.prod(init.dims, dtype=np.int64) <= 64:
            light.graph.initializer.append(init)
        elif init.name not in inputs:
            light.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type,
                                                                   list(init.dims)))
    try:
        inferred = onnx.shape_inference.infer_shapes(light, data_prop=True)
    except Exception:  # noqa: BLE001  (shape inference rejects some valid graphs; fold nothing)
        return {}
    shapes = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            shapes[value.name] = tuple(d.dim_value for d in tensor.shape.dim)
    for init in proto.graph.initializer:
        shapes[init.name] = tuple(init.dims)
    return shapes


def _constant_value(node) -> np.ndarray | None:
    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
    return None


def _evaluate(node, known: dict, opset: int) -> list | None:
    """The node's outputs on constant inputs (onnx.reference), or None when it cannot be run."""
    from onnx.reference import ReferenceEvaluator

    feeds = {f"in{i}": known[name] for i, name in enumerate(node.input) if name}
    renamed = helper.make_node(node.op_type, [f"in{i}" if name else ""
                                              for i, name in enumerate(node.input)],
                               [f"out{i}" for i in range(len(node.output))])
    renamed.attribute.extend(node.attribute)
    graph = helper.make_graph(
        [renamed], "fold",
        [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
         for n, v in feeds.items()],
        [helper.make_tensor_value_info(f"out{i}", onnx.TensorProto.UNDEFINED, None)
         for i in range(len(node.output))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    try:
        return list(ReferenceEvaluator(model).run(None, feeds))
    except Exception:  # noqa: BLE001  (an op the reference cannot run: leave the node)
        return None


def fold_shape_subgraphs(proto: onnx.ModelProto, rounds: int = 256) -> onnx.ModelProto:
    """A copy of ``proto`` whose shape computations on static shapes are initializers (``proto``
    itself when there is nothing to fold). Folding a Reshape's target shape lets shape inference
    see the shapes after it, so this repeats (at most ``rounds`` times) until nothing folds."""
    for _ in range(rounds):
        folded = _fold_once(proto)
        if folded is proto:
            break
        proto = folded
    return proto


def _fold_once(proto: onnx.ModelProto) -> onnx.ModelProto:
    if not any(n.op_type in ("Shape", "Size") for n in proto.graph.node):
        return proto
    shapes = _static_shapes(proto)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 13)
    small = {t.name: t for t in proto.graph.initializer if np.prod(t.dims, dtype=np.int64) <= 64}
    known = {name: numpy_helper.to_array(t) for name, t in small.items()}
    derived, folded = set(), []
    for node in proto.graph.node:
        if node.op_type == "Constant" and not node.domain:
            value = _constant_value(node)
            if value is not None:
                known[node.output[0]] = value
            continue
        values = None
        if node.op_type in ("Shape", "Size") and not node.domain and node.input[0] in shapes:
            values = _evaluate_shape(node, shapes[node.input[0]])
        elif node.op_type in FOLDABLE and not node.domain and \
                all(not i or i in known for i in node.input) and \
                any(i in derived for i in node.input):
            values = _evaluate(node, known, opset)
        if values is None:
            continue
        for name, value in zip(node.output, values):
            known[name] = np.asarray(value)
            derived.add(name)
        folded.append(node)
    if not folded:
        return proto
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    gone = {id(n) for n in folded}
    keep = [n for n in proto.graph.node if id(n) not in gone]
    needed = {i for n in keep for i in n.input} | {o.name for o in proto.graph.output}
    del out.graph.node[:]
    out.graph.node.extend(keep)
    new = [numpy_helper.from_array(known[name], name) for name in sorted(derived & needed)]
    out.graph.initializer.extend(new)
    if out.ir_version < 4:  # IR 3: every initializer is also a graph input
        out.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                               for t in new)
    return out


def _evaluate_shape(node, shape: tuple) -> list:
    if node.op_type == "Size":
        return [np.array(int(np.prod(shape, dtype=np.int64)), dtype=np.int64)]
    start, end = 0, len(shape)
    for attr in node.attribute:  # Shape-15: start / end
        if attr.name == "start":
            start = attr.i
        elif attr.name == "end":
            end = attr.i
    return [np.array(shape[slice(start, end)], dtype=np.int64)]
