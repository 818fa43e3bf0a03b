"""The benchmark harness: every system on every model, in one run on the same device.

``run_bench(BenchOptions(...))`` returns the results document (see ``benchmarks/README.md`` for its
schema). Each model runs in a worker process (``python -m tvm_rammer.benchmarks.worker``) that is
killed when the model exceeds ``timeout_s``: a slow or crashing compile costs that model only, and
is recorded per system with the stage it was in. ``timeout_s=0`` runs in this process, unguarded.

Per model (``bench_model``): build the ONNX model, import it, compute its floor, then for each TVM
system lower (timed; launches counted), build when asked or when a GPU is present, and on a GPU
check the outputs against onnxruntime before timing; then the two PyTorch modes when available.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from tvm_rammer.host.binary_cache import ENV as BINARY_CACHE_ENV
from tvm_rammer.models import REDUCED

from .output import add_derived

SCHEMA = "tvm-rammer-bench/1"
TABLE1_MODELS = ("resnext29", "nasnet_cifar", "alexnet", "deepspeech2", "lstm_tc", "seq2seq")
NO_GPU = "timing needs a GPU: none visible"
EVENT_PREFIX = "@@bench "


@dataclass
class BenchOptions:
    """What to run. ``config`` is a dict of RammerConfig fields (it crosses a process boundary)."""

    models: tuple = TABLE1_MODELS
    batch: int = 1
    target: str = "rammer/nvidia-h100"
    config: dict = field(default_factory=dict)
    runs: int = 200
    reduced: bool = False
    build: bool = False
    timeout_s: float = 1800.0
    systems: tuple = ()  # empty = all
    seed: int = 0

    def __post_init__(self):
        from ..models import MODELS
        from .systems import ALL_SYSTEMS

        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise ValueError(f"unknown model(s) {', '.join(map(repr, unknown))}; valid names: "
                             f"{', '.join(sorted(MODELS))}")
        bad = [s for s in self.systems if s not in ALL_SYSTEMS]
        if bad:
            raise ValueError(f"unknown system(s) {bad}; choose from {', '.join(ALL_SYSTEMS)}")
        if self.batch < 1:
            raise ValueError(f"batch={self.batch}: use a batch size of at least 1")
        if self.runs < 1:
            raise ValueError(f"runs={self.runs}: use at least 1 (the median of many is reported)")
        if self.timeout_s < 0:
            raise ValueError(f"timeout={self.timeout_s}: use seconds > 0, or 0 for no timeout")

    def model_kwargs(self, name: str) -> dict:
        return dict(REDUCED.get(name, {})) if self.reduced else {}

    def selected_systems(self) -> tuple:
        """The systems named (in the table's order), or by default every one but the extra ones
        (``ios``, ``opara``, ``nimble``: only when named)."""
        from .systems import ALL_SYSTEMS, SYSTEMS

        if not self.systems:
            return SYSTEMS
        return tuple(s for s in ALL_SYSTEMS if s in self.systems)


# --- environment ----------------------------------------------------------------------------

def git_commit(path=None, short: bool = False) -> str:
    """``git rev-parse [--short] HEAD`` of the checkout holding this package, or "unknown"."""
    path = path or Path(__file__).resolve().parents[2]
    try:
        out = subprocess.run(["git", "rev-parse", *(["--short"] if short else []), "HEAD"], cwd=path,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def device_info(gpu: bool) -> dict:
    """Name, compute capability, driver and CUDA versions of GPU 0, or the host when none."""
    info = {"gpu": gpu, "host": platform.node(), "cpu": platform.processor() or platform.machine()}
    if not gpu:
        info["name"] = "cpu (no GPU visible)"
        return info
    import tvm

    from ..host.gpu import local_gpu

    local = local_gpu()
    dev = local.dev
    info.update(name=local.id.name, compute_version=str(dev.compute_version),
                multi_processor_count=int(dev.multi_processor_count),
                driver_version=local.id.driver)
    try:
        info["cuda_runtime"] = str(tvm.support.libinfo().get("CUDA_VERSION") or "unknown")
    except Exception:  # libinfo is optional in some builds
        info["cuda_runtime"] = "unknown"
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20)
            for token in out.stdout.split("|"):
                if "CUDA Version" in token:
                    info["cuda_driver_api"] = token.split("CUDA Version:")[-1].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return info


# --- one model, all systems (runs in the worker) ---------------------------------------------

def _short(err: BaseException) -> str:
    from ..codegen.tvm_default import DefaultPipelineFailed  # pylint: disable=import-outside-toplevel

    if isinstance(err, DefaultPipelineFailed):  # already one line: TVM's default cannot compile it
        return err.reason[:400]
    lines = [ln for ln in str(err).strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: {lines[-1] if lines else ''}"[:400]


def bench_model(job: dict, emit) -> None:
    """Run one model job; ``emit(event_dict)`` reports stages and per-system results as they come.

    ``job``: model, batch, kwargs, target, config, runs, build, systems, timing, seed, peaks.
    Events: {"event": "stage", "stage"}, {"event": "model", ...}, {"event": "floor", "floor"},
    {"event": "result", "system", "result"}.
    """
    import tvm

    from ..config import RammerConfig
    from ..driver.frontend import import_onnx
    from ..host.packages import why_missing
    from ..models import get_model
    from ..numerics import relative_error
    from ..run.runner import onnx_reference, random_inputs
    from . import floor as floor_mod
    from . import systems as sysmod

    name, systems = job["model"], job["systems"]
    emit({"event": "stage", "stage": "build ONNX"})
    proto = get_model(name, batch=job["batch"], **job["kwargs"])
    emit({"event": "stage", "stage": "import"})
    mod, import_s = sysmod.timed(import_onnx, proto)
    emit({"event": "model", "onnx_nodes": len(proto.graph.node), "import_s": import_s})
    emit({"event": "stage", "stage": "floor"})
    try:
        peaks = floor_mod.Peaks(**job["peaks"])
        emit({"event": "floor", "floor": floor_mod.floor(floor_mod.op_costs(mod), peaks)})
    except Exception as err:  # the floor is informative; a failure must not stop the timings
        emit({"event": "floor", "floor": {"error": _short(err)}})

    timing = job["timing"]
    inputs = ref = None
    if timing:
        feeds = random_inputs(proto, job["seed"])
        names = [v.name for v in proto.graph.input if v.name in feeds]
        inputs = [feeds[n] for n in names]
        emit({"event": "stage", "stage": "onnxruntime reference"})
        ref = onnx_reference(proto, feeds)

    def check(outs) -> float:
        errs = [relative_error(o, r) for o, r in zip(outs, ref)]
        if len(outs) != len(ref):
            return float("inf")
        return max(errs) if errs else 0.0

    config = RammerConfig(**job["config"])
    tolerance = sysmod.tolerance_for(config.precision)
    for system in sysmod.tvm_systems(job["target"], config,
                                     sysmod.TVM_SYSTEMS + sysmod.POLICY_SYSTEMS):
        if system.name not in systems:
            continue
        result = {"status": "compiled"}
        stage = "lower"
        try:
            emit({"event": "stage", "stage": f"lower {system.name}"})
            lowered, lower_s = sysmod.timed(system.lower, mod)
            result.update(compile_s=lower_s, lower_s=lower_s, compile_stage="relax pipeline",
                          **system.launches(lowered))
            if job["build"] or timing:
                stage = "build"
                emit({"event": "stage", "stage": f"build {system.name}"})
                ex, build_s = sysmod.timed(system.build, lowered)
                result.update(build_s=build_s, compile_s=lower_s + build_s,
                              compile_stage="relax pipeline + CUDA build")
            if timing:
                stage = "run"
                emit({"event": "stage", "stage": f"run {system.name}"})
                result.update(_time_checked(lambda: sysmod.run_tvm(ex, inputs, tvm.cuda(0),
                                                                   job["runs"]), check, tolerance))
        except Exception as err:
            result.update(status="failed", stage=stage, reason=_short(err))
        emit({"event": "result", "system": system.name, "result": result})

    if sysmod.NIMBLE in systems:
        from .nimble import bench_nimble

        emit({"event": "stage", "stage": f"{sysmod.NIMBLE}"})
        try:
            result = bench_nimble(mod, job["target"], timing, inputs, job["runs"], check,
                                  tolerance=tolerance, name=name)
        except Exception as err:
            result = {"status": "failed", "stage": "nimble", "reason": _short(err)}
        emit({"event": "result", "system": sysmod.NIMBLE, "result": result})

    torch_systems = [s for s in sysmod.TORCH_SYSTEMS if s in systems]
    if not torch_systems:
        return
    # a missing package first (the CLI noted it at the start), then no GPU, then torch's own check
    why = (why_missing("torch") or why_missing("onnx2torch")
           or (NO_GPU if not timing else sysmod.torch_available()))
    if why:
        for s in torch_systems:
            emit({"event": "result", "system": s, "result": {"status": "skipped", "reason": why}})
        return
    try:
        emit({"event": "stage", "stage": "onnx2torch convert"})
        module, convert_s = sysmod.timed(sysmod.torch_module, proto, config.precision)
    except Exception as err:
        for s in torch_systems:
            emit({"event": "result", "system": s, "result": {
                "status": "failed", "stage": "convert", "reason": _short(err)}})
        return
    for s in torch_systems:
        result = {"status": "compiled", "compile_s": convert_s, "compile_stage": "onnx2torch",
                  "launches": None, "launch_note": "not counted for PyTorch"}
        try:
            emit({"event": "stage", "stage": f"run {s}"})
            graph = s == sysmod.TORCH_CUDA_GRAPH
            result.update(_time_checked(
                lambda: sysmod.run_torch(module, inputs, job["runs"], graph), check, tolerance))
        except Exception as err:
            result.update(status="failed", stage="run", reason=_short(err))
        emit({"event": "result", "system": s, "result": result})


def _time_checked(run, check, tolerance: float) -> dict:
    """Run, check the outputs against onnxruntime within ``tolerance`` (``systems.tolerance_for``
    the precision), then report the timing; a mismatch is not timed."""
    outs, stats = run()
    err = check(outs)
    out = {"max_rel_err": err}
    if not err <= tolerance:
        out.update(status="mismatch", reason=f"max relative error {err:.3g} vs onnxruntime "
                                             f"exceeds {tolerance:g}; not timed")
        return out
    out.update(status="ok", latency_us=stats["median"], latency_stats=stats)
    return out


def _tolerance_of(config: dict) -> float:
    """The relative-error tolerance of a run (float32 1e-3, float16 1e-2)."""
    from .systems import tolerance_for

    return tolerance_for(config.get("precision", "float32"))


def measure_device(target: str) -> dict:
    """Worker job: the device description and the peaks (measured on a GPU, nominal otherwise)."""
    from ..host.gpu import gpu_available
    from . import floor as floor_mod

    gpu = gpu_available()
    info = device_info(gpu)
    if gpu:
        try:
            peaks = floor_mod.measure_peaks()
        except Exception as err:  # fall back, and say so
            peaks = floor_mod.nominal_peaks(target)
            peaks = floor_mod.Peaks(peaks.flops_per_s, peaks.bytes_per_s,
                                    f"{peaks.source} (measurement failed: {_short(err)})")
    else:
        peaks = floor_mod.nominal_peaks(target)
    return {"device": info, "peaks": peaks.to_json()}


# --- orchestration (the parent process) -----------------------------------------------------

class _Worker:
    """A ``python -m tvm_rammer.benchmarks.worker`` process fed one JSON job per line."""

    def __init__(self):
        self.log = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        env[BINARY_CACHE_ENV] = "off"  # compile_s times the CUDA compiler, not a cached binary
        self.proc = subprocess.Popen([sys.executable, "-m", "tvm_rammer.benchmarks.worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1, env=env, cwd=root)
        self.events = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            if line.startswith(EVENT_PREFIX):
                self.events.put(json.loads(line[len(EVENT_PREFIX):]))
        self.events.put(None)  # end of stream: the worker exited

    def send(self, job: dict) -> None:
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def stderr_tail(self, n: int = 5) -> str:
        self.log.seek(0)
        lines = [ln for ln in self.log.read().splitlines() if ln.strip()]
        return " | ".join(lines[-n:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()


def _run_guarded(worker_box: list, job: dict, timeout_s: float, on_event) -> str:
    """Send ``job`` to the (lazily started) worker; '' when it finished, else why it did not."""
    if not worker_box:
        worker_box.append(_Worker())
    worker = worker_box[0]
    worker.send(job)
    deadline = time.monotonic() + timeout_s if timeout_s else None
    stage = "start"
    while True:
        wait = 0.25 if deadline is None else max(0.0, min(0.25, deadline - time.monotonic()))
        try:
            event = worker.events.get(timeout=wait)
        except queue.Empty:
            on_event({"event": "tick"})
            if deadline is not None and time.monotonic() >= deadline:
                worker_box.clear()
                worker.kill()
                return f"timeout: exceeded --timeout {timeout_s:g} s during {stage}"
            continue
        if event is None:
            worker_box.clear()
            tail = worker.stderr_tail()
            code = worker.proc.wait()
            worker.kill()
            return f"worker died (exit code {code}) during {stage}: {tail}"[:600]
        if event["event"] == "done":
            return event.get("error", "")
        if event["event"] == "stage":
            stage = event["stage"]
        on_event(event)


def run_bench(options: BenchOptions, progress=None) -> dict:
    """Run every model of ``options`` on every selected system; the results document."""
    from ..host.gpu import gpu_available
    from . import floor as floor_mod
    from .progress import Progress

    systems = options.selected_systems()
    progress = progress or Progress(len(options.models) * (len(systems) + 1), enabled=False)
    gpu = gpu_available()
    now = datetime.datetime.now().astimezone()
    doc = {
        "schema": SCHEMA,
        "date": now.date().isoformat(),
        "timestamp": now.isoformat(timespec="seconds"),
        "git_commit": git_commit(),
        "target": options.target,
        "batch": options.batch,
        "runs": options.runs,
        "reduced": options.reduced,
        "build": options.build or gpu,
        "timeout_s": options.timeout_s,
        "config": dict(options.config),
        "systems": list(systems),
        "timing": gpu,
        "timing_note": "" if gpu else NO_GPU,
        "tolerance": _tolerance_of(options.config),
        "models": [],
    }
    worker_box = []
    try:
        if gpu:
            progress.stage("measuring device peaks")
            env = _in_worker(worker_box, {"kind": "device", "target": options.target},
                             options.timeout_s, progress)
        else:
            env = {"device": device_info(False),
                   "peaks": floor_mod.nominal_peaks(options.target).to_json()}
        doc["device"], doc["peaks"] = env["device"], env["peaks"]
        for name in options.models:
            doc["models"].append(_bench_one(worker_box, options, name, systems, doc, progress))
    finally:
        for worker in worker_box:
            worker.close()
        progress.close()

    add_derived(doc)
    return doc


def _in_worker(worker_box, job, timeout_s, progress) -> dict:
    box = {}

    def on_event(event):
        if event["event"] == "device":
            box.update(event["value"])
        progress.tick()

    why = _run_guarded(worker_box, job, timeout_s, on_event)
    if why or not box:
        raise RuntimeError(f"could not describe the device: {why or 'no answer'}")
    return box


def _bench_one(worker_box, options, name, systems, doc, progress) -> dict:
    entry = {"name": name, "kwargs": options.model_kwargs(name), "results": {}}
    job = {"kind": "model", "model": name, "batch": options.batch, "kwargs": entry["kwargs"],
           "target": options.target, "config": options.config, "runs": options.runs,
           "build": options.build, "systems": list(systems), "timing": doc["timing"],
           "seed": options.seed, "peaks": doc["peaks"]}

    def on_event(event):
        kind = event["event"]
        if kind == "stage":
            progress.stage(f"{name}: {event['stage']}")
        elif kind == "model":
            entry.update(onnx_nodes=event["onnx_nodes"], import_s=event["import_s"])
        elif kind == "floor":
            entry["floor"] = event["floor"]
            progress.advance()
        elif kind == "result":
            entry["results"][event["system"]] = event["result"]
            progress.advance()
        else:
            progress.tick()

    progress.stage(f"{name}: start")
    if options.timeout_s:
        why = _run_guarded(worker_box, job, options.timeout_s, on_event)
    else:
        why = _run_here(job, on_event)
    for s in systems:
        if s not in entry["results"]:
            status = "timeout" if why.startswith("timeout") else "failed"
            entry["results"][s] = {"status": status, "reason": why or "no result"}
            progress.advance()
    entry.setdefault("floor", {"error": why or "not computed"})
    return entry


def _run_here(job, on_event) -> str:
    try:
        bench_model(job, on_event)
    except Exception as err:
        return _short(err)
    return ""


def handle_job(job: dict, emit) -> None:
    """The worker's dispatch: a "device" job or a "model" job; always ends with a "done" event."""
    try:
        if job.get("kind") == "device":
            emit({"event": "device", "value": measure_device(job["target"])})
        else:
            bench_model(job, emit)
        emit({"event": "done"})
    except Exception as err:
        traceback.print_exc()
        emit({"event": "done", "error": _short(err)})




__all__ = ["BenchOptions", "run_bench", "bench_model", "TABLE1_MODELS", "REDUCED", "NO_GPU",
           "SCHEMA"]
