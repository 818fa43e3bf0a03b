"""Run a compiled model on the GPU, check it against onnxruntime, time it against TVM's default."""

from __future__ import annotations

import json

import numpy as np
import onnx
import tvm
from tvm import relax

from ..codegen import faults
from ..codegen.tvm_default import default_pipeline, reason_of
from ..host import packages
from ..config import RammerConfig
from ..driver.frontend import import_onnx, load_onnx
from ..host.gpu import gpu_available
from ..numerics import model_tolerance, relative_error
from ..driver.pipeline import rammer_pipeline
from ..onnx_prep.shapes import bind_shapes
from ..target import plain_target, resolve_target

REFERENCE_DEFAULT = "TVM's default pipeline (onnxruntime is not installed)"
ORT_MAX_IR_VERSION = 10  # onnxruntime 1.2x on the CPU machines; the GPU machine takes <= 13


def random_inputs(proto: onnx.ModelProto, seed: int = 0) -> dict:
    """Seeded standard-normal inputs for every graph input that is not an initializer; integer
    inputs (token ids, cache positions, attention masks) are 0, an index in range for any axis
    (a normal draw cast to int64 gives -1 and -2: out of bounds for a Gather or a ScatterND)."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in proto.graph.initializer}
    inputs = {}
    for value in proto.graph.input:
        if value.name in inits:
            continue
        tensor = value.type.tensor_type
        dims = [d.dim_value for d in tensor.shape.dim]
        if any(d <= 0 for d in dims):
            shown = "x".join(d.dim_param or (str(d.dim_value) if d.dim_value > 0 else "?")
                             for d in tensor.shape.dim)
            names = [d.dim_param or "?" for d in tensor.shape.dim if d.dim_value <= 0]
            example = "x".join(str(d.dim_value) if d.dim_value > 0 else "1" for d in tensor.shape.dim)
            raise ValueError(
                f"input {value.name!r} has the symbolic shape {shown} ({', '.join(names)} unbound): "
                f"bind it with --input-shape {value.name}={example} (a number for "
                f"{', '.join(names)}) or --batch 1 (Python: shapes= / batch=, tvm_rammer.onnx_prep.shapes)")
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
        if np.issubdtype(dtype, np.integer):
            inputs[value.name] = np.zeros(dims, dtype)
        else:
            inputs[value.name] = rng.standard_normal(dims).astype(dtype)
    return inputs


def model_tolerance_of(proto: onnx.ModelProto, config: RammerConfig | None = None) -> float:
    """``numerics.model_tolerance`` of a model: ``config.precision`` and the element types of the
    graph's inputs and outputs (a model stored in float16 is checked at float16's tolerance)."""
    values = list(proto.graph.input) + list(proto.graph.output)
    dtypes = [onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name
              for v in values if v.type.tensor_type.elem_type]
    return model_tolerance((config or RammerConfig()).precision, dtypes)


# A model whose weights exceed this goes to onnxruntime as a file with external data: a protobuf
# cannot be serialised past 2 GiB (Llama-3.2-1B's shape in float32 is 4.9 GB).
REFERENCE_IN_MEMORY_BELOW = 1_800_000_000


def onnx_reference(proto: onnx.ModelProto, inputs: dict) -> list:
    """Outputs of onnxruntime's CPU provider."""
    return reference_session(proto)(inputs)


