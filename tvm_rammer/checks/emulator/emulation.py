"""``emulate(model, inputs)``: compile (:mod:`.compile`), describe the launches (:mod:`.launches`),
build the CUDA source for the CPU (:mod:`.build`) and interpret ``main`` (:mod:`.interpret`); a
fault recorded in the module's fault page raises ``tvm_rammer.codegen.faults.KernelFault``."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from .compile import EmulationBuild, emulation_build

__all__ = ["emulate", "EmulationResult", "read_fault", "model_inputs"]



@dataclass
class EmulationResult:
    """What :func:`emulate` returns.

    ``outputs``: ``main``'s outputs as numpy arrays, a tuple result flattened in order;
    ``build_seconds``: compiling the model (Relax pipeline, TIR lowering, CUDA generation);
    ``gxx_seconds``: building the emulated module with the C++ compiler (0.0 when cached);
    ``emulated_wall_s``: wall seconds of running ``main`` on the emulator (the CPU's time, not a
    GPU's); ``launches``: one ``interpret.LaunchRecord`` per kernel launch; ``build``: the
    EmulationBuild (reusable: pass it to :func:`emulate` again)."""

    outputs: list
    build_seconds: float
    gxx_seconds: float
    emulated_wall_s: float
    launches: list = field(default_factory=list)
    build: EmulationBuild | None = None

    def timings(self) -> dict:
        return {"build_s": self.build_seconds, "gxx_s": self.gxx_seconds,
                "emulated_wall_s": self.emulated_wall_s}


def _flatten(value) -> list:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flatten(v)]
    return [] if value is None else [np.array(value, copy=True)]


def model_inputs(model, inputs, build: EmulationBuild, seed: int = 0) -> list:
    """``main``'s arguments from ``inputs``: a sequence in the ONNX inputs' order, a dict by input
    name, or None for seeded standard-normal inputs of an ONNX model
    (``runner.random_inputs``)."""
    params = build.main.params
    names = list(build.input_names) or [p.name for p in params]
    if inputs is None:
        if build.onnx is None:
            raise ValueError("inputs=None makes seeded random inputs for an ONNX model only; pass "
                             "the inputs for a Relax module (a list, or a dict by name)")
        from ...run.runner import random_inputs

        feeds = random_inputs(build.onnx, seed)
        return [feeds[n] for n in names]
    if isinstance(inputs, dict):
        unknown = sorted(set(inputs) - set(names))
        missing = [n for n in names if n not in inputs]
        if unknown or missing:
            raise ValueError(f"inputs by name: the model's inputs are {names}"
                             + (f"; unknown {unknown}" if unknown else "")
                             + (f"; missing {missing}" if missing else ""))
        return [inputs[n] for n in names]
    if isinstance(inputs, np.ndarray):
        inputs = [inputs]
    inputs = list(inputs)
    if len(inputs) != len(params):
        raise ValueError(f"the model takes {len(params)} inputs ({', '.join(names)}), got "
                         f"{len(inputs)}")
    return inputs


def read_fault(interpreter) -> dict | None:
    """The fault recorded in the interpreter's copy of the module's fault page, or None (also
    when the module has no persistent kernel with barriers)."""
    from ...codegen import faults

    if not interpreter.has_function(faults.PAGE_FUNC):
        return None
    return faults.describe(interpreter.call(faults.PAGE_FUNC, []))


def emulate(model, inputs=None, *, target="rammer/nvidia-h100", config=None, pipeline="rammer",
            shapes: dict | None = None, batch: int | None = None, order="forward",
            wall_limit_s: float = 600.0, seed: int = 0, opt: str | None = None) -> EmulationResult:
    """Compile ``model`` and run it once on the CPU emulator.

    ``model``: an ONNX model (ModelProto, path or bytes), a Relax IRModule, or an EmulationBuild
    from :func:`emulation_build` (then ``target``, ``config``, ``pipeline``, ``shapes``, ``batch``
    are not used). ``pipeline``: ``"rammer"`` (tvm-rammer's, with ``config``) or ``"default"``
    (TVM's default pipeline on the plain CUDA target). ``inputs``: numpy arrays in the ONNX inputs'
    order, a dict by input name, or None (seeded random inputs of an ONNX model, ``seed``).
    ``order``: the order blocks of a launch are scheduled in (``"forward"``, ``"reverse"`` or an
    int seed), ``wall_limit_s``: each launch's wall-clock limit (``build.EmulatorDeadlock``
    past it). Raises ``tvm_rammer.codegen.faults.KernelFault`` when a persistent kernel recorded a fault
    (its ``result`` attribute holds the EmulationResult of the invalid run)."""
    from ...codegen import faults
    from .build import _compiler
    from .interpret import Interpreter

    if not (isinstance(model, EmulationBuild) and model.module is not None):
        _compiler()  # no C++ compiler: EmulatorError naming the fix, before compiling the model
    build = model if isinstance(model, EmulationBuild) else emulation_build(
        model, target, config, pipeline=pipeline, shapes=shapes, batch=batch)
    args = model_inputs(model, inputs, build, seed)
    module = build.emulated(opt)
    interpreter = Interpreter(build, module, order=order, wall_limit_s=wall_limit_s)
    start = time.perf_counter()
    outputs = interpreter(*args)
    wall = time.perf_counter() - start
    result = EmulationResult(outputs=_flatten(outputs), build_seconds=build.compile_seconds,
                             gxx_seconds=build.gxx_seconds, emulated_wall_s=wall,
                             launches=list(interpreter.records), build=build)
    record = read_fault(interpreter)
    if record is not None:
        timeout = getattr(build.config, "wait_timeout_ms", None) if build.config else None
        fault = faults.KernelFault(faults.message(record, timeout), record)
        fault.result = result
        raise fault
    return result
