"""Static input shapes for ONNX models: bind symbolic dimensions before import.

rTasks need static shapes (``relay_passes.dataflow_graph``: a node is placeable only with static
input and output shapes), while most exported models carry a symbolic batch (``['N', 3, 224, 224]``).
:func:`bind_shapes` rewrites the ModelProto's input dims (and every other occurrence of the same
named dim: outputs, value_info) before TVM's ONNX frontend sees it:

* ``shapes={"input": (1, 3, 224, 224)}``: the whole shape of named inputs (static dims must agree);
* ``batch=N``: every input whose leading dim is symbolic gets ``N`` there.

:func:`unbound_inputs` lists what is still symbolic; the pipeline then compiles the model with TVM's
default pipeline and :func:`unbound_message` says how to bind it.
"""

from __future__ import annotations

import re

import onnx

_SHAPE_FLAG = re.compile(r"^\s*([^=]+?)\s*=\s*(\S+)\s*$")


def parse_shape(text: str) -> tuple:
    """``"1x3x224x224"`` (or ``"1,3,224,224"``) -> ``(1, 3, 224, 224)``; ValueError otherwise."""
    parts = re.split(r"[x,]", text.strip().lower())
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d < 1 for d in dims):
        raise ValueError(f"shape {text!r}: write positive integers joined by 'x', e.g. 1x3x224x224")
    return dims


def parse_shape_flag(text: str) -> tuple:
    """``"NAME=1x3x224x224"`` -> ``("NAME", (1, 3, 224, 224))``."""
    match = _SHAPE_FLAG.match(text)
    if not match:
        raise ValueError(f"--input-shape {text!r}: write NAME=DIMS, e.g. input=1x3x224x224")
    return match.group(1), parse_shape(match.group(2))


def graph_inputs(proto: onnx.ModelProto) -> list:
    """The graph inputs that are real inputs (not initializers listed as inputs, as IR < 4 and
    ``keep_initializers_as_inputs`` exports do)."""
    inits = {t.name for t in proto.graph.initializer}
    return [v for v in proto.graph.input if v.name not in inits]


def _dims(value: onnx.ValueInfoProto):
    """Dims as ints (static) or strings (symbolic; '?' when unnamed); None for an unknown rank."""
    tensor = value.type.tensor_type
    if not tensor.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else (d.dim_param or "?")
            for d in tensor.shape.dim]


def unbound_inputs(proto: onnx.ModelProto) -> dict:
    """``{input name: dims}`` for every real input whose shape is not fully static."""
    out = {}
    for value in graph_inputs(proto):
        dims = _dims(value)
        if dims is None or any(isinstance(d, str) for d in dims):
            out[value.name] = dims
    return out


def bind_shapes(proto: onnx.ModelProto, shapes: dict | None = None,
                batch: int | None = None) -> onnx.ModelProto:
    """A copy of ``proto`` whose inputs have the given static shapes.

    ``shapes`` maps input names to full shapes; ``batch`` binds every symbolic leading dim of the
    other inputs. A named dim (``dim_param``) bound on one input is bound to the same value
    wherever it occurs. ValueError for an unknown input (listing the real ones), a rank or static
    dim that disagrees with the model, a non-positive size, or one name bound to two values.
    """
    shapes = dict(shapes or {})
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"batch={batch!r}: the batch size must be an integer >= 1")
    if not shapes and batch is None:
        return proto
    inputs = {v.name: v for v in graph_inputs(proto)}
    unknown = sorted(set(shapes) - set(inputs))
    if unknown:
        raise ValueError(f"the model has no input {', '.join(map(repr, unknown))}; its inputs are "
                         f"{', '.join(repr(n) for n in inputs) or 'none'}")
    out = onnx.ModelProto()
    out.CopyFrom(proto)
    bound = {}  # dim_param -> value
    batched = []
    for value in out.graph.input:
        if value.name not in inputs:
            continue
        if value.name in shapes:
            _bind_full(value, tuple(shapes[value.name]), bound)
        elif batch is not None and _bind_leading(value, batch, bound):
            batched.append(value.name)
    if batch is not None and not batched:
        _check_static_batch(inputs, shapes, batch)
    for value in [*out.graph.input, *out.graph.output, *out.graph.value_info]:
        for dim in value.type.tensor_type.shape.dim:
            if dim.HasField("dim_param") and dim.dim_param in bound:
                dim.dim_value = bound[dim.dim_param]
    return out