def reference_session(proto: onnx.ModelProto):
    """``run(feeds) -> outputs``: onnxruntime's CPU session of ``proto``, made once (``generate``
    runs it once per token). A model onnxruntime cannot load or run: ValueError in one line."""
    import onnxruntime as ort

    try:
        if sum(t.ByteSize() for t in proto.graph.initializer) > REFERENCE_IN_MEMORY_BELOW:
            session = _reference_from_file(proto)
        else:
            model = onnx.ModelProto.FromString(proto.SerializeToString())
            model.ir_version = min(model.ir_version, ORT_MAX_IR_VERSION)
            options = ort.SessionOptions()
            options.log_severity_level = 4  # its C++ errors come back as one line below
            session = ort.InferenceSession(model.SerializeToString(), options,
                                           providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime's Fail, InvalidGraph, NotImplemented...
        raise _reference_error(err) from None

    def run(inputs: dict) -> list:
        try:
            return session.run(None, inputs)
        except Exception as err:  # noqa: BLE001  (onnxruntime's own error types)
            raise _reference_error(err) from None

    return run


def _reference_error(err: Exception) -> ValueError:
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    why = lines[0] if lines else type(err).__name__
    why = why.split(" : ", 3)[-1] if why.startswith("[ONNXRuntimeError]") else why
    return ValueError(f"onnxruntime cannot run this model, so there is no reference to check "
                      f"against ({why[:300]}); check the model with onnx.checker, or use "
                      "`tvm-rammer inspect` to see its schedule")


def _reference_from_file(proto: onnx.ModelProto):
    """onnxruntime's session of a large model: written to a temporary folder with its weights as
    external data (``models.save_model``), and the session made from that file (it holds the
    weights itself once made)."""
    import os
    import tempfile

    import onnxruntime as ort

    from ..models import save_model

    model = onnx.ModelProto()
    model.CopyFrom(proto)
    model.ir_version = min(model.ir_version, ORT_MAX_IR_VERSION)
    with tempfile.TemporaryDirectory(prefix="tvm-rammer-reference-") as folder:
        path = os.path.join(folder, "model.onnx")
        save_model(model, path, external_data=True)
        del model
        return ort.InferenceSession(path, providers=["CPUExecutionProvider"])


def record_errors(outputs: dict, ref, results: dict) -> None:
    """Each pipeline's largest relative error into ``results[label]["max_rel_err"]``: against
    ``ref`` (onnxruntime's outputs), or, when ``ref`` is None (onnxruntime not installed), against
    TVM's default pipeline's outputs. ValueError when there is no reference (TVM's default failed
    too: ``results["default"]["error"]`` says why) or a pipeline returned another number of
    outputs than the reference."""
    if ref is None:
        if "default" not in outputs:
            raise ValueError(f"no reference to check against: onnxruntime is not installed and "
                             f"{results['default']['error']} (pip install onnxruntime)")
        ref = outputs["default"]
    for label, outs in outputs.items():
        if len(outs) != len(ref):
            raise ValueError(f"the {label} pipeline returned {len(outs)} outputs, the reference "
                             f"{len(ref)}")
        errs = [relative_error(o, r) for o, r in zip(outs, ref)]
        results[label]["max_rel_err"] = max(errs) if errs else 0.0


def _flatten(result) -> list:
    if isinstance(result, (list, tuple)) or type(result).__name__ == "Array":
        return [x for r in result for x in _flatten(r)]
    return [result.numpy()]


def _launch(vm, args, dev=None):
    """One run of ``main``; with ``dev``, waits for it and raises ``faults.KernelFault`` when a
    persistent kernel gave up a wait (the vEU and rTask named; the context stays usable)."""
    try:
        out = vm["main"](*args)
        if dev is not None:
            faults.check(vm)
        return out
    except faults.KernelFault:
        raise
    except Exception as err:
        text = str(err)
        if "COOPERATIVE_LAUNCH_TOO_LARGE" in text:
            raise ValueError(
                "the persistent kernel's vEUs cannot all be resident on this GPU at once "
                "(cooperative launch too large): compile with fewer vEUs per SM "
                "(RammerConfig(veus_per_sm=...)) or for this GPU's SM count (num_sms=...)") from None
        raise


def execute(ex, inputs: list, dev, runs: int = 200) -> tuple:
    """(outputs as numpy, median latency in microseconds) of one executable."""
    vm = relax.VirtualMachine(ex, dev)
    args = [tvm.runtime.tensor(x, dev) for x in inputs]
    outs = _flatten(_launch(vm, args, dev))
    timer = vm.time_evaluator("main", dev, number=max(1, runs // 10), repeat=10, min_repeat_ms=0)
    median = float(timer(*args).median * 1e6)
    faults.check(vm)  # a fault while timing: the time is not the model's (the kernels stopped)
    return outs, median


def run_model(model, target, config: RammerConfig | None = None, runs: int = 200,
              seed: int = 0, tolerance: float | None = None, shapes: dict | None = None,
              batch: int | None = None) -> dict:
    """Compile with rammer and with TVM's default pipeline, run both, compare with onnxruntime
    (without it: with TVM's default pipeline's outputs; ``result["reference"]`` says which).
    ``shapes`` / ``batch`` bind symbolic input dimensions (``tvm_rammer.onnx_prep.shapes.bind_shapes``);
    ``tolerance`` defaults to the model's precision's (:func:`model_tolerance_of`)."""
    if not gpu_available():
        raise ValueError("no CUDA GPU is visible; `tvm-rammer run MODEL --emulate` runs the model "
                         "on the CPU emulator, `tvm-rammer inspect` shows the schedule")
    proto = bind_shapes(load_onnx(model), shapes, batch)
    mod = import_onnx(proto)
    feeds = random_inputs(proto, seed)
    names = [v.name for v in proto.graph.input if v.name in feeds]
    inputs = [feeds[n] for n in names]
    # without onnxruntime, TVM's default pipeline is the reference (the CLI warned at the start)
    ref = None if packages.missing("onnxruntime") else onnx_reference(proto, feeds)
    dev = tvm.cuda(0)
    rammer = resolve_target(target)
    results = {"device": str(dev.device_name), "model": getattr(proto.graph, "name", ""),
               "reference": "onnxruntime" if ref is not None else REFERENCE_DEFAULT}
    outputs = {}
    for label, tgt in (("rammer", rammer), ("default", plain_target(rammer))):
        pipe = rammer_pipeline(rammer, config) if label == "rammer" else default_pipeline(tgt)
        try:
            ex = tvm.compile(mod, target=tgt, relax_pipeline=pipe)
        except Exception as err:  # noqa: BLE001  (TVM's own pipeline may fail on a model)
            if label == "rammer":
                raise
            results[label] = {"error": reason_of(err), "latency_us": None, "max_rel_err": None}
            continue
        outputs[label], median = execute(ex, inputs, dev, runs)
        results[label] = {"latency_us": median}
    record_errors(outputs, ref, results)
    results["speedup"] = (results["default"]["latency_us"] / results["rammer"]["latency_us"]
                          if "default" in outputs else None)
    if tolerance is None:
        tolerance = model_tolerance_of(proto, config)
    results["tolerance"] = tolerance
    results["ok"] = results["rammer"]["max_rel_err"] <= tolerance
    return results


# --- the timeline (RammerConfig(timeline=True), tvm_rammer.scheduling.timeline) -----------------------------

def build_timeline(mod: tvm.IRModule, target, config: RammerConfig | None = None) -> tuple:
    """``(executable, schedules, kernel names)`` of the instrumented build (needs no GPU).

    ``main`` of the executable returns ``(the model's outputs, (timeline buffer, ...))``, one
    buffer per name of ``kernel names`` (``relay_passes.return_timelines``); ``schedules`` are the
    rPrograms' ``timeline.schedules_of``, the predicted timeline and the key to decode the buffers.
    """
    from dataclasses import replace

    from relay_passes.return_timelines import TIMELINE_KERNELS_ATTR

    from ..scheduling import timeline
    from ..driver.frontend import lower

    rammer = resolve_target(target)
    lowered = lower(mod, rammer, replace(config or RammerConfig(), timeline=True))
    schedules = timeline.schedules_of(lowered)
    if not schedules:
        raise ValueError("this model compiles to no rProgram (see `tvm-rammer inspect`): there is no "
                         "persistent kernel to look inside")
    attrs = lowered.attrs or {}
    names = json.loads(str(attrs[TIMELINE_KERNELS_ATTR])) if TIMELINE_KERNELS_ATTR in attrs else []
    executable = tvm.compile(lowered, target=rammer, relax_pipeline=None)  # lowered already
    return executable, schedules, names


def run_timeline(model, target, config: RammerConfig | None = None, seed: int = 0,
                 warmup: int = 3) -> dict:
    """Run the instrumented build once after ``warmup`` runs and decode what it recorded.

    Returns ``measured`` and ``predicted`` (lists of ``timeline.Timeline``, one per rProgram),
    ``schedules``, and ``max_rel_err`` of the instrumented run against onnxruntime (None without
    onnxruntime: not compared)."""
    from ..scheduling import timeline

    if not gpu_available():
        raise ValueError("no CUDA GPU is visible: the measured timeline needs one (not measured); "
                         "`tvm-rammer inspect MODEL --timeline OUT` draws the predicted one")
    proto = load_onnx(model)
    feeds = random_inputs(proto, seed)
    names = [v.name for v in proto.graph.input if v.name in feeds]
    executable, schedules, kernels = build_timeline(import_onnx(proto), target, config)
    dev = tvm.cuda(0)
    vm = relax.VirtualMachine(executable, dev)
    args = [tvm.runtime.tensor(feeds[n], dev) for n in names]
    for _ in range(warmup):
        _launch(vm, args)
    outputs, buffers = _launch(vm, args)
    buffers = {name: buffer.numpy() for name, buffer in zip(kernels, buffers)}
    err = None  # not compared without onnxruntime (the CLI said so at the start)
    if not packages.missing("onnxruntime"):
        errs = [relative_error(o, r) for o, r in zip(_flatten(outputs),
                                                     onnx_reference(proto, feeds))]
        err = max(errs) if errs else 0.0
    return {"measured": timeline.decode_all(schedules, buffers),
            "predicted": timeline.predict_all(schedules), "schedules": schedules,
            "max_rel_err": err}


def record_in_context(measured, schedules, config: RammerConfig | None = None) -> int:
    """Write the measured in-context rTask times (``timeline.in_context_records``) to the profile
    database (``config.profile_db``, else the per-user cache) as kind "in_context", for the local
    GPU; returns how many records were written."""
    from ..scheduling import timeline
    from ..host.gpu import local_gpu
    from ..tuning.profile_db import default_cache_path, open_profile_db

    gpu = local_gpu()
    if gpu is None:
        raise ValueError("no CUDA GPU is visible: in-context times are recorded for the GPU they "
                         "were measured on")
    records = timeline.in_context_records(measured, schedules)
    db = open_profile_db((config.profile_db if config else None) or default_cache_path())
    try:
        db.put_many([("in_context", key, gpu.id, record) for key, record in records.items()])
    finally:
        db.close()
    return len(records)


def format_result(result: dict) -> str:
    """Error (against ``result["reference"]``) and latency of rammer next to TVM's default
    pipeline."""
    r, d = result["rammer"], result["default"]
    default = (f"TVM default: {d['error']} (latency: unavailable)\n" if d.get("error") else
               f"TVM default: max rel err {d['max_rel_err']:.2e}  median {d['latency_us']:8.2f} us\n")
    speedup = "speedup unavailable" if result.get("speedup") is None else \
        f"speedup {result['speedup']:.2f}x"
    return (f"device {result['device']}; outputs checked against "
            f"{result.get('reference', 'onnxruntime')}\n"
            f"tvm-rammer : max rel err {r['max_rel_err']:.2e}  median {r['latency_us']:8.2f} us\n"
            f"{default}{speedup}  {'OK' if result['ok'] else 'MISMATCH'}")


def demo(target, config: RammerConfig | None = None, branches: int = 16, emulate=None) -> int:
    """The main job: the bundled branch model's schedule; run and check when a GPU is present.

    ``emulate(model, target, config) -> exit code``: what to do without a GPU (the CLI hands in
    the CPU emulator's, ``checks.emulator.run.demo``: the checkers come after this stage); None:
    the schedule is printed and nothing is run."""
    from ..views.inspection import inspect_model
    from ..models import get_model
    from ..driver.report import format_schedule

    model = get_model("branches", n=branches)
    summary = inspect_model(import_onnx(model), target, config)
    print(f"model: {branches} parallel GEMV [1,256]x[256,256] + ReLU branches joined by Sum")
    print(format_schedule(summary))
    if resolve_target(target).kind.name == "rocm":  # no ROCm runtime: built and checked, not run
        from ..rocm.report import format_code_objects  # pylint: disable=import-outside-toplevel
        print(format_code_objects(summary))
        return 0
    if not gpu_available():
        if emulate is None:
            print("no CUDA GPU here: compiled and scheduled only (emulate= runs it on the CPU "
                  "emulator, as `tvm-rammer demo` does)")
            return 0
        return emulate(model, target, config)
    result = run_model(model, target, config)
    print(format_result(result))
    return 0 if result["ok"] else 1
