"""A library's raw weights as NumPy arrays, in the manifest's ``raw_weights`` order.

In: a :class:`~tvm_rammer.runtime.spec.LibrarySpec`. Out: a list of arrays, one per
``raw_weights`` entry, checked against its name, shape and dtype. They come from the manifest's
``weights_file`` (``.npz``, arrays by name) or, without one, are regenerated from the zoo model the
manifest names (``tvm_rammer.models``: NumPy and ONNX only, the same seed, so the same values).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .spec import LibrarySpec

__all__ = ["raw_weights", "zoo_model", "check_weights"]


def zoo_model(spec: LibrarySpec):
    """The ONNX model (``onnx.ModelProto``) the manifest's ``model`` names, built with NumPy."""
    from tvm_rammer.models import get_model

    if spec.model is None:
        raise ValueError(f"{spec.manifest}: 'model' is null, so the model cannot be regenerated: "
                         "give the library a weights_file, or compare against an ONNX file")
    params = dict(spec.model.get("params") or {})
    return get_model(spec.model["zoo"], batch=int(spec.model.get("batch", 1)), **params)


def _initializers(model) -> dict:
    from onnx import numpy_helper

    return {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}


def _from_file(path: Path) -> dict:
    if not path.is_file():
        raise ValueError(f"the weights file {path} is missing: copy it beside the manifest, or "
                         "set 'weights_file' to null to regenerate the zoo model's weights")
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def check_weights(spec: LibrarySpec, arrays: dict, source: str) -> list:
    """``arrays`` (name -> array) in ``raw_weights`` order; ValueError at the first name missing
    or shape/dtype other than the manifest's."""
    out = []
    for want in spec.raw_weights:
        if want.name not in arrays:
            raise ValueError(f"{source} has no weight {want.name!r} that {spec.manifest.name} "
                             f"lists ({len(spec.raw_weights)} raw weights): it belongs to another "
                             "library; rebuild the weights with the library")
        array = np.asarray(arrays[want.name])
        if tuple(array.shape) != want.shape or str(array.dtype) != want.dtype:
            raise ValueError(f"{source}: weight {want.name!r} is {array.dtype}{list(array.shape)}, "
                             f"{spec.manifest.name} says {want.describe()}: the weights do not "
                             "belong to this library; rebuild the weights with the library")
        # np.ascontiguousarray makes a 0-d array 1-d (a scalar initializer: Range's bounds)
        out.append(np.require(array, requirements="C"))
    return out


def raw_weights(spec: LibrarySpec, model=None) -> list:
    """The raw weights of ``spec``'s library; ``model`` (the zoo model, when already built) saves
    building it again."""
    if not spec.raw_weights:  # a library with its weights embedded takes none
        return []
    if spec.weights_file is not None:
        return check_weights(spec, _from_file(spec.weights_file), str(spec.weights_file))
    model = zoo_model(spec) if model is None else model
    return check_weights(spec, _initializers(model), f"the zoo model {spec.name!r}")
