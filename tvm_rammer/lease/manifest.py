"""A lease library's manifest (``NAME.json``, format ``tvm-rammer-lib/1``) and its raw weights.

A lease library is ``NAME.so`` (code only: compiled with the weights apart, ``RammerConfig(
weights="apart")``), ``NAME.json`` beside it, and the raw weights: regenerated from the zoo model
the manifest names (``tvm_rammer.models``: numpy and onnx, the same seed) or read from
``NAME.weights.npz`` (arrays by ONNX initializer name). Calling convention::

    raw = [tensor(a, dev) for a in raw weights, in "raw_weights" order]
    w = vm["transform_params"](*raw) if manifest["transform"] else raw    # once, after loading
    out = vm["main"](*inputs, *w)                                         # per run

Reading and writing need only json and numpy (onnx for :func:`raw_weights` and
:func:`graph_io`), never TVM: the runtime-only runner can import this module. Only
:func:`build_library` compiles (it imports TVM's compiler and the rest of tvm_rammer when called).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

__all__ = ["FORMAT", "TRANSFORM", "FAULT_PAGE", "raw_weights", "graph_io", "make_manifest",
           "write_manifest", "read_manifest", "write_weights", "read_weights", "build_library"]

FORMAT = "tvm-rammer-lib/1"
TRANSFORM = "transform_params"  # relay_passes.lift_weights.TRANSFORM_NAME
FAULT_PAGE = "rammer_fault_page"  # tvm_rammer.codegen.faults.PAGE_FUNC
PIPELINES = ("rammer", "default")
DEVICE_TYPES = ("cuda", "cpu")
_REQUIRED = ("format", "library", "pipeline", "target", "arch", "device_type", "inputs",
             "raw_weights", "weights", "transform", "outputs", "fault_page", "model",
             "weights_file")


def _spec(shape, dtype, name=None) -> dict:
    entry = {"shape": [int(d) for d in shape], "dtype": str(np.dtype(dtype))}
    return {"name": str(name), **entry} if name is not None else entry


def raw_weights(proto) -> list:
    """``[(name, array)]``: the ONNX model's initializers in graph order, which is the order
    ``main``'s weight parameters (and ``transform_params``'s) have with the weights apart."""
    from onnx import numpy_helper  # pylint: disable=import-outside-toplevel

    return [(init.name, numpy_helper.to_array(init)) for init in proto.graph.initializer]


def graph_io(proto) -> tuple:
    """``(inputs, outputs)`` of an ONNX model with static shapes, as manifest entries: inputs are
    the graph inputs that are not initializers, with their names; outputs without."""
    from onnx import helper  # pylint: disable=import-outside-toplevel

    inits = {i.name for i in proto.graph.initializer}

    def entry(value, named):
        tensor = value.type.tensor_type
        dims = [d.dim_value for d in tensor.shape.dim]
        if any(d <= 0 for d in dims):
            raise ValueError(f"{value.name!r} has a symbolic shape {dims}: bind it (batch=, "
                             "shapes=) before writing a manifest")
        return _spec(dims, helper.tensor_dtype_to_np_dtype(tensor.elem_type),
                     value.name if named else None)

    inputs = [entry(v, True) for v in proto.graph.input if v.name not in inits]
    return inputs, [entry(v, False) for v in proto.graph.output]


def make_manifest(library: str, *, pipeline: str, target: str, arch: str | None,
                  device_type: str, inputs: list, raw: list, weights: list,
                  transform: str | None, outputs: list, fault_page: bool,
                  model: dict | None = None, weights_file: str | None = None,
                  tolerance: float | None = None) -> dict:
    """The manifest dict (contract of issue 31). ``raw``: ``[(name, array)]`` or entries
    ``{"name", "shape", "dtype"}``; ``weights``: ``[(shape, dtype)]`` or entries, what ``main``
    takes after the inputs; ``model``: ``{"zoo", "params", "batch"}`` to regenerate the weights
    (else ``weights_file`` names the ``.npz``); ``tolerance``: the largest relative error the
    outputs may have (the build's precision's, ``numerics.model_tolerance``), written when given.
    ValueError for a field out of its range."""
    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r}: choose one of {PIPELINES}")
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device_type={device_type!r}: choose one of {DEVICE_TYPES}")
    if model is not None and not {"zoo", "params", "batch"} <= set(model):
        raise ValueError(f"model={model!r}: give {{'zoo', 'params', 'batch'}} or None")
    if raw and model is None and weights_file is None:
        raise ValueError("the raw weights need a source: a zoo model (model=) or a weights file "
                         "(weights_file=)")
    raw_entries = [r if isinstance(r, dict) else _spec(r[1].shape, r[1].dtype, r[0]) for r in raw]
    weight_entries = [w if isinstance(w, dict) else _spec(*w) for w in weights]
    return {"format": FORMAT, "library": os.path.basename(library), "pipeline": pipeline,
            "target": str(target), "arch": arch, "device_type": device_type,
            "inputs": list(inputs), "raw_weights": raw_entries, "weights": weight_entries,
            "transform": transform, "outputs": list(outputs), "fault_page": bool(fault_page),
            "model": model, "weights_file": weights_file,
            **({} if tolerance is None else {"tolerance": float(tolerance)})}


def write_manifest(path, manifest: dict) -> Path:
    """Write ``manifest`` as JSON at ``path`` (written whole, then renamed into place)."""
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing or manifest.get("format") != FORMAT:
        raise ValueError(f"not a {FORMAT} manifest (missing {missing or 'format'}): build it "
                         "with make_manifest")
    path = Path(path)
    part = path.with_name(f".{path.name}.part")
    part.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(part, path)
    return path


def read_manifest(path) -> dict:
    """The manifest at ``path``, checked: ValueError naming the file and what is wrong."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no manifest at {path}: pass the NAME.json written beside the "
                         "library") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not JSON ({err}): rebuild the library") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: format {found!r}, expected {FORMAT!r}: rebuild the library "
                         "with this version of tvm-rammer")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}: rebuild the library")
    if data["transform"] is None and [w["shape"] for w in data["weights"]] != \
            [w["shape"] for w in data["raw_weights"]]:
        raise ValueError(f"{path}: 'transform' is null but 'weights' are not the raw weights: "
                         "rebuild the library")
    return data


