"""ONNX in, compiled module out: ``tvm_rammer.compile(model_or_path, target=...)``."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import warnings

import onnx
import tvm
from tvm.relax.frontend.onnx import from_onnx

from ..config import RammerConfig
from ..onnx_prep.onnx_fold import fold_shape_subgraphs
from .pipeline import rammer_pipeline
from ..onnx_prep.shapes import UNBOUND_ATTR, bind_shapes, unbound_inputs
from ..target import resolve_target


def load_onnx(model) -> onnx.ModelProto:
    """An ONNX ModelProto from a ModelProto, a path or bytes; ValueError with the cause otherwise
    (a missing or unreadable file, a graph that computes nothing: :func:`check_computes`)."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return check_computes(onnx.load_from_string(bytes(model)), "the model")
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise ValueError(f"ONNX model file {path!r} does not exist"
                             + (" (it is a directory)" if os.path.isdir(path) else "")
                             + "; check the path")
        try:
            proto = onnx.load(path)
        except Exception as err:  # protobuf raises DecodeError and friends
            why = (str(err).strip().splitlines() or [type(err).__name__])[-1]
            raise ValueError(f"{path!r} is not a readable ONNX model ({why}): it is another kind "
                             "of file or was cut short; export or copy it again") from None
        return check_computes(proto, repr(path))
    raise TypeError(f"expected an onnx.ModelProto, a path or bytes, got {type(model).__name__}")


def check_computes(proto: onnx.ModelProto, what: str = "the model") -> onnx.ModelProto:
    """``proto`` when some output of its graph is computed by a node; ValueError naming the
    problem otherwise (no outputs: an empty or cut file; every output an input or initializer)."""
    graph = proto.graph
    if not graph.output:
        raise ValueError(f"{what} has no graph outputs ({len(graph.node)} nodes): there is nothing "
                         "to compile; export it again with its outputs")
    made = {name for node in graph.node for name in node.output}
    if not any(o.name in made for o in graph.output):
        names = ", ".join(repr(o.name) for o in graph.output)
        raise ValueError(f"{what} computes nothing: its output {names} is a graph input or "
                         "constant, not the result of a node; export the graph that computes it")
    return proto


# onnx.checker serialises the model it checks: past protobuf's 2 GiB (Llama-3.2-1B's shape in
# float32, read with its external data) it is checked without the weights' bytes.
CHECK_WEIGHTS_BELOW = 1 << 30


