"""Schedule and launch counts of a model under the rammer and the default pipeline (no GPU needed)."""

from __future__ import annotations

import time

import tvm
from tvm import relax

from .config import RammerConfig
from .frontend import import_onnx, lower
from .report import summarize
from .target import plain_target


def lower_default(mod: tvm.IRModule, target) -> tvm.IRModule:
    """TVM's default CUDA Relax pipeline (the baseline "RammerBase"), Relax part only."""
    plain = plain_target(target)
    with plain:
        return relax.get_default_pipeline(plain)(mod)


def inspect_lowered(model, target, config: RammerConfig | None = None, profiler=None,
                    timings: list | None = None, shapes: dict | None = None,
                    batch: int | None = None) -> tuple:
    """``(summary, rammer-lowered module)``: :func:`inspect_model`'s dict and the module it read
    (``timeline.schedules_of`` takes the predicted timeline from it). ``timings``: a list that gets
    ("TVM default pipeline", seconds) for the baseline's lowering; ``shapes`` / ``batch`` bind an
    ONNX model's symbolic inputs (``frontend.import_onnx``)."""
    mod = model if isinstance(model, tvm.IRModule) else import_onnx(model, shapes, batch)
    rammer_mod = lower(mod, target, config, profiler)
    start = time.perf_counter()
    default_mod = lower_default(mod, target)
    if timings is not None:
        timings.append(("TVM default pipeline (baseline)", time.perf_counter() - start))
    return summarize(rammer_mod, default_mod), rammer_mod


def inspect_model(model, target, config: RammerConfig | None = None, profiler=None,
                  timings: list | None = None, shapes: dict | None = None,
                  batch: int | None = None) -> dict:
    """One dict: rprograms, rtasks, veus, launches and default_launches (see report.summarize).
    ``shapes`` / ``batch`` bind an ONNX model's symbolic inputs (``frontend.import_onnx``)."""
    return inspect_lowered(model, target, config, profiler, timings, shapes, batch)[0]
