"""``tvm-rammer run --emulate`` and the demo without a GPU: both pipelines on the emulator, checked.

:func:`run_model` is :func:`tvm_rammer.run.runner.run_model` with the emulator for the GPU: the model
compiled with tvm-rammer's pipeline and with TVM's default pipeline, each run once on seeded inputs
and compared with onnxruntime (with TVM's default pipeline's outputs when onnxruntime is missing).
The result has the GPU run's keys (``rammer.max_rel_err``, ``default.max_rel_err``, ``ok``,
``reference``) with ``"device": "emulator"``; its times are the emulator's wall seconds on this CPU
(``emulated_wall_s``), never GPU latencies, so there is no ``latency_us`` and no speedup.
"""

from __future__ import annotations

from ...codegen.tvm_default import reason_of
from ...config import RammerConfig
from ...driver.frontend import load_onnx
from ...host import packages
from ...run.runner import (REFERENCE_DEFAULT, model_tolerance_of, onnx_reference, random_inputs,
                           record_errors)
from ...onnx_prep.shapes import bind_shapes
from . import emulate, emulation_build

__all__ = ["run_model", "format_result", "demo", "PIPELINES"]

PIPELINES = ("rammer", "default")


def run_model(model, target, config: RammerConfig | None = None, seed: int = 0,
              tolerance: float | None = None, shapes: dict | None = None, batch: int | None = None,
              order="forward", wall_limit_s: float = 600.0) -> dict:
    """Both pipelines on the emulator against the reference (see the module docstring).

    Per pipeline: ``max_rel_err``, ``emulated_wall_s``, ``gxx_s`` (the C++ build, 0.0 when
    cached), ``build_s`` (the model's compilation) and ``launches`` (kernel launches of the run);
    when TVM's default pipeline cannot compile the model, ``default`` holds only ``error``.
    ``tolerance`` defaults to the model's precision's (``runner.model_tolerance_of``: float32
    1e-4, float16 2e-2 relative).
    Raises ``faults.KernelFault`` when a persistent kernel recorded a fault."""
    from .build import _compiler

    _compiler()  # no C++ compiler: EmulatorError naming the fix, before anything is compiled
    proto = bind_shapes(load_onnx(model), shapes, batch)
    feeds = random_inputs(proto, seed)
    ref = None if packages.missing("onnxruntime") else onnx_reference(proto, feeds)
    results = {"device": "emulator", "model": getattr(proto.graph, "name", ""),
               "reference": "onnxruntime" if ref is not None else REFERENCE_DEFAULT,
               "order": order,
               "times": "emulated_wall_s and gxx_s are wall seconds of the CPU emulator and of its "
                        "C++ build on this machine: not GPU times"}
    outputs = {}
    for label in PIPELINES:
        try:
            build = emulation_build(proto, target, config, pipeline=label)
        except Exception as err:  # noqa: BLE001  (TVM's own pipeline may fail on a model)
            if label == "rammer":
                raise
            results[label] = {"error": reason_of(err)}
            continue
        run = emulate(build, feeds, order=order, wall_limit_s=wall_limit_s)
        outputs[label] = run.outputs
        results[label] = {"emulated_wall_s": run.emulated_wall_s, "gxx_s": run.gxx_seconds,
                          "build_s": run.build_seconds, "launches": len(run.launches)}
    record_errors(outputs, ref, results)
    results["tolerance"] = model_tolerance_of(proto, config) if tolerance is None else tolerance
    results["ok"] = results["rammer"]["max_rel_err"] <= results["tolerance"]
    return results


def format_result(result: dict) -> str:
    """Error against the reference and emulated wall time of both pipelines, and the verdict."""
    lines = [f"device emulator (the CPU; emulated wall times are not GPU times); outputs checked "
             f"against {result['reference']}"]
    for label, name in (("rammer", "tvm-rammer "), ("default", "TVM default")):
        r = result[label]
        if "error" in r:
            lines.append(f"{name}: {r['error']}")
            continue
        lines.append(f"{name}: max rel err {r['max_rel_err']:.2e}  emulated {r['emulated_wall_s']:7.3f} s"
                     f"  ({r['launches']} launches; C++ build {r['gxx_s']:.1f} s)")
    if result["ok"]:
        lines.append("OK")
    else:
        lines.append(f"MISMATCH: tvm-rammer's outputs differ from {result['reference']} (max rel "
                     f"err {result['rammer']['max_rel_err']:.2e} > tolerance "
                     f"{result['tolerance']:.0e})")
    return "\n".join(lines)


def demo(model, target, config) -> int:
    """``tvm-rammer demo`` without a GPU (``run.runner.demo``'s ``emulate``, handed in by the CLI):
    the model run on the CPU emulator (a C++ compiler needed) and checked; the exit code."""
    import shutil

    if not any(shutil.which(c) for c in ("g++", "clang++", "c++")):
        print("no CUDA GPU and no C++ compiler here: compiled and scheduled only (install g++ to "
              "run the demo on the CPU emulator, or run `tvm-rammer run` on a GPU)")
        return 0
    from ...codegen import faults
    from .errors import EmulatorError

    print("no CUDA GPU here: running the generated CUDA on the CPU emulator")
    try:
        result = run_model(model, target, config)
    except (faults.KernelFault, EmulatorError) as err:  # a fault, a deadlock, a failed build
        print(f"tvm-rammer: error: {err}")
        return 1
    print(format_result(result))
    return 0 if result["ok"] else 1