def write_weights(path, raw: list) -> Path:
    """The raw weights ``[(name, array)]`` as an ``.npz`` (arrays by name, uncompressed)."""
    path = Path(path)
    names = [n for n, _ in raw]
    if len(set(names)) != len(names):
        raise ValueError("two raw weights share a name: the .npz keys them by name")
    part = path.with_name(f".{path.stem}.part.npz")
    # np.require, not np.ascontiguousarray: that makes a 0-d weight (a scale, a bound) 1-d
    np.savez(part, **{n: np.require(a, requirements="C") for n, a in raw})
    os.replace(part, path)
    return path


def read_weights(manifest: dict, folder) -> list:
    """The raw weights of ``manifest`` as arrays in ``raw_weights`` order, from its
    ``weights_file`` (in ``folder``) or regenerated from its zoo model; ValueError when a name,
    shape or dtype differs from the manifest's."""
    if manifest["weights_file"] is not None:
        with np.load(Path(folder) / manifest["weights_file"], allow_pickle=False) as data:
            found = {n: data[n] for n in data.files}
        source = manifest["weights_file"]
    elif manifest["model"] is not None:
        from tvm_rammer.models import get_model  # pylint: disable=import-outside-toplevel

        model = manifest["model"]
        found = dict(raw_weights(get_model(model["zoo"], batch=int(model["batch"]),
                                           **(model["params"] or {}))))
        source = f"the zoo model {model['zoo']!r}"
    else:
        found, source = {}, "nothing"
    out = []
    for want in manifest["raw_weights"]:
        array = found.get(want["name"])
        if array is None or list(array.shape) != want["shape"] or str(array.dtype) != want["dtype"]:
            raise ValueError(f"{source} has no weight {want['name']!r} of {want['dtype']}"
                             f"{want['shape']}: the weights are not this library's; rebuild them")
        out.append(np.require(array, requirements="C"))  # a 0-d weight stays 0-d
    return out


# --- building a library with its manifest (imports TVM's compiler) -------------------------------

