"""Seeded inputs, onnxruntime's outputs and the error measure, as the compiler side makes them.

In: a :class:`~tvm_rammer.runtime.spec.LibrarySpec` (and the ONNX model for the reference).
Out: inputs (``tvm_rammer.run.runner.random_inputs``' values: one ``default_rng(seed)``, standard
normal, integers 0, in the graph's input order), onnxruntime's CPU outputs, and ``relative_error`` /
tolerances equal to ``tvm_rammer.numerics``' (repeated here: numerics' package needs no compiler,
but the runner imports nothing of tvm_rammer outside runtime/, models/ and lease.manifest).
"""

from __future__ import annotations

import numpy as np

from .spec import LibrarySpec

ORT_MAX_IR_VERSION = 10  # tvm_rammer.run.runner's: onnxruntime 1.2x takes models up to this IR version
MODEL_TOLERANCES = {"float32": 1e-4, "float16": 2e-2}

__all__ = ["seeded_inputs", "onnx_reference", "relative_error", "tolerance_of"]


def seeded_inputs(spec: LibrarySpec, seed: int = 0) -> list:
    """One array per manifest input, drawn as ``runner.random_inputs`` draws them: standard
    normal from one generator, integer inputs (token ids, positions, masks) 0 without a draw."""
    rng = np.random.default_rng(seed)
    return [np.zeros(t.shape, t.dtype) if np.issubdtype(np.dtype(t.dtype), np.integer)
            else rng.standard_normal(list(t.shape)).astype(t.dtype) for t in spec.inputs]


def onnx_reference(model, spec: LibrarySpec, inputs: list) -> list:
    """onnxruntime's CPU outputs of ``model`` (an ``onnx.ModelProto``) for ``inputs``, after
    checking that the model's graph inputs are the manifest's."""
    import onnx
    import onnxruntime as ort

    inits = {i.name for i in model.graph.initializer}
    graph_inputs = [v for v in model.graph.input if v.name not in inits]
    names = [v.name for v in graph_inputs]
    if names != [t.name for t in spec.inputs]:
        raise ValueError(f"the reference model's inputs {names} are not the manifest's "
                         f"{[t.name for t in spec.inputs]}: compare against the model the library "
                         "was built from")
    copy = onnx.ModelProto.FromString(model.SerializeToString())
    copy.ir_version = min(copy.ir_version, ORT_MAX_IR_VERSION)
    session = ort.InferenceSession(copy.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, dict(zip(names, inputs)))


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; infinite for another shape or any NaN/inf in ``out``
    (``tvm_rammer.numerics.relative_error``)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape or not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def tolerance_of(spec: LibrarySpec) -> float:
    """The manifest's tolerance, else float32's, widened to float16's when an input or output is
    half precision (``numerics.model_tolerance`` at precision float32)."""
    if spec.tolerance is not None:
        return spec.tolerance
    half = any(t.dtype in ("float16", "bfloat16") for t in spec.inputs + spec.outputs)
    return MODEL_TOLERANCES["float16" if half else "float32"]