def _checkable(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` itself, or when its initializers hold more than ``CHECK_WEIGHTS_BELOW`` bytes, a
    copy whose large initializers are graph inputs of their type and shape (the graph, its
    operators and shapes are checked; the weights' values are not needed for that)."""
    sizes = [t.ByteSize() for t in proto.graph.initializer]  # (no copy of raw_data's bytes)
    if sum(sizes) <= CHECK_WEIGHTS_BELOW:
        return proto
    light = onnx.ModelProto(ir_version=proto.ir_version, opset_import=proto.opset_import,
                            functions=proto.functions)
    graph = light.graph
    graph.name = proto.graph.name
    graph.node.extend(proto.graph.node)
    graph.input.extend(proto.graph.input)
    graph.output.extend(proto.graph.output)
    graph.value_info.extend(proto.graph.value_info)
    declared = {v.name for v in proto.graph.input}
    for tensor, size in zip(proto.graph.initializer, sizes):
        if size <= 4096:
            graph.initializer.append(tensor)
        elif tensor.name not in declared:
            graph.input.append(onnx.helper.make_tensor_value_info(
                tensor.name, tensor.data_type, list(tensor.dims)))
    return light


def import_onnx(model, shapes: dict | None = None, batch: int | None = None,
                weights: str = "embedded") -> tvm.IRModule:
    """The ONNX model as a Relax module (weights become constants).

    ``shapes`` ({input name: shape}) and ``batch`` bind symbolic input dimensions first
    (:func:`tvm_rammer.onnx_prep.shapes.bind_shapes`), and shape computations on static shapes become
    constants (:func:`tvm_rammer.onnx_prep.onnx_fold.fold_shape_subgraphs`); inputs left symbolic are
    recorded on the module, and the rammer pipeline then compiles it with TVM's default pipeline and
    a warning naming them. ``weights="apart"``: the model's initializers become ``main``'s
    parameters after its inputs, in the graph's order (attribute ``num_input``; the values are not
    kept: ``tvm_rammer.lease.manifest.raw_weights`` reads them from the model), except those the
    shape folding made, which stay constants."""
    if weights not in ("embedded", "apart"):
        raise ValueError(f"weights={weights!r}: choose 'embedded' or 'apart'")
    bound = bind_shapes(check_computes(load_onnx(model)), shapes, batch)
    if weights == "apart":
        bound = _initializers_not_inputs(bound)
    proto = fold_shape_subgraphs(bound)
    try:
        onnx.checker.check_model(_checkable(proto))
    except onnx.checker.ValidationError as err:
        raise ValueError(f"invalid ONNX model: {str(err).splitlines()[0]}") from None
    printed = io.StringIO()  # the frontend prints "Error converting operator X, ..." first
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(printed):
            warnings.simplefilter("ignore")  # "unknown dimension" / "renaming": said once, by us
            mod = from_onnx(proto, keep_params_in_input=weights == "apart")
    except Exception as err:  # the frontend raises many error types for unsupported graphs
        raise ValueError(_import_error(err, printed.getvalue(), proto)) from None
    if weights == "apart":
        mod = _weights_as_params(mod, proto, [i.name for i in bound.graph.initializer])
    unbound = unbound_inputs(proto)
    return mod.with_attr(UNBOUND_ATTR, json.dumps(unbound)) if unbound else mod


def _import_error(err: Exception, printed: str, proto: onnx.ModelProto) -> str:
    """One line for a failed import: the operator TVM's frontend failed on when it said which
    (with the model's opset: a newer opset's operator of an older name, like opset 23's Attention,
    reaches a converter written for another), and the frontend's last line of error."""
    last = (str(err).strip().splitlines() or [type(err).__name__])[-1]
    found = re.search(r"Error converting operator (\S+?),", printed)
    if not found:
        return f"TVM's ONNX frontend cannot import this model: {last}"
    opset = max((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), default=0)
    return (f"TVM's ONNX frontend cannot import operator {found.group(1)} of this model (opset "
            f"{opset}): {type(err).__name__} {last}; export the model at another opset or without "
            f"this operator")


def _initializers_not_inputs(proto: onnx.ModelProto) -> onnx.ModelProto:
    """``proto`` without the graph inputs that are initializers (IR < 4 and
    ``keep_initializers_as_inputs`` exports list them; the frontend would make each a parameter
    twice): a copy at IR version 4 or later, or ``proto`` itself when none is listed."""
    inits = {i.name for i in proto.graph.initializer}
    if not any(v.name in inits for v in proto.graph.input):
        return proto
    out = onnx.ModelProto.FromString(proto.SerializeToString())
    kept = [v for v in out.graph.input if v.name not in inits]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    out.ir_version = max(out.ir_version, 4)
    return out


def _weights_as_params(mod: tvm.IRModule, proto, raw_names: list) -> tvm.IRModule:
    """``mod`` imported with ``keep_params_in_input``: the values detached (they travel apart), and
    the initializers that are not the model's own (``raw_names``: made by the shape folding)
    bound back as constants, so main's weights are exactly the model's initializers, in order."""
    from tvm import relax  # pylint: disable=import-outside-toplevel

    mod, params = relax.frontend.detach_params(mod)
    main = mod["main"]
    num_input = int(main.attrs["num_input"])
    weights = list(main.params[num_input:])
    names = [i.name for i in proto.graph.initializer]
    if len(weights) != len(names):
        raise ValueError(f"TVM's ONNX frontend made {len(weights)} weight parameters of "
                         f"{len(names)} initializers: compile this model with the weights embedded")
    own = set(raw_names)
    folded = {w: relax.const(value) for w, name, value in zip(weights, names, params["main"])
              if name not in own}
    if [n for n in names if n in own] != list(raw_names):
        raise ValueError("TVM's ONNX frontend reordered the initializers: compile this model with "
                         "the weights embedded")
    if folded:
        kept = [p for p in main.params if p not in folded]
        body = relax.BlockBuilder().normalize(relax.Function(
            kept, _bind(main.body, folded), main.ret_ty, main.is_pure, main.attrs))
        mod = tvm.IRModule({**dict(mod.functions_items()), mod.get_global_var("main"): body},
                           attrs=mod.attrs)
    return mod


def _bind(expr, values: dict):
    from relay_passes.lift_weights import substitute  # pylint: disable=import-outside-toplevel
    return substitute(expr, values)


def lower(mod: tvm.IRModule, target, config: RammerConfig | None = None,
          profiler=None) -> tvm.IRModule:
    """Run the rammer Relax pipeline only (no CUDA compilation): for inspection and counting.
    ``profiler``: where kernel times come from (default: ``backend.make_profiler``)."""
    target = resolve_target(target)
    with target:
        return rammer_pipeline(target, config, profiler)(mod)


def compile(model, target="rammer/nvidia-h100", config: RammerConfig | None = None,  # noqa: A001
            profiler=None, shapes: dict | None = None, batch: int | None = None):
    """Compile an ONNX model (ModelProto, path or bytes) or a Relax IRModule with the rammer pipeline.

    ``shapes`` ({input name: shape}) and ``batch`` bind an ONNX model's symbolic input dimensions
    (rPrograms need static shapes; a model left symbolic gets TVM's default pipeline).
    ``config.weights="apart"``: an ONNX model's weights are parameters (:func:`import_onnx`), and
    the executable has ``transform_params(*raw_weights)`` and ``main(*inputs, *weights)``.
    Returns the ``tvm.relax.VMExecutable`` that ``tvm.compile`` returns; run it with
    ``relax.VirtualMachine(ex, tvm.cuda())``.
    """
    mod = _module(model, shapes, batch, getattr(config, "weights", "embedded"))
    target = resolve_target(target)
    return tvm.compile(mod, target=target, relax_pipeline=rammer_pipeline(target, config, profiler))


def _module(model, shapes, batch, weights="embedded") -> tvm.IRModule:
    if isinstance(model, tvm.IRModule):
        if shapes or batch is not None:
            raise ValueError("shapes= and batch= bind an ONNX model's inputs; a Relax module's "
                             "shapes are already fixed (pass the ONNX model instead)")
        return model
    return import_onnx(model, shapes, batch, weights)