def build_library(proto, pipeline: str = "rammer", config=None, target="rammer/nvidia-h100",
                  out: str = "model.so", model: dict | None = None,
                  weights_file: bool | None = None) -> dict:
    """Compile the ONNX model ``proto`` with its weights apart, export ``out`` (through
    ``tvm_rammer.host.cross.export`` where it exists: CUDA compiled here), write the manifest
    beside it (``out`` with ``.json``) and, unless the weights are regenerated from ``model`` (a
    zoo model's ``{"zoo", "params", "batch"}``), ``NAME.weights.npz``. ``pipeline``: "rammer"
    (``config``, a ``RammerConfig``, with ``weights="apart"``) or "default" (TVM's, the other side
    of a comparison); an ``llvm`` target builds TVM's default for the CPU. ``weights_file``: True
    writes the ``.npz`` even with a ``model``. Returns ``{"library", "manifest", "weights_file",
    "binary", "bytes", "transform"}`` (``binary``: True/False for a CUDA module compiled here or
    kept as source, None without one or without the cross helper)."""
    # pylint: disable=import-outside-toplevel  (the compiler only when building)
    from dataclasses import replace

    import tvm

    from tvm_rammer.codegen.tvm_default import run_default
    from tvm_rammer.config import RammerConfig
    from tvm_rammer.driver.frontend import import_onnx, load_onnx
    from tvm_rammer.driver.pipeline import default_pipeline, rammer_pipeline
    from tvm_rammer.target import plain_target, resolve_target

    if pipeline not in PIPELINES:
        raise ValueError(f"pipeline={pipeline!r}: choose one of {PIPELINES}")
    proto = integers_as_constants(load_onnx(proto))
    config = replace(config or RammerConfig(), weights="apart")
    mod = import_onnx(proto, weights="apart")
    cpu = str(target) == "llvm" or getattr(target, "kind", None) is not None \
        and target.kind.name == "llvm"
    if cpu:
        tgt, pipeline = tvm.target.Target("llvm"), "default"
        passes = default_pipeline(tgt, "apart")
    elif pipeline == "default":
        tgt = plain_target(target)
        passes = default_pipeline(tgt, "apart")
    else:
        tgt = resolve_target(target)
        passes = rammer_pipeline(tgt, config)
    if pipeline == "default":  # TVM's default failing: one line (DefaultPipelineFailed), no traceback
        lowered = run_default(passes, mod, tgt)
    else:
        with tgt:
            lowered = passes(mod)
    ex = tvm.compile(lowered, target=tgt, relax_pipeline=None)  # lowered already
    binary = _export(ex, out, tgt)
    try:
        return _write_beside(out, lowered, proto, pipeline, target, tgt, cpu, model, weights_file,
                             binary, config.precision)
    except BaseException:
        os.remove(out)  # the library appears with its manifest and weights, or not at all
        raise


FLOAT_TYPES = (1, 10, 11, 16)  # onnx.TensorProto FLOAT, FLOAT16, DOUBLE, BFLOAT16


def integers_as_constants(proto):
    """``proto`` with its non-float initializers (Reshape's and Expand's shapes, Slice's starts,
    Range's bounds, ScatterND's index patterns) as Constant nodes, so that only the float weights
    travel apart and the shapes stay static (as parameters, an Expand's shape made llama_decode's
    repeat_kv reshape dynamic: 130 s of LLVM for one kernel); ``proto`` itself when there is none.
    The runtime picks the raw weights by name from the regenerated model, so the manifest's list
    (floats only) is all it reads."""
    from onnx import helper  # pylint: disable=import-outside-toplevel

    ints = [i for i in proto.graph.initializer if i.data_type not in FLOAT_TYPES]
    if not ints:
        return proto
    names = {i.name for i in ints}
    out = type(proto)()
    out.CopyFrom(proto)
    kept = [i for i in out.graph.initializer if i.name not in names]
    del out.graph.initializer[:]
    out.graph.initializer.extend(kept)
    inputs = [v for v in out.graph.input if v.name not in names]
    del out.graph.input[:]
    out.graph.input.extend(inputs)
    nodes = [helper.make_node("Constant", [], [i.name], value=i, name=f"const_{i.name}")
             for i in ints] + list(out.graph.node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def _write_beside(out, lowered, proto, pipeline, target, tgt, cpu, model, weights_file,
                  binary, precision) -> dict:
    """The manifest and (when not regenerated) the raw weights beside the library ``out``."""
    from tvm_rammer.numerics import model_tolerance
    from tvm_rammer.target import target_arch

    names = [gv.name_hint for gv in lowered.get_global_vars()]
    main = lowered["main"]
    num_input = int(main.attrs["num_input"])
    raw = raw_weights(proto)
    inputs, outputs = graph_io(proto)
    npz = None
    if model is None or weights_file:
        npz = str(Path(out).with_suffix("")) + ".weights.npz"
        write_weights(npz, raw)
    manifest = make_manifest(
        out, pipeline=pipeline, target=str(target), arch=None if cpu else target_arch(tgt),
        device_type="cpu" if cpu else "cuda", inputs=inputs, raw=raw,
        weights=[([int(d) for d in p.ty.shape.values], str(p.ty.dtype))
                 for p in main.params[num_input:]],
        transform=TRANSFORM if TRANSFORM in names else None, outputs=outputs,
        fault_page=FAULT_PAGE in names, model=model,
        weights_file=None if npz is None else os.path.basename(npz),
        tolerance=model_tolerance(precision, [v["dtype"] for v in inputs + outputs]))
    path = write_manifest(Path(out).with_suffix(".json"), manifest)
    return {"library": out, "manifest": str(path), "weights_file": npz, "binary": binary,
            "bytes": os.path.getsize(out), "transform": manifest["transform"]}


def _export(ex, out: str, target) -> bool | None:
    """Export ``ex`` to ``out`` (written whole: ``host.cross.export``); whether its CUDA module is
    a binary (None: no CUDA module)."""
    from tvm_rammer.host import cross  # pylint: disable=import-outside-toplevel

    done = cross.export(ex, out, target)
    return {cross.BINARY: True, cross.SOURCE: False}.get(done.cuda)
