"""ONNX in, compiled module out: ``tvm_rammer.compile(model_or_path, target=...)``."""

from __future__ import annotations

import json
import os
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
    """An ONNX ModelProto from a ModelProto, a path or bytes; ValueError with the cause otherwise."""
    if isinstance(model, onnx.ModelProto):
        return model
    if isinstance(model, (bytes, bytearray)):
        return onnx.load_from_string(bytes(model))
    if isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isfile(path):
            raise ValueError(f"ONNX model file {path!r} does not exist")
        try:
            return onnx.load(path)
        except Exception as err:  # protobuf raises DecodeError and friends
            raise ValueError(f"{path!r} is not a readable ONNX model: {err}") from None
    raise TypeError(f"expected an onnx.ModelProto, a path or bytes, got {type(model).__name__}")


def import_onnx(model, shapes: dict | None = None, batch: int | None = None) -> tvm.IRModule:
    """The ONNX model as a Relax module (weights become constants).

    ``shapes`` ({input name: shape}) and ``batch`` bind symbolic input dimensions first
    (:func:`tvm_rammer.onnx_prep.shapes.bind_shapes`), and shape computations on static shapes become
    constants (:func:`tvm_rammer.onnx_prep.onnx_fold.fold_shape_subgraphs`); inputs left symbolic are
    recorded on the module, and the rammer pipeline then compiles it with TVM's default pipeline and
    a warning naming them."""
    proto = fold_shape_subgraphs(bind_shapes(load_onnx(model), shapes, batch))
    try:
        onnx.checker.check_model(proto)
    except onnx.checker.ValidationError as err:
        raise ValueError(f"invalid ONNX model: {str(err).splitlines()[0]}") from None
    try:
        with warnings.catch_warnings():  # "unknown dimension" / "renaming": said once, by us
            warnings.simplefilter("ignore")
            mod = from_onnx(proto, keep_params_in_input=False)
    except Exception as err:  # the frontend raises many error types for unsupported graphs
        raise ValueError(
            f"TVM's ONNX frontend cannot import this model: {str(err).strip().splitlines()[-1]}"
        ) from None
    unbound = unbound_inputs(proto)
    return mod.with_attr(UNBOUND_ATTR, json.dumps(unbound)) if unbound else mod


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
    Returns the ``tvm.relax.VMExecutable`` that ``tvm.compile`` returns; run it with
    ``relax.VirtualMachine(ex, tvm.cuda())``.
    """
    mod = _module(model, shapes, batch)
    target = resolve_target(target)
    return tvm.compile(mod, target=target, relax_pipeline=rammer_pipeline(target, config, profiler))


def _module(model, shapes, batch) -> tvm.IRModule:
    if isinstance(model, tvm.IRModule):
        if shapes or batch is not None:
            raise ValueError("shapes= and batch= bind an ONNX model's inputs; a Relax module's "
                             "shapes are already fixed (pass the ONNX model instead)")
        return model
    return import_onnx(model, shapes, batch)
