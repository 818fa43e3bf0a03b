"""Seeded inputs and the error measure every numerical check of tvm-rammer uses."""

from __future__ import annotations

import numpy as np

__all__ = ["relative_error", "seeded_array", "KERNEL_TOLERANCE", "MODEL_TOLERANCES", "model_tolerance"]

# A kernel version may differ from TVM's default kernel for the same operator by float32 rounding
# (another reduction order) only: ||version - default|| / ||default|| on seeded random inputs.
KERNEL_TOLERANCE = 1e-4

# A whole model's outputs against onnxruntime (run, run --emulate, the fuzzer): float32 rounding
# only, or, when the model computes in half precision, float16's 10 mantissa bits accumulated.
MODEL_TOLERANCES = {"float32": 1e-4, "float16": 2e-2}


def model_tolerance(precision: str = "float32", dtypes=()) -> float:
    """The largest relative error a model's outputs may have against the reference: the tolerance
    of ``precision`` (``RammerConfig.precision``), widened to float16's when any of ``dtypes`` (the
    model's input/output element types, e.g. an ONNX model stored in float16) is half precision."""
    if precision not in MODEL_TOLERANCES:
        raise ValueError(f"precision={precision!r}: choose one of {tuple(MODEL_TOLERANCES)}")
    half = any(str(d) in ("float16", "bfloat16") for d in dtypes)
    return max(MODEL_TOLERANCES[precision], MODEL_TOLERANCES["float16"] if half else 0.0)


def relative_error(out, ref) -> float:
    """||out - ref|| / ||ref|| in float64; infinite for another shape or any NaN/inf in ``out``."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return float("inf")
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def seeded_array(shape, dtype: str, rng: np.random.Generator) -> np.ndarray:
    """Kernel test input: floats uniform in [-1, 1), booleans 0/1, integers 0 (an index that is in
    range for every axis, so a gather never reads out of bounds)."""
    shape = [int(d) for d in shape]
    if dtype.startswith(("float", "bfloat")):
        return rng.uniform(-1, 1, size=shape).astype("float32").astype(dtype)
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)