def _record(name: str, size: int, bound: dict, where: str) -> None:
    if name in bound and bound[name] != size:
        raise ValueError(f"dimension {name!r} is bound to both {bound[name]} and {size} ({where}); "
                         "give every input the same size for it")
    bound[name] = size


def _bind_full(value, dims: tuple, bound: dict) -> None:
    if any(not isinstance(d, int) or isinstance(d, bool) or d < 1 for d in dims):
        raise ValueError(f"shape {dims} for input {value.name!r}: every dim must be an integer >= 1")
    current = _dims(value)
    if current is not None and len(current) != len(dims):
        raise ValueError(f"input {value.name!r} has rank {len(current)} ({_show(current)}); "
                         f"the shape given, {_show(dims)}, has rank {len(dims)}")
    if current is not None:
        for axis, (have, want) in enumerate(zip(current, dims)):
            if isinstance(have, int) and have != want:
                raise ValueError(f"input {value.name!r} has the static size {have} on axis {axis} "
                                 f"({_show(current)}); the shape given, {_show(dims)}, says {want}")
            if isinstance(have, str) and have != "?":
                _record(have, want, bound, f"input {value.name!r}, axis {axis}")
    shape = value.type.tensor_type.shape
    del shape.dim[:]
    for size in dims:
        shape.dim.add().dim_value = size


def _bind_leading(value, batch: int, bound: dict) -> bool:
    """Bind a symbolic leading dim of ``value`` to ``batch``; whether there was one."""
    dims = _dims(value)
    if not dims or not isinstance(dims[0], str):
        return False
    if dims[0] != "?":
        _record(dims[0], batch, bound, f"input {value.name!r}, axis 0")
    value.type.tensor_type.shape.dim[0].dim_value = batch
    return True


def _check_static_batch(inputs: dict, shapes: dict, batch: int) -> None:
    """``batch`` bound nothing: refuse it when it contradicts the static leading dims (a model
    exported with batch 1 does not become batch 8 by asking)."""
    leading = {name: dims[0] for name, v in inputs.items() if name not in shapes
               for dims in [_dims(v)] if dims}
    if leading and all(d != batch for d in leading.values()):
        shown = ", ".join(f"{n!r}: {d}" for n, d in leading.items())
        raise ValueError(f"batch={batch}: the model's inputs have no symbolic leading dim to bind "
                         f"(static leading dims {shown}); export the model with a symbolic batch, "
                         "or build a zoo model with `tvm-rammer model NAME --batch N`")


def _show(dims) -> str:
    return "x".join(str(d) for d in dims) if dims else "unknown rank"


def unbound_message(unbound: dict) -> str:
    """What to do about inputs that are still symbolic (``{name: dims}``)."""
    listed = "; ".join(f"{name!r} is {_show(dims) if dims is not None else 'of unknown rank'}"
                       for name, dims in unbound.items())
    name, dims = next(iter(unbound.items()))
    example = "x".join(str(d if isinstance(d, int) else 1) for d in dims) if dims else "1x3x224x224"
    return (f"symbolic input dimensions ({listed}): rPrograms need static shapes, so this model is "
            f"compiled with TVM's default pipeline. Bind them with --batch 1 or "
            f"--input-shape {name}={example} (Python: tvm_rammer.compile(model, batch=1) or "
            f"shapes={{{name!r}: ({example.replace('x', ', ')})}})")


UNBOUND_ATTR = "rammer.unbound_inputs"


def unbound_params(mod) -> dict:
    """``{name: dims}`` of ``main``'s parameters without a fully static shape (empty when all are
    static), under the ONNX input names when :func:`tvm_rammer.driver.frontend.import_onnx` recorded them,
    else the Relax names."""
    import json

    from tvm import relax, tirx

    main = next((f for gv, f in mod.functions_items()
                 if gv.name_hint == "main" and isinstance(f, relax.Function)), None)
    out = {}
    for param in main.params if main is not None else ():
        ty = param.ty
        if not isinstance(ty, relax.TensorType):
            continue
        if not isinstance(ty.shape, relax.ShapeExpr):
            out[str(param.name)] = None
        elif not all(isinstance(d, tirx.IntImm) for d in ty.shape.values):
            out[str(param.name)] = [int(d.value) if isinstance(d, tirx.IntImm) else str(d)
                                    for d in ty.shape.values]
    attrs = mod.attrs or {}
    if out and UNBOUND_ATTR in attrs:
        return json.loads(str(attrs[UNBOUND_ATTR]))
    return out
